"""Payments: Stripe webhook events, card top-ups, refunds and provider payouts."""

from __future__ import annotations

import uuid

from django.conf import settings
from django.db import models
from django.db.models import Q
from django.db.models.functions import Mod
from django.db.models.lookups import Exact


class StripeEvent(models.Model):
    """A verified Stripe webhook event, stored under its unique id: a replay changes nothing."""

    event_id = models.CharField(max_length=255, unique=True)
    type = models.CharField(max_length=100)
    payload = models.JSONField()
    outcome = models.CharField(max_length=500, blank=True)
    # Signed by Stripe but not matching what this server asked for (another amount, currency
    # or account than the top-up's): nothing was credited, and ops should look.
    suspicious = models.BooleanField(default=False)
    received_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-received_at", "-id"]

    def __str__(self) -> str:
        return f"{self.event_id} {self.type}"


class TopUpStatus(models.TextChoices):
    PENDING = "pending", "Pending"
    SUCCEEDED = "succeeded", "Succeeded"
    FAILED = "failed", "Failed"


class TopUp(models.Model):
    """A card payment that credits a customer's account once Stripe says it succeeded."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    account = models.ForeignKey("billing.Account", on_delete=models.PROTECT, related_name="topups")
    amount_cents = models.PositiveIntegerField()
    currency = models.CharField(max_length=3)
    status = models.CharField(
        max_length=10, choices=TopUpStatus.choices, default=TopUpStatus.PENDING
    )
    # NULL until Stripe answers; unique, so one intent can never credit two top-ups.
    payment_intent_id = models.CharField(max_length=255, null=True, blank=True, unique=True)
    error = models.CharField(max_length=500, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["-created_at"]
        constraints = [
            models.CheckConstraint(condition=Q(amount_cents__gt=0), name="topup_amount_positive")
        ]

    def __str__(self) -> str:
        return f"top-up {self.amount_cents / 100:.2f} {self.currency} ({self.status})"


class MoneyOutStatus(models.TextChoices):
    PENDING = "pending", "Pending"
    SUCCEEDED = "succeeded", "Succeeded"
    FAILED = "failed", "Failed (returned to the account)"
    REVERSED = "reversed", "Reversed (returned to the account)"


class Refund(models.Model):
    """Money returned to a customer: to the card of a top-up through Stripe, or out of band.

    The ledger is debited when the refund is asked for, so the money cannot be spent meanwhile;
    a refund that fails is credited back by a reversal entry."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    account = models.ForeignKey("billing.Account", on_delete=models.PROTECT, related_name="refunds")
    topup = models.ForeignKey(
        TopUp, null=True, blank=True, on_delete=models.PROTECT, related_name="refunds"
    )
    amount_micros = models.BigIntegerField()
    reason = models.CharField(max_length=500)
    status = models.CharField(
        max_length=10, choices=MoneyOutStatus.choices, default=MoneyOutStatus.PENDING
    )
    stripe_refund_id = models.CharField(max_length=255, blank=True)
    error = models.CharField(max_length=500, blank=True)
    actor = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["-created_at"]
        constraints = [
            models.CheckConstraint(condition=Q(amount_micros__gt=0), name="refund_positive"),
            models.CheckConstraint(condition=~Q(reason=""), name="refund_has_reason"),
        ]

    def __str__(self) -> str:
        return f"refund {self.amount_micros} ({self.status})"


class PayoutMethod(models.TextChoices):
    STRIPE_CONNECT = "stripe_connect", "Stripe Connect transfer"
    MANUAL = "manual", "Paid out of band by ops"


class Payout(models.Model):
    """Provider earnings paid out: a Stripe Connect transfer, or a bank transfer made by ops."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    account = models.ForeignKey("billing.Account", on_delete=models.PROTECT, related_name="payouts")
    amount_micros = models.BigIntegerField()
    method = models.CharField(max_length=16, choices=PayoutMethod.choices)
    status = models.CharField(
        max_length=10, choices=MoneyOutStatus.choices, default=MoneyOutStatus.PENDING
    )
    destination = models.CharField(max_length=255, blank=True)
    stripe_transfer_id = models.CharField(max_length=255, blank=True)
    reason = models.CharField(max_length=500, blank=True)
    error = models.CharField(max_length=500, blank=True)
    actor = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["-created_at"]
        constraints = [
            # Stripe moves whole cents: a payout never leaves a fraction of a cent in flight.
            models.CheckConstraint(
                condition=Q(amount_micros__gt=0) & Q(Exact(Mod("amount_micros", 10_000), 0)),
                name="payout_whole_cents",
            ),
        ]

    def __str__(self) -> str:
        return f"payout {self.amount_micros} ({self.status})"
