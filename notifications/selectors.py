"""Every read of the notifications app, scoped to its owner."""

from __future__ import annotations

from django.db.models import QuerySet

from marketplace.errors import NotFound
from marketplace.models import User
from notifications.models import Delivery, NotificationSettings


def notification_settings_get(*, owner: User) -> NotificationSettings:
    """The owner's settings; the defaults (every email on, no webhook) when never changed."""
    return NotificationSettings.objects.filter(owner=owner).first() or NotificationSettings(
        owner=owner
    )


def delivery_list(*, owner: User, state: str | None = None) -> QuerySet[Delivery]:
    deliveries = Delivery.objects.filter(notification__owner=owner).select_related("notification")
    if state:
        deliveries = deliveries.filter(state=state)
    return deliveries.order_by("-created_at", "-id")


def delivery_get(*, owner: User, delivery_id: int) -> Delivery:
    delivery = delivery_list(owner=owner).filter(pk=delivery_id).first()
    if delivery is None:
        raise NotFound("no such delivery")
    return delivery
