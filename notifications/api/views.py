"""Thin API views: validate input, call one selector or service, shape the output."""

from __future__ import annotations

from drf_spectacular.utils import extend_schema
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from accounts.tenancy import request_team
from core.api.pagination import PaginatedListView
from notifications import selectors, services
from notifications.api.serializers import (
    DeliveryListQuerySerializer,
    DeliverySerializer,
    NotificationSettingsChangedSerializer,
    NotificationSettingsSerializer,
    NotificationSettingsUpdateSerializer,
)


def _changed(change: services.SettingsChange) -> Response:
    row = change.settings
    row.webhook_secret = change.webhook_secret
    return Response(NotificationSettingsChangedSerializer(row).data)


class NotificationSettingsView(APIView):
    """What your team is told, by email and by webhook, and where: every member reads it, its
    owners and billing members change it (403 for others)."""

    @extend_schema(responses=NotificationSettingsSerializer)
    def get(self, request: Request) -> Response:
        row = selectors.notification_settings_get(team=request_team(request))
        return Response(NotificationSettingsSerializer(row).data)

    @extend_schema(
        request=NotificationSettingsUpdateSerializer,
        responses=NotificationSettingsChangedSerializer,
    )
    def patch(self, request: Request) -> Response:
        team = request_team(request, money=True)
        body = NotificationSettingsUpdateSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        return _changed(services.notification_settings_update(team=team, **body.validated_data))


class WebhookSecretRotateView(APIView):
    """Draw a new webhook signing secret (the old one stops at once); shown once. Owners and
    billing members only."""

    @extend_schema(request=None, responses=NotificationSettingsChangedSerializer)
    def post(self, request: Request) -> Response:
        return _changed(services.webhook_secret_rotate(team=request_team(request, money=True)))


class DeliveryListView(PaginatedListView):
    """Your team's notifications' deliveries, newest first: attempts, last answer, delivered
    or not."""

    @extend_schema(
        parameters=[DeliveryListQuerySerializer], responses=DeliverySerializer(many=True)
    )
    def get(self, request: Request) -> Response:
        query = DeliveryListQuerySerializer(data=request.query_params)
        query.is_valid(raise_exception=True)
        deliveries = selectors.delivery_list(
            team=request_team(request), state=query.validated_data["state"]
        )
        return self.paginated(deliveries, DeliverySerializer)


class DeliveryDetailView(APIView):
    """One of your team's deliveries; another team's id answers 404."""

    @extend_schema(responses=DeliverySerializer)
    def get(self, request: Request, delivery_id: int) -> Response:
        delivery = selectors.delivery_get(team=request_team(request), delivery_id=delivery_id)
        return Response(DeliverySerializer(delivery).data)
