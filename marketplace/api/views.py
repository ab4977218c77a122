"""Thin API views: validate input, call one selector or service, shape the output."""

from __future__ import annotations

from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework import permissions, status, viewsets
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from accounts.tenancy import request_membership, request_team
from core.api.pagination import PaginatedListView
from core.errors import NotFound, ValidationFailed
from marketplace import selectors, services
from marketplace.api.serializers import (
    ClusterSerializer,
    ClusterWriteSerializer,
    GpuModelSerializer,
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
    TemplateSerializer,
    TemplateWriteSerializer,
)
from marketplace.lifecycle import rental_cancel, rental_stop
from marketplace.services.rentals import RentalRequest, RuntimeSpec, rental_create
from marketplace.services.templates import (
    rental_body_from_template,
    template_delete,
    template_save,
)


class GpuModelViewSet(viewsets.ReadOnlyModelViewSet):
    """The GPU catalog: published figures per card model."""

    permission_classes = [permissions.AllowAny]
    serializer_class = GpuModelSerializer
    lookup_field = "slug"
    filterset_fields = ["family", "tier", "bf16"]

    def get_queryset(self):
        return selectors.gpu_model_list()


def _offers_serialized(rows: list[dict]) -> list[dict]:
    """The offers' rows as the API writes them (plain dicts: what the offers cache stores)."""
    return [dict(row) for row in OfferSerializer(rows, many=True).data]


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
        rows = selectors.offer_page(
            filters=filters, limit=limit + 1, offset=offset, shape=_offers_serialized
        )
        return Response(
            {
                "next": self._page_url(request, limit, offset + limit)
                if len(rows) > limit
                else None,
                "previous": self._page_url(request, limit, max(0, offset - limit))
                if offset
                else None,
                "results": rows[:limit],
            }
        )

    @staticmethod
    def _page_url(request: Request, limit: int, offset: int) -> str:
        query = request.query_params.copy()
        query["limit"], query["offset"] = str(limit), str(offset)
        return request.build_absolute_uri(f"{request.path}?{query.urlencode()}")


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
        team = request_team(request)
        raw = request.data
        if isinstance(raw, dict) and "template" in raw:
            # Started from one of the team's templates: its runtime under what the body gives.
            raw = rental_body_from_template(team=team, body=raw)
        body = RentalCreateSerializer.for_data(raw)
        body.is_valid(raise_exception=True)
        data = dict(body.validated_data)
        runtime = RuntimeSpec(**data.pop("runtime"))
        rental = rental_create(
            customer=request.user,
            team=team,
            member=request_membership(request),
            request=RentalRequest(
                runtime=runtime,
                gpu_models=tuple(data.pop("gpu_models")),
                gpu_families=tuple(data.pop("gpu_families")),
                datasets=tuple(data.pop("datasets")),
                secrets=tuple(data.pop("secrets")),
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
    """Set your node's price and minimum bid for new bookings (booked rentals keep theirs), or
    its cluster (one of its provider's; null: on its own)."""

    @extend_schema(request=ProviderNodePriceSerializer, responses=ProviderNodeSerializer)
    def patch(self, request: Request, node_id: int) -> Response:
        body = ProviderNodePriceSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        services.provider_node_update(owner=request.user, node_id=node_id, **body.validated_data)
        return _provider_node(request, node_id)


class ProviderClusterListView(APIView):
    """One of your providers' clusters (nodes on one fabric, where multi-node rentals go), and
    declaring a new one; another provider's are 404."""

    @extend_schema(responses=ClusterSerializer(many=True))
    def get(self, request: Request, provider_id: int) -> Response:
        clusters = selectors.provider_clusters(owner=request.user, provider_id=provider_id)
        if clusters is None:
            raise NotFound("no such provider")
        return Response(ClusterSerializer(clusters, many=True).data)

    @extend_schema(request=ClusterWriteSerializer, responses={201: ClusterSerializer})
    def post(self, request: Request, provider_id: int) -> Response:
        body = ClusterWriteSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        cluster = services.cluster_create(
            owner=request.user, provider_id=provider_id, **body.validated_data
        )
        return Response(_cluster(request, cluster.pk), status=status.HTTP_201_CREATED)


def _cluster(request: Request, cluster_id: int) -> dict:
    cluster = selectors.provider_cluster(owner=request.user, cluster_id=cluster_id)
    if cluster is None:
        raise NotFound("no such cluster")
    return ClusterSerializer(cluster).data


class ProviderClusterDetailView(APIView):
    """One of your clusters: rename it, say what its fabric is, or remove it (its nodes stay
    listed, on their own)."""

    @extend_schema(responses=ClusterSerializer)
    def get(self, request: Request, cluster_id: int) -> Response:
        return Response(_cluster(request, cluster_id))

    @extend_schema(request=ClusterWriteSerializer(partial=True), responses=ClusterSerializer)
    def patch(self, request: Request, cluster_id: int) -> Response:
        body = ClusterWriteSerializer(data=request.data, partial=True)
        body.is_valid(raise_exception=True)
        services.cluster_update(owner=request.user, cluster_id=cluster_id, **body.validated_data)
        return Response(_cluster(request, cluster_id))

    @extend_schema(responses={204: OpenApiResponse(description="removed")})
    def delete(self, request: Request, cluster_id: int) -> Response:
        services.cluster_delete(owner=request.user, cluster_id=cluster_id)
        return Response(status=status.HTTP_204_NO_CONTENT)


class ProviderNodeActionView(APIView):
    """Drain your node (no new rentals; running ones finish), take it for maintenance, or list
    it again."""

    @extend_schema(request=ProviderNodeActionSerializer, responses=ProviderNodeSerializer)
    def post(self, request: Request, node_id: int) -> Response:
        body = ProviderNodeActionSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        services.provider_node_action(owner=request.user, node_id=node_id, **body.validated_data)
        return _provider_node(request, node_id)


class TemplateListCreateView(PaginatedListView):
    """The team's rental templates: list them, or save one."""

    @extend_schema(responses=TemplateSerializer(many=True))
    def get(self, request: Request) -> Response:
        return self.paginated(
            selectors.template_list(team=request_team(request)), TemplateSerializer
        )

    @extend_schema(request=TemplateWriteSerializer, responses={201: TemplateSerializer})
    def post(self, request: Request) -> Response:
        team = request_team(request)
        body = TemplateWriteSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        values = dict(body.validated_data)
        name = values.pop("name", None)
        if not name:
            raise ValidationFailed("a name for the template", field="name")
        template = template_save(
            team=team, actor=request.user, name=name, values=values, replace=False
        )
        return Response(TemplateSerializer(template).data, status=status.HTTP_201_CREATED)


class TemplateDetailView(APIView):
    """One of the team's templates by name: read, replace (PUT) or delete it."""

    @extend_schema(responses=TemplateSerializer)
    def get(self, request: Request, name: str) -> Response:
        template = selectors.template_get(team=request_team(request), name=name)
        if template is None:
            raise NotFound("no such template")
        return Response(TemplateSerializer(template).data)

    @extend_schema(request=TemplateWriteSerializer, responses=TemplateSerializer)
    def put(self, request: Request, name: str) -> Response:
        team = request_team(request)
        body = TemplateWriteSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        values = dict(body.validated_data)
        if values.pop("name", name) != name:
            raise ValidationFailed("differs from the template's name in the path", field="name")
        template = template_save(
            team=team, actor=request.user, name=name, values=values, replace=True
        )
        return Response(TemplateSerializer(template).data)

    @extend_schema(request=None, responses={204: None})
    def delete(self, request: Request, name: str) -> Response:
        template_delete(team=request_team(request), name=name)
        return Response(status=status.HTTP_204_NO_CONTENT)
