"""Thin API views: validate input, call one selector or service, shape the output."""

from __future__ import annotations

from drf_spectacular.utils import extend_schema
from rest_framework import permissions, status, viewsets
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from core.api.pagination import PaginatedListView
from core.errors import NotFound
from marketplace import selectors, services
from marketplace.api.serializers import (
    ApiTokenCreatedSerializer,
    ApiTokenCreateSerializer,
    ApiTokenSerializer,
    GpuModelSerializer,
    InvitationAcceptSerializer,
    InvitationCreatedSerializer,
    InvitationCreateSerializer,
    InvitationSerializer,
    MemberRoleSerializer,
    MemberSerializer,
    MeSerializer,
    OfferPageSerializer,
    OfferQuerySerializer,
    OfferSerializer,
    ProviderNodeActionSerializer,
    ProviderNodePriceSerializer,
    ProviderNodeSerializer,
    ProviderSerializer,
    RentalCreateSerializer,
    RentalDetailSerializer,
    RentalListQuerySerializer,
    RentalSerializer,
    SshKeyCreateSerializer,
    SshKeySerializer,
    TeamCreateSerializer,
    TeamSerializer,
)
from marketplace.lifecycle import rental_cancel, rental_stop
from marketplace.models import ApiToken
from marketplace.services.rentals import RentalRequest, RuntimeSpec, rental_create
from marketplace.services.sshkeys import ssh_key_add, ssh_key_delete
from marketplace.tenancy import request_membership, request_team


class GpuModelViewSet(viewsets.ReadOnlyModelViewSet):
    """The GPU catalog: published figures per card model."""

    permission_classes = [permissions.AllowAny]
    serializer_class = GpuModelSerializer
    lookup_field = "slug"
    filterset_fields = ["family", "tier", "bf16"]

    def get_queryset(self):
        return selectors.gpu_model_list()


class OfferListView(APIView):
    """GPUs free right now, one row per node, filtered and sorted; pages by limit and offset."""

    permission_classes = [permissions.AllowAny]

    @extend_schema(
        parameters=[OfferQuerySerializer],
        responses=OfferPageSerializer,
    )
    def get(self, request: Request) -> Response:
        query = OfferQuerySerializer(data=request.query_params)
        query.is_valid(raise_exception=True)
        data = query.validated_data
        filters = selectors.offer_filters(data)
        limit, offset = data["limit"], data["offset"]
        rows = selectors.offer_list(filters=filters, limit=limit + 1, offset=offset)
        return Response(
            {
                "next": self._page_url(request, limit, offset + limit)
                if len(rows) > limit
                else None,
                "previous": self._page_url(request, limit, max(0, offset - limit))
                if offset
                else None,
                "results": OfferSerializer(rows[:limit], many=True).data,
            }
        )

    @staticmethod
    def _page_url(request: Request, limit: int, offset: int) -> str:
        query = request.query_params.copy()
        query["limit"], query["offset"] = str(limit), str(offset)
        return request.build_absolute_uri(f"{request.path}?{query.urlencode()}")


class ApiTokenListCreateView(APIView):
    """Your API tokens for the current team: list them, or create one (its secret is shown
    once); a token acts for the team it was created in."""

    @extend_schema(responses=ApiTokenSerializer(many=True))
    def get(self, request: Request) -> Response:
        tokens = selectors.api_token_list(team=request_team(request), user=request.user)
        return Response(ApiTokenSerializer(tokens, many=True).data)

    @extend_schema(request=ApiTokenCreateSerializer, responses={201: ApiTokenCreatedSerializer})
    def post(self, request: Request) -> Response:
        body = ApiTokenCreateSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        issuer = request.auth if isinstance(request.auth, ApiToken) else None
        token, raw = services.api_token_create(
            user=request.user, team=request_team(request), issued_by=issuer, **body.validated_data
        )
        token.token = raw
        return Response(ApiTokenCreatedSerializer(token).data, status=status.HTTP_201_CREATED)


class ApiTokenRevokeView(APIView):
    """Revoke one of your tokens; another account's or another team's token id answers 404."""

    @extend_schema(request=None, responses=ApiTokenSerializer)
    def post(self, request: Request, token_id: int) -> Response:
        token = services.api_token_revoke(
            team=request_team(request), user=request.user, token_id=token_id
        )
        return Response(ApiTokenSerializer(token).data)


