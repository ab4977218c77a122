"""Metering: usage reports from the node agents and GPU telemetry.

A usage segment is one container run of a rental on a node, [started_at, confirmed_until]. Each
report can only move confirmed_until forward (or mark the run final), so applying reports is a
join on a semilattice: duplicated, reordered and replayed reports give the same segment, and a
report that moves nothing is a no-op. A final report freezes its segment. Reports are clamped
to the server's clock and to the allocation held on the node; rating then bills only what lies
inside that allocation and the rental's running interval (see rating), so what an agent
confirms can lower a bill, never raise it past what the server authorised.

Segments are stored, not every report: at 250k GPUs with heartbeats every few seconds an
append-only report table would grow by billions of rows a day, while first_seq / last_seq /
reports on the segment already name the reports behind every billed second.
"""

from __future__ import annotations

import math
import uuid
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta

from django.db import transaction
from django.utils import timezone

from billing import conf, queries
from billing.models import TelemetrySample
from core.errors import ValidationFailed

MAX_GPUS_PER_RUN = 64
# Above this many samples one COPY beats one INSERT of arrays.
COPY_THRESHOLD = 2000


@dataclass(frozen=True, slots=True, kw_only=True)
class UsageReport:
    """One agent report about one container run (see usage_report_apply)."""

    rental_id: uuid.UUID
    run_id: str
    seq: int
    gpu_count: int
    started_at: datetime
    confirmed_at: datetime
    final: bool = False


# Why a report was refused, as counted in UsageBatchResult.refused.
MALFORMED = "malformed"
NOT_ALLOCATED = "not_allocated"
ALLOCATION_RELEASED = "allocation_released"
OUTSIDE_ALLOCATION = "outside_allocation"
AFTER_FINAL = "after_final"

_REFUSED_WHY = {
    NOT_ALLOCATED: ("rental_id", "this rental has no allocation on this node"),
    ALLOCATION_RELEASED: (
        "confirmed_at",
        "the allocation on this node was released before this confirmation",
    ),
    OUTSIDE_ALLOCATION: ("confirmed_at", "confirmed past the allocation held on this node"),
    AFTER_FINAL: ("final", "the run was already reported final"),
}


@dataclass(slots=True)
class UsageBatchResult:
    """What a batch did: reports applied (including those that moved nothing: replays), the
    reports refused with why, and the refusals counted by reason for the node's record."""

    applied: int = 0
    rejected: list[tuple[int, str, str]] = field(default_factory=list)  # (index, field, why)
    refused: Counter[str] = field(default_factory=Counter)

    def refuse(self, index: int, reason: str, name: str, why: str) -> None:
        self.rejected.append((index, name, why))
        self.refused[reason] += 1


def _aware(value: object, name: str) -> datetime:
    if not isinstance(value, datetime) or value.tzinfo is None:
        raise ValidationFailed(f"{name} must be a timezone-aware datetime", field=name)
    return value


def _check(report: UsageReport, now: datetime) -> tuple[str, str] | UsageReport:
    """(field, why) when the report is malformed; else the report with its times clamped to
    the server's clock: a second that has not happened yet is never confirmed, whatever the
    agent's clock says."""
    if not isinstance(report.seq, int) or report.seq < 0:
        return "seq", "seq must be a non-negative integer"
    if not isinstance(report.gpu_count, int) or not 0 < report.gpu_count <= MAX_GPUS_PER_RUN:
        return "gpu_count", f"gpu_count must be between 1 and {MAX_GPUS_PER_RUN}"
    if not isinstance(report.run_id, str) or not 0 < len(report.run_id) <= 100:
        return "run_id", "run_id must be 1 to 100 characters"
    try:
        started = _aware(report.started_at, "started_at")
        confirmed = _aware(report.confirmed_at, "confirmed_at")
    except ValidationFailed as exc:
        return exc.field or "", exc.message
    if confirmed < started:
        return "confirmed_at", "confirmed_at is before started_at"
    # A clock far ahead is broken: refused, so the node's record shows it. Within the skew the
    # report is kept but clamped to now (below).
    if confirmed > now + timedelta(seconds=conf.clock_skew_s()):
        return "confirmed_at", "confirmed_at is in the future"
    if confirmed <= now:
        return report
    return replace(report, started_at=min(started, now), confirmed_at=now)


