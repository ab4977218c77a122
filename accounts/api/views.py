"""Thin API views of accounts: validate input, call one selector or service, shape the
output."""

from __future__ import annotations

from drf_spectacular.utils import extend_schema
from rest_framework import status
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from accounts import selectors, services
from accounts.api.serializers import (
    ApiTokenCreatedSerializer,
    ApiTokenCreateSerializer,
    ApiTokenSerializer,
    InvitationAcceptSerializer,
    InvitationCreatedSerializer,
    InvitationCreateSerializer,
    InvitationSerializer,
    MemberRoleSerializer,
    MemberSerializer,
    MeSerializer,
    SecretSerializer,
    SecretSetSerializer,
    SshKeyCreateSerializer,
    SshKeySerializer,
    TeamCreateSerializer,
    TeamSerializer,
)
from accounts.models import ApiToken
from accounts.services.secrets import secret_delete, secret_set
from accounts.services.sshkeys import ssh_key_add, ssh_key_delete
from accounts.tenancy import request_membership, request_team
from core.errors import NotFound


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


class SecretListSetView(APIView):
    """Your team's secrets: list their names, or set one (created, or its value replaced, by
    name). A value is never returned by any endpoint; rentals name secrets to get them as
    variables or files, and what they print is masked with them."""

    @extend_schema(responses=SecretSerializer(many=True))
    def get(self, request: Request) -> Response:
        secrets = selectors.secret_list(team=request_team(request))
        return Response(SecretSerializer(secrets, many=True).data)

    @extend_schema(
        request=SecretSetSerializer, responses={200: SecretSerializer, 201: SecretSerializer}
    )
    def post(self, request: Request) -> Response:
        body = SecretSetSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        secret, created = secret_set(
            team=request_team(request), actor=request.user, **body.validated_data
        )
        return Response(
            SecretSerializer(secret).data,
            status=status.HTTP_201_CREATED if created else status.HTTP_200_OK,
        )


class SecretDetailView(APIView):
    """One of your team's secrets, by name (its value never); another team's is 404."""

    @extend_schema(responses=SecretSerializer)
    def get(self, request: Request, name: str) -> Response:
        secret = selectors.secret_list(team=request_team(request)).filter(name=name).first()
        if secret is None:
            raise NotFound("no such secret", field="name")
        return Response(SecretSerializer(secret).data)

    @extend_schema(request=None, responses={204: None})
    def delete(self, request: Request, name: str) -> Response:
        secret_delete(team=request_team(request), name=name)
        return Response(status=status.HTTP_204_NO_CONTENT)


class MeView(APIView):
    """Who the credentials belong to."""

    @extend_schema(responses=MeSerializer)
    def get(self, request: Request) -> Response:
        membership = request_membership(request)
        return Response(MeSerializer(request.user, context={"membership": membership}).data)


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