class SshKeyListCreateView(APIView):
    """Your team's SSH public keys (any member adds and removes them; each says who added it):
    the team's rentals that ask for SSH let them in. A malformed key, a weak one or one already
    on the team is refused (400, field `public_key`)."""

    @extend_schema(responses=SshKeySerializer(many=True))
    def get(self, request: Request) -> Response:
        return Response(
            SshKeySerializer(selectors.ssh_key_list(team=request_team(request)), many=True).data
        )

    @extend_schema(request=SshKeyCreateSerializer, responses={201: SshKeySerializer})
    def post(self, request: Request) -> Response:
        body = SshKeyCreateSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        key = ssh_key_add(team=request_team(request), owner=request.user, **body.validated_data)
        return Response(SshKeySerializer(key).data, status=status.HTTP_201_CREATED)


class SshKeyDetailView(APIView):
    """Remove one of your team's SSH keys; another team's key id answers 404."""

    @extend_schema(request=None, responses={204: None})
    def delete(self, request: Request, key_id: int) -> Response:
        ssh_key_delete(team=request_team(request), key_id=key_id)
        return Response(status=status.HTTP_204_NO_CONTENT)


class MeView(APIView):
    """Who the credentials belong to."""

    @extend_schema(responses=MeSerializer)
    def get(self, request: Request) -> Response:
        membership = request_membership(request)
        return Response(MeSerializer(request.user, context={"membership": membership}).data)


class RentalListCreateView(PaginatedListView):
    """The team's rentals: list them (optionally by status), or ask for GPUs."""

    @extend_schema(parameters=[RentalListQuerySerializer], responses=RentalSerializer(many=True))
    def get(self, request: Request) -> Response:
        query = RentalListQuerySerializer(data=request.query_params)
        query.is_valid(raise_exception=True)
        rentals = selectors.rental_list(
            team=request_team(request), status=query.validated_data["status"]
        )
        return self.paginated(rentals, RentalSerializer)

    @extend_schema(request=RentalCreateSerializer, responses={201: RentalDetailSerializer})
    def post(self, request: Request) -> Response:
        body = RentalCreateSerializer.for_data(request.data)
        body.is_valid(raise_exception=True)
        data = dict(body.validated_data)
        runtime = RuntimeSpec(**data.pop("runtime"))
        team = request_team(request)
        rental = rental_create(
            customer=request.user,
            team=team,
            member=request_membership(request),
            request=RentalRequest(
                runtime=runtime,
                gpu_models=tuple(data.pop("gpu_models")),
                gpu_families=tuple(data.pop("gpu_families")),
                datasets=tuple(data.pop("datasets")),
                **data,
            ),
        )
        rental = selectors.rental_created_detail(rental=rental)
        return Response(
            RentalDetailSerializer.for_instance(rental).data, status=status.HTTP_201_CREATED
        )


class RentalDetailView(APIView):
    """One of the team's rentals, with its event history and its GPUs."""

    @extend_schema(responses=RentalDetailSerializer)
    def get(self, request: Request, rental_id) -> Response:
        rental = selectors.rental_get(team=request_team(request), rental_id=rental_id)
        if rental is None:
            raise NotFound("no such rental")
        return Response(RentalDetailSerializer.for_instance(rental).data)


class RentalCancelView(APIView):
    """Cancel a rental that has not started; its GPUs are freed at once."""

    @extend_schema(request=None, responses=RentalDetailSerializer)
    def post(self, request: Request, rental_id) -> Response:
        team = request_team(request)
        rental_cancel(team=team, actor=request.user, rental_id=rental_id)
        rental = selectors.rental_get(team=team, rental_id=rental_id)
        return Response(RentalDetailSerializer.for_instance(rental).data)


class RentalStopView(APIView):
    """Stop a rental: a running one checkpoints and stops; a waiting one is cancelled."""

    @extend_schema(request=None, responses=RentalDetailSerializer)
    def post(self, request: Request, rental_id) -> Response:
        team = request_team(request)
        rental_stop(team=team, actor=request.user, rental_id=rental_id)
        rental = selectors.rental_get(team=team, rental_id=rental_id)
        return Response(RentalDetailSerializer.for_instance(rental).data)


class ProviderListView(APIView):
    """The providers you own (the side of the marketplace that lists GPU servers)."""

    @extend_schema(responses=ProviderSerializer(many=True))
    def get(self, request: Request) -> Response:
        providers = selectors.provider_list(owner=request.user)
        return Response(ProviderSerializer(providers, many=True).data)


class ProviderNodeListView(APIView):
    """One of your providers' nodes: status, prices and GPUs rented now; others' are 404."""

    @extend_schema(responses=ProviderNodeSerializer(many=True))
    def get(self, request: Request, provider_id: int) -> Response:
        nodes = selectors.provider_nodes(owner=request.user, provider_id=provider_id)
        if nodes is None:
            raise NotFound("no such provider")
        return Response(ProviderNodeSerializer(nodes, many=True).data)


def _provider_node(request: Request, node_id: int) -> Response:
    node = selectors.provider_node(owner=request.user, node_id=node_id)
    if node is None:
        raise NotFound("no such node")
    return Response(ProviderNodeSerializer(node).data)


