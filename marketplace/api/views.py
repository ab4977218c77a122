"""Thin API views: validate input, call one selector or service, shape the output."""

from __future__ import annotations

from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import generics, permissions, status, viewsets
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from marketplace import selectors, services
from marketplace.api.serializers import (
    ApiTokenCreatedSerializer,
    ApiTokenCreateSerializer,
    ApiTokenSerializer,
    GpuModelSerializer,
    OfferQuerySerializer,
    OfferSerializer,
)


class GpuModelViewSet(viewsets.ReadOnlyModelViewSet):
    """The GPU catalog: published figures per card model."""

    permission_classes = [permissions.AllowAny]
    serializer_class = GpuModelSerializer
    lookup_field = "slug"
    filterset_fields = ["family", "tier", "bf16"]

    def get_queryset(self):
        return selectors.gpu_model_list()


class OfferListView(generics.GenericAPIView):
    """GPUs free right now, one row per (node, GPU model), filtered and sorted."""

    permission_classes = [permissions.AllowAny]
    serializer_class = OfferSerializer
    filter_backends: list = []

    @extend_schema(
        parameters=[
            OfferQuerySerializer,
            OpenApiParameter("limit", int),
            OpenApiParameter("offset", int),
        ],
        responses=OfferSerializer(many=True),
    )
    def get(self, request: Request) -> Response:
        query = OfferQuerySerializer(data=request.query_params)
        query.is_valid(raise_exception=True)
        data = query.validated_data
        filters = selectors.OfferFilters(
            gpu_models=data.get("gpu_model", ()),
            gpu_families=data.get("gpu_family", ()),
            min_memory_gb=data.get("min_memory_gb"),
            min_tensor_tflops=data.get("min_tensor_tflops"),
            min_free_gpus=data.get("min_free_gpus"),
            nvlink=data.get("nvlink"),
            region=data.get("region"),
            max_price=data.get("max_price"),
            min_reliability=data.get("min_reliability"),
            ordering=data["ordering"],
        )
        page = self.paginate_queryset(selectors.offer_list(filters=filters))
        return self.get_paginated_response(OfferSerializer(page, many=True).data)


class ApiTokenListCreateView(APIView):
    """Your API tokens: list them, or create one (its secret is shown once)."""

    @extend_schema(responses=ApiTokenSerializer(many=True))
    def get(self, request: Request) -> Response:
        tokens = selectors.api_token_list(user=request.user)
        return Response(ApiTokenSerializer(tokens, many=True).data)

    @extend_schema(request=ApiTokenCreateSerializer, responses={201: ApiTokenCreatedSerializer})
    def post(self, request: Request) -> Response:
        body = ApiTokenCreateSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        token, raw = services.api_token_create(user=request.user, **body.validated_data)
        token.token = raw
        return Response(ApiTokenCreatedSerializer(token).data, status=status.HTTP_201_CREATED)


class ApiTokenRevokeView(APIView):
    """Revoke one of your tokens; another account's token id answers 404."""

    @extend_schema(request=None, responses=ApiTokenSerializer)
    def post(self, request: Request, token_id: int) -> Response:
        token = services.api_token_revoke(user=request.user, token_id=token_id)
        return Response(ApiTokenSerializer(token).data)


class MeView(APIView):
    """Who the credentials belong to."""

    @extend_schema(responses={200: dict})
    def get(self, request: Request) -> Response:
        user = request.user
        return Response(
            {
                "id": user.pk,
                "username": user.username,
                "email": user.email,
                "is_staff": user.is_staff,
                "providers": list(user.providers.values_list("name", flat=True)),
            }
        )
