"""Metering: usage reports from the node agents and GPU telemetry.

A usage segment is one container run of a rental on a node, [started_at, confirmed_until]. Each
report can only move confirmed_until forward (or mark the run final), so applying reports is a
join on a semilattice: duplicated, reordered and replayed reports give the same segment, and a
report that moves nothing is a no-op. Segments are stored, not every report: at 250k GPUs with
heartbeats every few seconds an append-only report table would grow by billions of rows a day,
while first_seq / last_seq / reports on the segment already name the reports behind every
billed second.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from django.db import connection, transaction
from django.utils import timezone

from billing import conf
from marketplace.errors import ValidationFailed

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


@dataclass(slots=True)
class UsageBatchResult:
    """What a batch did: reports that moved a segment, and the reports refused with why."""

    applied: int = 0
    rejected: list[tuple[int, str, str]] = field(default_factory=list)  # (index, field, why)


def _aware(value: object, name: str) -> datetime:
    if not isinstance(value, datetime) or value.tzinfo is None:
        raise ValidationFailed(f"{name} must be a timezone-aware datetime", field=name)
    return value


def _check(report: UsageReport, now: datetime) -> tuple[str, str] | None:
    """(field, why) when the report is malformed; None when it may be applied."""
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
    # Never bill a second that has not happened yet: a clock far ahead is refused, not trusted.
    if confirmed > now + timedelta(seconds=conf.clock_skew_s()):
        return "confirmed_at", "confirmed_at is in the future"
    return None


_APPLY_SQL = """
WITH r AS (
    SELECT *
    FROM unnest(%(rental)s::uuid[], %(run)s::text[], %(seq)s::bigint[], %(gpus)s::int[],
                %(started)s::timestamptz[], %(confirmed)s::timestamptz[], %(final)s::bool[])
         AS r(rental_id, run_id, seq, gpu_count, started_at, confirmed_at, final)
),
allocated AS (
    SELECT DISTINCT a.rental_id
    FROM marketplace_allocation a
    WHERE a.node_id = %(node)s AND a.rental_id IN (SELECT rental_id FROM r)
),
folded AS (
    -- One row per run: a spooled batch may carry several reports of the same run.
    SELECT r.rental_id, r.run_id,
           min(r.seq) AS first_seq,
           (array_agg(r.seq ORDER BY r.confirmed_at DESC, r.seq DESC))[1] AS last_seq,
           count(*) AS reports,
           (array_agg(r.gpu_count ORDER BY r.seq))[1] AS gpu_count,
           (array_agg(r.started_at ORDER BY r.seq))[1] AS started_at,
           max(r.confirmed_at) AS confirmed_until,
           bool_or(r.final) AS final
    FROM r JOIN allocated USING (rental_id)
    GROUP BY r.rental_id, r.run_id
),
seg AS (
    INSERT INTO billing_usagesegment AS s
        (rental_id, node_id, run_id, gpu_count, started_at, confirmed_until, final,
         first_seq, last_seq, reports, created_at, updated_at)
    SELECT rental_id, %(node)s, run_id, gpu_count, started_at, confirmed_until, final,
           first_seq, last_seq, reports, %(now)s, %(now)s
    FROM folded
    ON CONFLICT (rental_id, node_id, run_id) DO UPDATE SET
        confirmed_until = GREATEST(s.confirmed_until, EXCLUDED.confirmed_until),
        last_seq = CASE WHEN EXCLUDED.confirmed_until > s.confirmed_until
                        THEN EXCLUDED.last_seq ELSE s.last_seq END,
        first_seq = LEAST(s.first_seq, EXCLUDED.first_seq),
        final = s.final OR EXCLUDED.final,
        reports = s.reports + EXCLUDED.reports,
        updated_at = EXCLUDED.updated_at
    -- A report that moves nothing (a duplicate, a replay, an older confirmation) is a no-op.
    WHERE EXCLUDED.confirmed_until > s.confirmed_until OR (EXCLUDED.final AND NOT s.final)
    RETURNING s.rental_id, s.reports
),
meters AS (
    INSERT INTO billing_usagemeter AS m
        (rental_id, node_id, fee_bps, usage_version, rated_version, gpu_seconds, charge_micros,
         posting_seq, posted_gpu_seconds, posted_charge_micros, posted_earning_micros,
         created_at)
    SELECT DISTINCT rental_id, %(node)s, %(fee_bps)s, 1, 0, 0, 0, 0, 0, 0, 0, %(now)s FROM seg
    ON CONFLICT (rental_id, node_id) DO UPDATE SET usage_version = m.usage_version + 1
    RETURNING m.id
)
SELECT ARRAY(SELECT DISTINCT rental_id FROM r
             WHERE rental_id NOT IN (SELECT rental_id FROM allocated)),
       (SELECT count(*) FROM meters)