class ProviderNodePriceView(APIView):
    """Set your node's price and minimum bid for new bookings; booked rentals keep theirs."""

    @extend_schema(request=ProviderNodePriceSerializer, responses=ProviderNodeSerializer)
    def patch(self, request: Request, node_id: int) -> Response:
        body = ProviderNodePriceSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        services.provider_node_price(owner=request.user, node_id=node_id, **body.validated_data)
        return _provider_node(request, node_id)


class ProviderNodeActionView(APIView):
    """Drain your node (no new rentals; running ones finish), take it for maintenance, or list
    it again."""

    @extend_schema(request=ProviderNodeActionSerializer, responses=ProviderNodeSerializer)
    def post(self, request: Request, node_id: int) -> Response:
        body = ProviderNodeActionSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        services.provider_node_action(owner=request.user, node_id=node_id, **body.validated_data)
        return _provider_node(request, node_id)


class TeamListCreateView(APIView):
    """The teams you belong to, with your role in each; POST makes a new team you own. A token
    acts for the team it was created in; the web's switcher picks a session's team."""

    @extend_schema(responses=TeamSerializer(many=True))
    def get(self, request: Request) -> Response:
        return Response(
            TeamSerializer(selectors.membership_list(user=request.user), many=True).data
        )

    @extend_schema(request=TeamCreateSerializer, responses={201: TeamSerializer})
    def post(self, request: Request) -> Response:
        body = TeamCreateSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        team = services.team_create(owner=request.user, **body.validated_data)
        membership = selectors.membership_get(user=request.user, team_id=team.pk)
        return Response(TeamSerializer(membership).data, status=status.HTTP_201_CREATED)


class TeamMemberListView(APIView):
    """The members of the current team and their roles."""

    @extend_schema(responses=MemberSerializer(many=True))
    def get(self, request: Request) -> Response:
        members = selectors.team_members(team=request_team(request))
        return Response(MemberSerializer(members, many=True).data)


class TeamMemberView(APIView):
    """Owners change a member's role or remove them; anyone may remove themselves (leave). The
    last owner stays. Another team's membership id answers 404."""

    @extend_schema(request=MemberRoleSerializer, responses=MemberSerializer)
    def patch(self, request: Request, membership_id: int) -> Response:
        body = MemberRoleSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        membership = services.team_member_role_set(
            team=request_team(request),
            actor=request.user,
            membership_id=membership_id,
            role=body.validated_data["role"],
        )
        return Response(MemberSerializer(membership).data)

    @extend_schema(request=None, responses={204: None})
    def delete(self, request: Request, membership_id: int) -> Response:
        services.team_member_remove(
            team=request_team(request), actor=request.user, membership_id=membership_id
        )
        return Response(status=status.HTTP_204_NO_CONTENT)


class InvitationListCreateView(APIView):
    """Pending invitations of the current team; owners invite by email (a single-use link that
    expires, mailed and returned once)."""

    @extend_schema(responses=InvitationSerializer(many=True))
    def get(self, request: Request) -> Response:
        invitations = selectors.invitation_pending_list(team=request_team(request))
        return Response(InvitationSerializer(invitations, many=True).data)

    @extend_schema(request=InvitationCreateSerializer, responses={201: InvitationCreatedSerializer})
    def post(self, request: Request) -> Response:
        body = InvitationCreateSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        sent = services.invitation_create(
            team=request_team(request),
            actor=request.user,
            base_url=request.build_absolute_uri("/"),
            **body.validated_data,
        )
        invitation = sent.invitation
        invitation.link, invitation.mailed = sent.link, sent.mailed
        return Response(
            InvitationCreatedSerializer(invitation).data, status=status.HTTP_201_CREATED
        )


class InvitationRevokeView(APIView):
    """Withdraw a pending invitation of the current team (owners)."""

    @extend_schema(request=None, responses=InvitationSerializer)
    def post(self, request: Request, invitation_id: int) -> Response:
        invitation = services.invitation_revoke(
            team=request_team(request), actor=request.user, invitation_id=invitation_id
        )
        return Response(InvitationSerializer(invitation).data)


class InvitationAcceptView(APIView):
    """Join a team with an invitation's link (team id and key), signed in as the address it
    was sent to. A used, withdrawn or expired link, or one for another team, changes nothing."""

    @extend_schema(request=InvitationAcceptSerializer, responses={201: TeamSerializer})
    def post(self, request: Request) -> Response:
        body = InvitationAcceptSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        membership = services.invitation_accept(
            user=request.user,
            team_id=body.validated_data["team"],
            raw=body.validated_data["key"],
        )
        return Response(TeamSerializer(membership).data, status=status.HTTP_201_CREATED)
