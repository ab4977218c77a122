"""Every read of the notifications app, scoped to the team."""

from __future__ import annotations

from django.db.models import QuerySet

from accounts.models import Team
from core.errors import NotFound
from notifications.models import Delivery, NotificationSettings


def notification_settings_get(*, team: Team) -> NotificationSettings:
    """The team's settings; the defaults (every email on, no webhook) when never changed."""
    return NotificationSettings.objects.filter(team=team).first() or NotificationSettings(team=team)


def delivery_list(*, team: Team, state: str | None = None) -> QuerySet[Delivery]:
    deliveries = Delivery.objects.filter(notification__team=team).select_related("notification")
    if state:
        deliveries = deliveries.filter(state=state)
    return deliveries.order_by("-created_at", "-id")


def delivery_get(*, team: Team, delivery_id: int) -> Delivery:
    delivery = delivery_list(team=team).filter(pk=delivery_id).first()
    if delivery is None:
        raise NotFound("no such delivery")
    return delivery
