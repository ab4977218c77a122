"""Metering: usage segments confirmed by the node agents, per-node meters, GPU telemetry."""

from __future__ import annotations

from django.contrib.postgres.indexes import BrinIndex
from django.db import models
from django.db.models import F, Q


class UsageSegment(models.Model):
    """One container run of a rental on a node: [started_at, confirmed_until], extended only by
    agent reports, so every billed second is backed by a confirmation; first/last seq and the
    report count trace it back to the reports."""

    # The unique (rental, node, run_id) index serves lookups by rental; nodes are never deleted.
    rental = models.ForeignKey(
        "marketplace.Rental",
        on_delete=models.PROTECT,
        related_name="usage_segments",
        db_index=False,
    )
    node = models.ForeignKey(
        "marketplace.Node", on_delete=models.PROTECT, related_name="usage_segments", db_index=False
    )
    run_id = models.CharField(max_length=100)
    gpu_count = models.PositiveSmallIntegerField()
    started_at = models.DateTimeField()
    confirmed_until = models.DateTimeField()
    final = models.BooleanField(default=False)
    first_seq = models.BigIntegerField(help_text="lowest report seq applied")
    last_seq = models.BigIntegerField(help_text="seq of the report that set confirmed_until")
    reports = models.PositiveIntegerField(default=1, help_text="reports that moved the segment")
    created_at = models.DateTimeField()
    updated_at = models.DateTimeField()

    class Meta:
        ordering = ["rental_id", "node_id", "started_at"]
        constraints = [
            models.UniqueConstraint(fields=["rental", "node", "run_id"], name="segment_unique_run"),
            models.CheckConstraint(
                condition=Q(confirmed_until__gte=F("started_at")), name="segment_ordered"
            ),
            models.CheckConstraint(condition=Q(gpu_count__gt=0), name="segment_gpus_positive"),
        ]

    def __str__(self) -> str:
        return f"{self.rental_id}/{self.node_id}/{self.run_id}"


class UsageMeter(models.Model):
    """What one rental used on one node, rated and posted: a node's GPUs belong to one provider,
    so earnings follow the meter. usage_version moves with every applied report and
    rated_version records what the last rating saw, so a report racing a pass is never lost."""

    # Few indexes on purpose: every report and every pass updates these rows, and with no
    # indexed column changing (and free room on the page) PostgreSQL updates them in place.
    rental = models.ForeignKey(
        "marketplace.Rental", on_delete=models.PROTECT, related_name="usage_meters", db_index=False
    )
    node = models.ForeignKey(
        "marketplace.Node", on_delete=models.PROTECT, related_name="usage_meters", db_index=False
    )
    fee_bps = models.PositiveSmallIntegerField(help_text="platform fee locked at the first report")
    # Null only on meters created before the price was locked here: they rate at the rental's.
    price_per_gpu_hour = models.DecimalField(
        max_digits=10,
        decimal_places=4,
        null=True,
        blank=True,
        help_text="the rental's price when this node first reported: a re-queue re-prices "
        "the rental, not what already ran here",
    )
    usage_version = models.BigIntegerField(default=1)
    rated_version = models.BigIntegerField(default=0)
    gpu_seconds = models.BigIntegerField(default=0, help_text="rated GPU-seconds to date")
    charge_micros = models.BigIntegerField(default=0, help_text="charge to date")
    rated_at = models.DateTimeField(null=True, blank=True)
    posting_seq = models.PositiveIntegerField(default=0)
    posted_gpu_seconds = models.BigIntegerField(default=0)
    posted_charge_micros = models.BigIntegerField(default=0)
    posted_earning_micros = models.BigIntegerField(default=0)
    posted_at = models.DateTimeField(null=True, blank=True)
    # GPU time a node fault destroyed (marketplace.RentalCredit), kept out of gpu_seconds and
    # charge_micros: the customer's usage is posted whole and this credited back beside it.
    credited_gpu_seconds = models.BigIntegerField(default=0, db_default=0)
    credit_micros = models.BigIntegerField(default=0, db_default=0)
    posted_credited_gpu_seconds = models.BigIntegerField(default=0, db_default=0)
    posted_credit_micros = models.BigIntegerField(default=0, db_default=0)
    created_at = models.DateTimeField()

    class Meta:
        ordering = ["id"]
        constraints = [
            models.UniqueConstraint(fields=["rental", "node"], name="meter_unique_rental_node"),
            models.CheckConstraint(
                condition=Q(fee_bps__lte=10_000), name="meter_fee_at_most_everything"
            ),
            models.CheckConstraint(
                condition=Q(rated_version__lte=F("usage_version")), name="meter_versions"
            ),
        ]

    def __str__(self) -> str:
        return f"meter {self.rental_id}/{self.node_id}"


class TelemetrySample(models.Model):
    """One raw GPU sample from an agent; kept for a few days (BRIN on ts keeps inserts cheap),
    then only the per-minute rollups remain. node_id carries no foreign key: the agent API has
    authenticated the node, and a per-row check would cost on every COPY."""

    node_id = models.BigIntegerField()
    gpu_index = models.PositiveSmallIntegerField()
    ts = models.DateTimeField()
    util_pct = models.FloatField()
    mem_used_mb = models.IntegerField()
    power_w = models.FloatField()
    temp_c = models.FloatField()
    rental_id = models.UUIDField(null=True, blank=True)

    class Meta:
        indexes = [BrinIndex(fields=["ts"], name="sample_ts_brin")]

    def __str__(self) -> str:
        return f"{self.node_id}/gpu{self.gpu_index} {self.ts}"


class TelemetryMinute(models.Model):
    """Per-minute rollup of one GPU: mergeable sums, maxima and counts, so batches that arrive
    late or twice for the same minute fold into it exactly."""

    node = models.ForeignKey(
        "marketplace.Node",
        on_delete=models.CASCADE,
        related_name="telemetry_minutes",
        db_index=False,
    )
    gpu_index = models.PositiveSmallIntegerField()
    minute = models.DateTimeField()
    rental = models.ForeignKey(
        "marketplace.Rental",
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="telemetry_minutes",
        db_index=False,
    )
    samples = models.PositiveIntegerField()
    util_sum = models.FloatField()
    util_max = models.FloatField()
    mem_max_mb = models.IntegerField()
    power_sum = models.FloatField()
    temp_max = models.FloatField()

    class Meta:
        ordering = ["minute", "node_id", "gpu_index"]
        constraints = [
            models.UniqueConstraint(
                fields=["node", "gpu_index", "minute"], name="telemetry_minute_unique"
            ),
            models.CheckConstraint(condition=Q(samples__gt=0), name="telemetry_minute_samples"),
        ]
        indexes = [
            models.Index(
                fields=["rental", "minute"],
                condition=Q(rental__isnull=False),
                name="telemetry_minute_by_rental",
            )
        ]

    def __str__(self) -> str:
        return f"{self.node_id}/gpu{self.gpu_index} {self.minute}"