def usage_reports_apply(
    *, node_id: int, reports: Sequence[UsageReport], now: datetime | None = None
) -> UsageBatchResult:
    """Apply a node's batch of usage reports in one statement (one heartbeat, or a replayed
    spool). Refused with their index and counted by reason: malformed reports, reports for
    rentals without an allocation on this node (another node's, or none), confirmations past
    a released allocation and reports after the run's final one. Confirmations are clamped to
    the server's now and to the end of the allocation held on this node."""
    now = now or timezone.now()
    result = UsageBatchResult()
    good: list[tuple[int, UsageReport]] = []
    for i, report in enumerate(reports):
        checked = _check(report, now)
        if isinstance(checked, UsageReport):
            good.append((i, checked))
        else:
            result.refuse(i, MALFORMED, *checked)
    if not good:
        return result
    params = {
        "node": node_id,
        "now": now,
        "fee_bps": conf.platform_fee_bps(),
        "idx": [i for i, _ in good],
        "rental": [r.rental_id for _, r in good],
        "run": [r.run_id for _, r in good],
        "seq": [r.seq for _, r in good],
        "gpus": [r.gpu_count for _, r in good],
        "started": [r.started_at for _, r in good],
        "confirmed": [r.confirmed_at for _, r in good],
        "final": [bool(r.final) for _, r in good],
    }
    # One statement, atomic by itself: no transaction round trips around it.
    refused_idx, reasons, _ = queries.usage_reports_apply(params=params)
    for i, reason in zip(refused_idx, reasons, strict=True):
        result.refuse(i, reason, *_REFUSED_WHY[reason])
    result.applied = len(good) - len(refused_idx)
    result.rejected.sort()
    return result


def usage_report_apply(
    *,
    node_id: int,
    rental_id: uuid.UUID,
    run_id: str,
    seq: int,
    gpu_count: int,
    started_at: datetime,
    confirmed_at: datetime,
    final: bool = False,
) -> None:
    """Apply one agent report: the run's start and the agent's last confirmation that the
    container was alive. Idempotent: a duplicate, replayed or older report changes nothing."""
    if not isinstance(rental_id, uuid.UUID):
        try:
            rental_id = uuid.UUID(str(rental_id))
        except ValueError as exc:
            raise ValidationFailed("rental_id is not a UUID", field="rental_id") from exc
    result = usage_reports_apply(
        node_id=node_id,
        reports=[
            UsageReport(
                rental_id=rental_id,
                run_id=run_id,
                seq=seq,
                gpu_count=gpu_count,
                started_at=started_at,
                confirmed_at=confirmed_at,
                final=final,
            )
        ],
    )
    if result.rejected:
        _, name, why = result.rejected[0]
        raise ValidationFailed(why, field=name)


# --- telemetry ---------------------------------------------------------------------------------

_SAMPLE_RANGES = {
    "util_pct": (0.0, 100.0),
    "power_w": (0.0, 5000.0),
    "temp_c": (-50.0, 200.0),
}
_MAX_MEM_MB = 2**31
_MAX_EPOCH = 2**32  # the year 2106: anything later is a broken clock


def _sample_error(sample: object, i: int) -> ValidationFailed:
    """The first problem of a sample the fast path refused, naming its field."""
    where = f"samples[{i}]"
    if not isinstance(sample, Mapping):
        return ValidationFailed("each sample is an object", field=where)
    gpu_index = sample.get("gpu_index")
    if type(gpu_index) is not int or not 0 <= gpu_index < 256:
        return ValidationFailed("gpu_index must be 0 to 255", field=f"{where}.gpu_index")
    ts = sample.get("ts")
    epoch = ts.timestamp() if isinstance(ts, datetime) and ts.tzinfo is not None else ts
    if type(epoch) not in (int, float) or not 0 <= epoch < _MAX_EPOCH:
        return ValidationFailed("ts must be an epoch or an aware datetime", field=f"{where}.ts")
    for key, (low, high) in _SAMPLE_RANGES.items():
        value = sample.get(key)
        if type(value) not in (int, float) or not low <= value <= high:
            return ValidationFailed(
                f"{key} must be a number from {low:g} to {high:g}", field=f"{where}.{key}"
            )
    mem = sample.get("mem_used_mb")
    if type(mem) is not int or not 0 <= mem < _MAX_MEM_MB:
        return ValidationFailed(
            "mem_used_mb must be a non-negative integer", field=f"{where}.mem_used_mb"
        )
    return ValidationFailed("rental_id is not a UUID", field=f"{where}.rental_id")


