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

from django.db import connection, transaction
from django.utils import timezone

from billing import conf
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


_APPLY_SQL = """
WITH r AS (
    SELECT *
    FROM unnest(%(idx)s::int[], %(rental)s::uuid[], %(run)s::text[], %(seq)s::bigint[],
                %(gpus)s::int[], %(started)s::timestamptz[], %(confirmed)s::timestamptz[],
                %(final)s::bool[])
         AS r(idx, rental_id, run_id, seq, gpu_count, started_at, confirmed_at, final)
),
held AS (
    -- What the server authorised on this node: the rental's allocations here. A release cuts
    -- `during` at the release, so upper(during) is where the node's time ends.
    SELECT a.rental_id, max(upper(a.during)) AS held_until,
           bool_and(a.released_at IS NOT NULL) AS released
    FROM marketplace_allocation a
    WHERE a.node_id = %(node)s AND a.rental_id IN (SELECT rental_id FROM r)
    GROUP BY a.rental_id
),
clipped AS (
    SELECT r.*, h.rental_id IS NOT NULL AS allocated, h.released, h.held_until,
           LEAST(r.confirmed_at, h.held_until) AS until,
           old.id AS old_id, old.confirmed_until AS old_until, coalesce(old.final, false)
               AS old_final,
           -- A final report ends the run: nothing confirmed after the first one counts.
           min(LEAST(r.confirmed_at, h.held_until)) FILTER (WHERE r.final)
               OVER (PARTITION BY r.rental_id, r.run_id) AS final_at
    FROM r
    LEFT JOIN held h ON h.rental_id = r.rental_id
    LEFT JOIN billing_usagesegment old
           ON old.rental_id = r.rental_id AND old.node_id = %(node)s AND old.run_id = r.run_id
),
judged AS (
    SELECT c.*,
           CASE
               WHEN NOT c.allocated THEN 'not_allocated'
               WHEN (c.old_final AND c.until > c.old_until) OR c.until > c.final_at
                   THEN 'after_final'
               -- Confirmed past the allocation and adding no second inside it.
               WHEN c.confirmed_at > c.held_until
                    AND (c.until < c.started_at OR c.until <= c.old_until)
                   THEN CASE WHEN c.released THEN 'allocation_released'
                             ELSE 'outside_allocation' END
           END AS refused
    FROM clipped c
),
folded AS (
    -- One row per run: a spooled batch may carry several reports of the same run. Only the
    -- reports that move the stored segment count: a replayed spool repeats reports that were
    -- applied before their answer was lost, and those must not be counted twice.
    SELECT j.rental_id, j.run_id,
           min(j.seq) AS first_seq,
           (array_agg(j.seq ORDER BY j.until DESC, j.seq DESC))[1] AS last_seq,
           count(DISTINCT j.seq) AS reports,
           (array_agg(j.gpu_count ORDER BY j.seq))[1] AS gpu_count,
           (array_agg(j.started_at ORDER BY j.seq))[1] AS started_at,
           max(j.until) AS confirmed_until,
           bool_or(j.final) AS final
    FROM judged j
    WHERE j.refused IS NULL
      AND (j.old_id IS NULL OR j.until > j.old_until OR (j.final AND NOT j.old_final))
    GROUP BY j.rental_id, j.run_id
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
    -- A report that moves nothing (a duplicate, a replay, an older confirmation) is a no-op,
    -- and a final segment never moves again (a concurrent batch may have finalised it).
    WHERE NOT s.final
      AND (EXCLUDED.confirmed_until > s.confirmed_until OR EXCLUDED.final)
    RETURNING s.rental_id, s.reports
),
meters AS (
    -- The price is locked on the meter at its first report: a rental re-queued and re-booked
    -- elsewhere at another price leaves what ran here at the price it ran at.
    INSERT INTO billing_usagemeter AS m
        (rental_id, node_id, fee_bps, price_per_gpu_hour, usage_version, rated_version,
         gpu_seconds, charge_micros, posting_seq, posted_gpu_seconds, posted_charge_micros,
         posted_earning_micros, created_at)
    SELECT u.rental_id, %(node)s, %(fee_bps)s, rental.price_per_gpu_hour, 1, 0, 0, 0, 0, 0,
           0, 0, %(now)s
    FROM (SELECT DISTINCT rental_id FROM seg) u
    JOIN marketplace_rental rental ON rental.id = u.rental_id
    ON CONFLICT (rental_id, node_id) DO UPDATE SET usage_version = m.usage_version + 1
    RETURNING m.id
)
SELECT coalesce(array_agg(idx ORDER BY idx) FILTER (WHERE refused IS NOT NULL), '{}'),
       coalesce(array_agg(refused ORDER BY idx) FILTER (WHERE refused IS NOT NULL), '{}'),
       (SELECT count(*) FROM meters)
FROM judged
"""


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
    with connection.cursor() as cursor:
        cursor.execute(_APPLY_SQL, params)
        refused_idx, reasons, _ = cursor.fetchone()
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


_SAMPLE_COLUMNS = "node_id, gpu_index, ts, util_pct, mem_used_mb, power_w, temp_c, rental_id"
_SAMPLE_TYPES = ["int8", "int2", "timestamptz", "float8", "int4", "float8", "float8", "uuid"]

# A small batch (one heartbeat) is one statement: the raw rows and the rollup in one round trip.
_INSERT_SAMPLES_CTE = f"""
WITH raw AS (
    INSERT INTO billing_telemetrysample ({_SAMPLE_COLUMNS})
    SELECT %(node)s, * FROM unnest(%(s_gpu)s::int2[], %(s_ts)s::timestamptz[],
                                   %(s_util)s::float8[], %(s_mem)s::int4[],
                                   %(s_power)s::float8[], %(s_temp)s::float8[],
                                   %(s_rental)s::uuid[])
)
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
        with connection.cursor() as cursor:
            cursor.execute(_INSERT_SAMPLES_CTE + _ROLLUP_SQL, rollup)
        return len(rows)
    with transaction.atomic(), connection.cursor() as cursor:
        with cursor.cursor.copy(
            f"COPY billing_telemetrysample ({_SAMPLE_COLUMNS}) FROM STDIN (FORMAT BINARY)"
        ) as copy:
            copy.set_types(_SAMPLE_TYPES)
            for row in rows:
                copy.write_row(row)
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