"""


def usage_reports_apply(
    *, node_id: int, reports: Sequence[UsageReport], now: datetime | None = None
) -> UsageBatchResult:
    """Apply a node's batch of usage reports in one statement (one heartbeat, or a replayed
    spool). Malformed reports and reports for rentals without an allocation on this node are
    refused with their index; the others are applied."""
    now = now or timezone.now()
    result = UsageBatchResult()
    good: list[tuple[int, UsageReport]] = []
    for i, report in enumerate(reports):
        problem = _check(report, now)
        if problem is None:
            good.append((i, report))
        else:
            result.rejected.append((i, *problem))
    if not good:
        return result
    params = {
        "node": node_id,
        "now": now,
        "fee_bps": conf.platform_fee_bps(),
        "rental": [r.rental_id for _, r in good],
        "run": [r.run_id for _, r in good],
        "seq": [r.seq for _, r in good],
        "gpus": [r.gpu_count for _, r in good],
        "started": [r.started_at for _, r in good],
        "confirmed": [r.confirmed_at for _, r in good],
        "final": [bool(r.final) for _, r in good],
    }
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(_APPLY_SQL, params)
        unallocated, _ = cursor.fetchone()
    refused = {str(x) for x in unallocated or ()}
    for i, report in good:
        if str(report.rental_id) in refused:
            result.rejected.append((i, "rental_id", "this rental has no allocation on this node"))
        else:
            result.applied += 1
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


def _number(sample: Mapping, key: str, i: int) -> float:
    value = sample.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValidationFailed(f"{key} must be a number", field=f"samples[{i}].{key}")
    low, high = _SAMPLE_RANGES[key]
    if not low <= value <= high:
        raise ValidationFailed(
            f"{key} must be between {low:g} and {high:g}", field=f"samples[{i}].{key}"
        )
    return float(value)


def _sample_row(node_id: int, sample: Mapping, i: int) -> tuple:
    if not isinstance(sample, Mapping):
        raise ValidationFailed("each sample is an object", field=f"samples[{i}]")
    gpu_index = sample.get("gpu_index")
    if isinstance(gpu_index, bool) or not isinstance(gpu_index, int) or not 0 <= gpu_index < 256:
        raise ValidationFailed("gpu_index must be 0 to 255", field=f"samples[{i}].gpu_index")
    ts = sample.get("ts")
    if isinstance(ts, int | float) and not isinstance(ts, bool) and math.isfinite(ts):
        ts = datetime.fromtimestamp(ts, tz=UTC)
    elif not isinstance(ts, datetime) or ts.tzinfo is None:
        raise ValidationFailed("ts must be an epoch or an aware datetime", field=f"samples[{i}].ts")
    mem = sample.get("mem_used_mb")
    if isinstance(mem, bool) or not isinstance(mem, int) or not 0 <= mem < 2**31:
        raise ValidationFailed(
            "mem_used_mb must be a non-negative integer", field=f"samples[{i}].mem_used_mb"
        )
    rental_id = sample.get("rental_id")
    if rental_id is not None and not isinstance(rental_id, uuid.UUID):
        try:
            rental_id = uuid.UUID(str(rental_id))
        except ValueError as exc:
            raise ValidationFailed(
                "rental_id is not a UUID", field=f"samples[{i}].rental_id"
            ) from exc
    return (
        node_id,
        gpu_index,
        ts,
        _number(sample, "util_pct", i),
        mem,
        _number(sample, "power_w", i),
        _number(sample, "temp_c", i),
        rental_id,
    )


def _rollup(rows: list[tuple]) -> dict[tuple[int, datetime], list]:
    """Mergeable per-minute aggregates of one node's samples: count, sums and maxima."""
    minutes: dict[tuple[int, datetime], list] = {}
    for _, gpu, ts, util, mem, power, temp, rental in rows:
        key = (gpu, ts.replace(second=0, microsecond=0))
        agg = minutes.get(key)
        if agg is None:
            minutes[key] = [1, util, util, mem, power, temp, rental]
        else:
            agg[0] += 1
            agg[1] += util
            agg[2] = max(agg[2], util)
            agg[3] = max(agg[3], mem)
            agg[4] += power
            agg[5] = max(agg[5], temp)
            agg[6] = agg[6] or rental
    return minutes


_SAMPLE_COLUMNS = "node_id, gpu_index, ts, util_pct, mem_used_mb, power_w, temp_c, rental_id"
_SAMPLE_TYPES = ["int8", "int2", "timestamptz", "float8", "int4", "float8", "float8", "uuid"]

_INSERT_SAMPLES_SQL = f"""
INSERT INTO billing_telemetrysample ({_SAMPLE_COLUMNS})
SELECT %(node)s, * FROM unnest(%(gpu)s::int2[], %(ts)s::timestamptz[], %(util)s::float8[],
                               %(mem)s::int4[], %(power)s::float8[], %(temp)s::float8[],
                               %(rental)s::uuid[])
"""  # noqa: S608 - a constant column list, no user text

