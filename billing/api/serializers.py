"""Input and output shapes of the billing API. Amounts are integer micro-dollars (`*_micros`:
1 USD = 1,000,000) so clients never round; top-ups are asked for in cents, as Stripe does."""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal

from django.utils import timezone
from rest_framework import serializers

from billing import conf
from billing.models import (
    BalanceNotice,
    Invoice,
    InvoiceLine,
    LedgerEntry,
    Payout,
    TelemetryMinute,
    TopUp,
    UsageMeter,
    UsageSegment,
)
from core.api.fields import BoundedDateTimeField

MAX_TELEMETRY_RANGE = timedelta(days=7)


class NoticeSerializer(serializers.ModelSerializer):
    rental = serializers.UUIDField(
        source="rental_id", allow_null=True, help_text="the rental a budget_reached is about"
    )

    class Meta:
        model = BalanceNotice
        fields = [
            "kind",
            "rental",
            "available_micros",
            "hourly_burn_micros",
            "detail",
            "created_at",
        ]


class AccountSerializer(serializers.Serializer):
    """The customer's money now: available = balance - accrued (rated, not yet posted) - held
    (what unfinished rentals may still cost)."""

    currency = serializers.SerializerMethodField()
    balance_micros = serializers.IntegerField()
    accrued_micros = serializers.IntegerField()
    held_micros = serializers.IntegerField()
    available_micros = serializers.IntegerField()
    hourly_burn_micros = serializers.IntegerField()
    low_balance_since = serializers.SerializerMethodField()
    depleted_since = serializers.SerializerMethodField()

    def get_currency(self, summary) -> str:
        return conf.currency()

    def get_low_balance_since(self, summary) -> str | None:
        value = summary.account.low_balance_since if summary.account else None
        return serializers.DateTimeField().to_representation(value) if value else None

    def get_depleted_since(self, summary) -> str | None:
        value = summary.account.depleted_since if summary.account else None
        return serializers.DateTimeField().to_representation(value) if value else None


class BudgetSerializer(serializers.Serializer):
    """The account's budgets and limits and where it stands: the month's charges and what
    unfinished rentals still hold count against the monthly budget; limits in force are the
    account's own, never above the ceiling ops set (0: no limit)."""

    currency = serializers.SerializerMethodField()
    monthly_budget_micros = serializers.IntegerField(allow_null=True)
    budget_warn_percent = serializers.IntegerField()
    month_spent_micros = serializers.IntegerField()
    held_micros = serializers.IntegerField()
    max_concurrent_gpus = serializers.IntegerField(source="limits.max_concurrent_gpus")
    max_rentals_per_minute = serializers.IntegerField(source="limits.max_rentals_per_minute")
    ceiling_concurrent_gpus = serializers.IntegerField(source="limits.ceiling_concurrent_gpus")
    ceiling_rentals_per_minute = serializers.IntegerField(
        source="limits.ceiling_rentals_per_minute"
    )
    active_gpus = serializers.IntegerField()
    rentals_last_minute = serializers.IntegerField()
    billing_pass_interval_s = serializers.IntegerField(
        help_text="a capped rental's charge can pass its cap by at most this many seconds of"
        " its rate"
    )

    def get_currency(self, summary) -> str:
        return conf.currency()


class BudgetUpdateSerializer(serializers.Serializer):
    """Any of the fields; null clears a budget or an own limit (the ceiling then applies)."""

    monthly_budget = serializers.DecimalField(
        max_digits=9, decimal_places=2, required=False, allow_null=True,
        min_value=Decimal("0.01"), max_value=Decimal(1_000_000), help_text="dollars per month",
    )  # fmt: skip
    budget_warn_percent = serializers.IntegerField(required=False, min_value=1, max_value=100)
    max_concurrent_gpus = serializers.IntegerField(
        required=False, allow_null=True, min_value=1, max_value=100_000
    )
    max_rentals_per_minute = serializers.IntegerField(
        required=False, allow_null=True, min_value=1, max_value=100_000
    )

    def validate(self, attrs: dict) -> dict:
        # A typo must not silently change nothing.
        unknown = sorted(set(self.initial_data) - set(self.fields))
        if unknown:
            raise serializers.ValidationError({name: ["unknown field"] for name in unknown})
        if not attrs:
            raise serializers.ValidationError({"non_field_errors": ["nothing to change"]})
        return attrs


class LedgerEntrySerializer(serializers.ModelSerializer):
    rental = serializers.UUIDField(source="rental_id", allow_null=True)

    class Meta:
        model = LedgerEntry
        fields = ["id", "kind", "amount_micros", "rental", "gpu_seconds", "memo", "created_at"]


class TopUpCreateSerializer(serializers.Serializer):
    amount_cents = serializers.IntegerField(help_text="amount to add, in cents")

    def validate_amount_cents(self, value: int) -> int:
        low, high = conf.topup_limits_cents()
        if not low <= value <= high:
            raise serializers.ValidationError(f"between {low} and {high} cents")
        return value


class TopUpSerializer(serializers.ModelSerializer):
    class Meta:
        model = TopUp
        fields = ["id", "amount_cents", "currency", "status", "error", "created_at"]