def _rows_and_minutes(node_id: int, samples: list[dict]) -> tuple[list[tuple], dict]:
    """Validate the samples into COPY rows and fold them into mergeable per-minute aggregates
    (count, sums, maxima) in one loop: at 50,000 samples a second this loop is the cost.
    Range checks also refuse NaN (every comparison with NaN is false)."""
    rows: list[tuple] = []
    minutes: dict[tuple[int, float], list] = {}
    (u_low, u_high), (p_low, p_high), (t_low, t_high) = _SAMPLE_RANGES.values()
    fromtimestamp = datetime.fromtimestamp
    for i, sample in enumerate(samples):
        try:
            gpu = sample["gpu_index"]
            ts = sample["ts"]
            util = sample["util_pct"]
            mem = sample["mem_used_mb"]
            power = sample["power_w"]
            temp = sample["temp_c"]
            rental = sample.get("rental_id")
            if type(ts) is float or type(ts) is int:
                epoch = float(ts)
                ts = fromtimestamp(epoch, UTC)
            else:
                epoch = ts.timestamp() if ts.tzinfo is not None else math.nan
            if rental is not None and type(rental) is not uuid.UUID:
                rental = uuid.UUID(str(rental))
        except (KeyError, TypeError, AttributeError, ValueError, OverflowError, OSError):
            raise _sample_error(sample, i) from None
        if not (
            type(gpu) is int
            and 0 <= gpu < 256
            and type(mem) is int
            and 0 <= mem < _MAX_MEM_MB
            and type(util) in (float, int)
            and u_low <= util <= u_high
            and type(power) in (float, int)
            and p_low <= power <= p_high
            and type(temp) in (float, int)
            and t_low <= temp <= t_high
            and 0 <= epoch < _MAX_EPOCH
        ):
            raise _sample_error(sample, i)
        util, power, temp = float(util), float(power), float(temp)
        rows.append((node_id, gpu, ts, util, mem, power, temp, rental))
        key = (gpu, epoch - epoch % 60)
        agg = minutes.get(key)
        if agg is None:
            minutes[key] = [1, util, util, mem, power, temp, rental]
        else:
            agg[0] += 1
            agg[1] += util
            if util > agg[2]:
                agg[2] = util
            if mem > agg[3]:
                agg[3] = mem
            agg[4] += power
            if temp > agg[5]:
                agg[5] = temp
            if agg[6] is None:
                agg[6] = rental
    return rows, minutes


def telemetry_ingest(*, node_id: int, samples: list[dict]) -> int:
    """Store a node's GPU samples (COPY when the batch is large) and fold them into the
    per-minute rollups in the same transaction; returns the number stored. One malformed
    sample refuses the batch, naming it."""
    rows, minutes = _rows_and_minutes(node_id, samples)
    if not rows:
        return 0
    # Sorted keys: concurrent batches of one node lock the same rollup rows in one order.
    keys = sorted(minutes)
    rollup = {
        "node": node_id,
        "gpu": [k[0] for k in keys],
        "minute": [datetime.fromtimestamp(k[1], UTC) for k in keys],
        "rental": [minutes[k][6] for k in keys],
        "n": [minutes[k][0] for k in keys],
        "util_sum": [minutes[k][1] for k in keys],
        "util_max": [minutes[k][2] for k in keys],
        "mem_max": [minutes[k][3] for k in keys],
        "power_sum": [minutes[k][4] for k in keys],
        "temp_max": [minutes[k][5] for k in keys],
    }
    if len(rows) < COPY_THRESHOLD:
        columns = list(zip(*rows, strict=True))
        names = ("s_gpu", "s_ts", "s_util", "s_mem", "s_power", "s_temp", "s_rental")
        rollup.update(zip(names, (list(c) for c in columns[1:]), strict=True))
        queries.telemetry_samples_insert_and_roll_up(params=rollup)
        return len(rows)
    with transaction.atomic():
        queries.telemetry_samples_copy_and_roll_up(rows=rows, params=rollup)
    return len(rows)


def telemetry_prune(
    *, now: datetime | None = None, days: int | None = None, batch: int = 50_000
) -> int:
    """Delete raw samples older than the retention (rollups stay), a batch per transaction so
    no long lock or huge WAL burst; returns how many were deleted."""
    cutoff = (now or timezone.now()) - timedelta(days=days or conf.telemetry_retention_days())
    deleted = 0
    while True:
        with transaction.atomic():
            oldest = TelemetrySample.objects.filter(ts__lt=cutoff).values("pk")[:batch]
            count, _ = TelemetrySample.objects.filter(pk__in=oldest).delete()
        deleted += count
        if count < batch:
            return deleted
