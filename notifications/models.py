"""Notification settings per team, the outbox of notifications and their deliveries."""

from __future__ import annotations

import uuid

from django.contrib.postgres.fields import ArrayField
from django.db import models
from django.db.models import Q


class NotificationKind(models.TextChoices):
    RENTAL_STARTED = "rental.started", "Rental started"
    RENTAL_RESUMED = "rental.resumed", "Rental resumed after a re-queue"
    RENTAL_PREEMPTED = "rental.preempted", "Rental preempted"
    RENTAL_FAILED = "rental.failed", "Rental failed"
    RENTAL_COMPLETED = "rental.completed", "Rental completed"
    BALANCE_LOW = "balance.low", "Balance low"
    BUDGET_REACHED = "budget.reached", "Budget reached"
    GPU_FAILED = "node.gpu_failed", "A GPU of your node failed"


class Channel(models.TextChoices):
    EMAIL = "email", "Email"
    WEBHOOK = "webhook", "Webhook"


class DeliveryState(models.TextChoices):
    PENDING = "pending", "Pending"
    DELIVERED = "delivered", "Delivered"
    FAILED = "failed", "Failed: no attempt left"
    SKIPPED = "skipped", "Skipped: the channel was turned off"


def _kind_list() -> ArrayField:
    return ArrayField(
        models.CharField(max_length=20, choices=NotificationKind.choices), default=list, blank=True
    )


class NotificationSettings(models.Model):
    """What a team wants to be told and where (its owners and billing members change it; every
    member reads it). Kinds are stored switched OFF, so a kind added later is on for everyone
    until they turn it off. Who of the team receives the emails: notifications.audience."""

    team = models.OneToOneField(
        "accounts.Team", on_delete=models.CASCADE, related_name="notification_settings"
    )
    email_enabled = models.BooleanField(default=True)
    email_off = _kind_list()
    webhook_url = models.URLField(max_length=500, blank=True)
    webhook_off = _kind_list()
    # The signing secret is derived from this salt and SECRET_KEY (notifications.webhooks), so
    # the database alone cannot sign; rotating draws a new salt.
    webhook_secret_salt = models.CharField(max_length=64, blank=True)
    webhook_secret_rotated_at = models.DateTimeField(null=True, blank=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        verbose_name_plural = "notification settings"

    def __str__(self) -> str:
        return f"notification settings of team {self.team_id}"


class Notification(models.Model):
    """One thing to tell a team: the outbox row, written in the transaction of the fact it
    reports. Its id is the event id receivers see on every attempt of every channel."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    team = models.ForeignKey(
        "accounts.Team", on_delete=models.CASCADE, related_name="notifications"
    )
    kind = models.CharField(max_length=20, choices=NotificationKind.choices)
    # What the notification reports, unique so that recording the same fact twice is a no-op:
    # "rental-event:<id>", "balance-notice:<id>", a budget's own key.
    source_key = models.CharField(max_length=120, unique=True)
    rental = models.ForeignKey(
        "marketplace.Rental",
        null=True,
        blank=True,
        on_delete=models.CASCADE,
        related_name="notifications",
    )
    summary = models.CharField(max_length=300)
    payload = models.JSONField()
    created_at = models.DateTimeField()

    class Meta:
        ordering = ["-created_at", "id"]
        indexes = [models.Index(fields=["team", "-created_at"], name="notification_by_team")]

    def __str__(self) -> str:
        return f"{self.kind} {self.id}"


class Delivery(models.Model):
    """One channel's delivery of a notification to one recipient, with its attempts."""

    notification = models.ForeignKey(
        Notification, on_delete=models.CASCADE, related_name="deliveries"
    )
    channel = models.CharField(max_length=10, choices=Channel.choices)
    # An email address; empty for the webhook (its URL is read when delivering, so a fixed URL
    # takes the retries).
    recipient = models.CharField(max_length=254, blank=True)
    state = models.CharField(
        max_length=10, choices=DeliveryState.choices, default=DeliveryState.PENDING
    )
    attempts = models.PositiveSmallIntegerField(default=0)
    next_attempt_at = models.DateTimeField()
    last_attempt_at = models.DateTimeField(null=True, blank=True)
    last_status_code = models.PositiveSmallIntegerField(null=True, blank=True)
    last_error = models.CharField(max_length=500, blank=True)
    delivered_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        constraints = [
            models.UniqueConstraint(
                fields=["notification", "channel", "recipient"], name="delivery_once_per_target"
            ),
            models.CheckConstraint(
                condition=Q(state="delivered", delivered_at__isnull=False)
                | (~Q(state="delivered") & Q(delivered_at__isnull=True)),
                name="delivery_delivered_at_iff_delivered",
            ),
        ]
        indexes = [
            models.Index(
                fields=["next_attempt_at"],
                condition=Q(state="pending"),
                name="delivery_due",
            )
        ]

    def __str__(self) -> str:
        return f"{self.channel} {self.notification_id} {self.state}"