class TopUpCreatedSerializer(TopUpSerializer):
    """Confirm `client_secret` in the browser with Stripe.js; the webhook credits the account."""

    client_secret = serializers.CharField()
    publishable_key = serializers.CharField()

    class Meta(TopUpSerializer.Meta):
        fields = [*TopUpSerializer.Meta.fields, "client_secret", "publishable_key"]


class InvoiceLineSerializer(serializers.ModelSerializer):
    rental = serializers.UUIDField(source="rental_id")

    class Meta:
        model = InvoiceLine
        fields = [
            "rental",
            "description",
            "gpu_model",
            "gpus",
            "gpu_seconds",
            "rate_per_gpu_hour",
            "amount_micros",
        ]


class InvoiceSerializer(serializers.ModelSerializer):
    class Meta:
        model = Invoice
        fields = [
            "id",
            "number",
            "period_start",
            "period_end",
            "currency",
            "opening_balance_micros",
            "usage_micros",
            "payments_micros",
            "closing_balance_micros",
            "issued_at",
        ]


class InvoiceDetailSerializer(InvoiceSerializer):
    lines = InvoiceLineSerializer(many=True)

    class Meta(InvoiceSerializer.Meta):
        fields = [*InvoiceSerializer.Meta.fields, "lines"]


class TelemetryQuerySerializer(serializers.Serializer):
    """A window of at most 7 days; the last hour by default."""

    since = BoundedDateTimeField(required=False)
    until = BoundedDateTimeField(required=False)
    gpu_index = serializers.IntegerField(required=False, min_value=0, max_value=255)

    def validate(self, attrs: dict) -> dict:
        until = attrs.get("until") or timezone.now()
        since = attrs.get("since") or until - timedelta(hours=1)
        if since >= until:
            raise serializers.ValidationError({"since": ["since must be before until"]})
        if until - since > MAX_TELEMETRY_RANGE:
            raise serializers.ValidationError({"since": ["at most 7 days at a time"]})
        return {**attrs, "since": since, "until": until}


class GpuSeriesSerializer(serializers.Serializer):
    node = serializers.CharField()
    gpu_index = serializers.IntegerField()
    points = serializers.ListField(
        child=serializers.ListField(child=serializers.FloatField()),
        help_text="[unix seconds, utilisation %, memory MB, power W, temperature C] per point",
    )


class GpuSeriesAnswerSerializer(serializers.Serializer):
    resolution = serializers.ChoiceField(choices=["raw", "minute"])
    series = GpuSeriesSerializer(many=True)


class TelemetryMinuteSerializer(serializers.ModelSerializer):
    node = serializers.CharField(source="node.hostname")
    util_avg_pct = serializers.SerializerMethodField()
    power_avg_w = serializers.SerializerMethodField()
    temp_max_c = serializers.FloatField(source="temp_max")

    class Meta:
        model = TelemetryMinute
        fields = [
            "minute",
            "node",
            "gpu_index",
            "samples",
            "util_avg_pct",
            "util_max",
            "mem_max_mb",
            "power_avg_w",
            "temp_max_c",
        ]

    def get_util_avg_pct(self, row: TelemetryMinute) -> float:
        return round(row.util_sum / row.samples, 2)

    def get_power_avg_w(self, row: TelemetryMinute) -> float:
        return round(row.power_sum / row.samples, 2)


class UsageSegmentSerializer(serializers.ModelSerializer):
    node = serializers.CharField(source="node.hostname")

    class Meta:
        model = UsageSegment
        fields = [
            "node",
            "run_id",
            "gpu_count",
            "started_at",
            "confirmed_until",
            "final",
            "first_seq",
            "last_seq",
            "reports",
        ]


class UsageMeterSerializer(serializers.ModelSerializer):
    node = serializers.CharField(source="node.hostname")

    class Meta:
        model = UsageMeter
        fields = [
            "node",
            "gpu_seconds",
            "charge_micros",
            "posted_charge_micros",
            "rated_at",
            "posted_at",
        ]


class RentalUsageSerializer(serializers.Serializer):
    """How a rental's bill is made: the confirmed runs, and per node what was rated."""

    rental = serializers.UUIDField(source="rental.pk")
    price_per_gpu_hour = serializers.DecimalField(
        source="rental.price_per_gpu_hour", max_digits=10, decimal_places=4, allow_null=True
    )
    meters = UsageMeterSerializer(many=True)
    segments = UsageSegmentSerializer(many=True)
    max_charge_micros = serializers.IntegerField(
        allow_null=True, help_text="the rental's own cap on its charge"
    )
    cap_overrun_bound_micros = serializers.IntegerField(
        allow_null=True,
        help_text="how far past its cap the charge can go: one billing pass at its rate",
    )


class PayoutSerializer(serializers.ModelSerializer):
    class Meta:
        model = Payout
        fields = ["id", "amount_micros", "method", "status", "created_at", "updated_at"]


class ProviderEarningsSerializer(serializers.Serializer):
    provider_id = serializers.IntegerField(source="provider.pk")
    provider = serializers.CharField(source="provider.name")
    balance_micros = serializers.IntegerField(help_text="earned and not yet paid out")
    earned_this_month_micros = serializers.IntegerField()
    earned_total_micros = serializers.IntegerField()
    paid_out_micros = serializers.IntegerField()
    entries = LedgerEntrySerializer(many=True)
    payouts = PayoutSerializer(many=True)