_ROLLUP_SQL = """
INSERT INTO billing_telemetryminute AS t
    (node_id, gpu_index, minute, rental_id, samples, util_sum, util_max, mem_max_mb,
     power_sum, temp_max)
SELECT %(node)s, v.gpu_index, v.minute,
       coalesce(v.rental_id, (
           -- Samples without a rental id belong to the rental that held the GPU in that
           -- minute (the latest, if the GPU changed hands within it).
           SELECT a.rental_id FROM marketplace_allocation a
           JOIN marketplace_gpu g ON g.id = a.gpu_id
           WHERE g.node_id = %(node)s AND g.index = v.gpu_index
             AND a.during && tstzrange(v.minute, v.minute + interval '1 minute')
           ORDER BY a.id DESC LIMIT 1)),
       v.samples, v.util_sum, v.util_max, v.mem_max, v.power_sum, v.temp_max
FROM unnest(%(gpu)s::int2[], %(minute)s::timestamptz[], %(rental)s::uuid[], %(n)s::int[],
            %(util_sum)s::float8[], %(util_max)s::float8[], %(mem_max)s::int4[],
            %(power_sum)s::float8[], %(temp_max)s::float8[])
     AS v(gpu_index, minute, rental_id, samples, util_sum, util_max, mem_max, power_sum,
          temp_max)
ON CONFLICT (node_id, gpu_index, minute) DO UPDATE SET
    rental_id = coalesce(t.rental_id, EXCLUDED.rental_id),
    samples = t.samples + EXCLUDED.samples,
    util_sum = t.util_sum + EXCLUDED.util_sum,
    util_max = GREATEST(t.util_max, EXCLUDED.util_max),
    mem_max_mb = GREATEST(t.mem_max_mb, EXCLUDED.mem_max_mb),
    power_sum = t.power_sum + EXCLUDED.power_sum,
    temp_max = GREATEST(t.temp_max, EXCLUDED.temp_max)
"""


def telemetry_ingest(*, node_id: int, samples: list[dict]) -> int:
    """Store a node's GPU samples (COPY when the batch is large) and fold them into the
    per-minute rollups in the same transaction; returns the number stored. One malformed
    sample refuses the batch, naming it."""
    rows = [_sample_row(node_id, sample, i) for i, sample in enumerate(samples)]
    if not rows:
        return 0
    minutes = _rollup(rows)
    keys = sorted(minutes)
    rollup = {
        "node": node_id,
        "gpu": [k[0] for k in keys],
        "minute": [k[1] for k in keys],
        "rental": [minutes[k][6] for k in keys],
        "n": [minutes[k][0] for k in keys],
        "util_sum": [minutes[k][1] for k in keys],
        "util_max": [minutes[k][2] for k in keys],
        "mem_max": [minutes[k][3] for k in keys],
        "power_sum": [minutes[k][4] for k in keys],
        "temp_max": [minutes[k][5] for k in keys],
    }
    with transaction.atomic(), connection.cursor() as cursor:
        if len(rows) >= COPY_THRESHOLD:
            with cursor.cursor.copy(
                f"COPY billing_telemetrysample ({_SAMPLE_COLUMNS}) FROM STDIN (FORMAT BINARY)"
            ) as copy:
                copy.set_types(_SAMPLE_TYPES)
                for row in rows:
                    copy.write_row(row)
        else:
            columns = list(zip(*rows, strict=True))
            cursor.execute(
                _INSERT_SAMPLES_SQL,
                {
                    "node": node_id,
                    "gpu": list(columns[1]),
                    "ts": list(columns[2]),
                    "util": list(columns[3]),
                    "mem": list(columns[4]),
                    "power": list(columns[5]),
                    "temp": list(columns[6]),
                    "rental": list(columns[7]),
                },
            )
        # Sorted keys: concurrent batches of one node lock the same rollup rows in one order.
        cursor.execute(_ROLLUP_SQL, rollup)
    return len(rows)


def telemetry_prune(
    *, now: datetime | None = None, days: int | None = None, batch: int = 50_000
) -> int:
    """Delete raw samples older than the retention (rollups stay), a batch per transaction so
    no long lock or huge WAL burst; returns how many were deleted."""
    cutoff = (now or timezone.now()) - timedelta(days=days or conf.telemetry_retention_days())
    deleted = 0
    while True:
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute(
                """
                DELETE FROM billing_telemetrysample WHERE id IN (
                    SELECT id FROM billing_telemetrysample WHERE ts < %s LIMIT %s)
                """,
                [cutoff, batch],
            )
            count = cursor.rowcount
        deleted += count
        if count < batch:
            return deleted
