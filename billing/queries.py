"""Billing's hand-written SQL, each statement here and nowhere else in the app.

A statement is written by hand only where the ORM cannot say it in as few round trips (a
set-based UPDATE ... FROM, an INSERT ... ON CONFLICT with RETURNING, COPY) on a path a `bench/`
script measures; the comment above each names the figure. Table and column names come from the
models' `_meta` (core.rows.sql_named) and each statement is built once per process. Every
price of GPU time is core.money's formula. tests/billing/test_queries.py asks each statement's
question again through the ORM and compares the answers.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from functools import cache

import psycopg.errors
from django.db import OperationalError, connection

from billing.models import (
    Account,
    AccountKind,
    FundsHold,
    LedgerEntry,
    TelemetryMinute,
    TelemetrySample,
    UsageMeter,
    UsageSegment,
)
from core.money import cost_micros_sql
from core.rows import model_from_row, sql_compact, sql_named
from marketplace.models import Allocation, Gpu, Node, Rental, RentalCredit, RentalEvent


def _priced(template: str, **costs: str) -> str:
    """`template` with each `{name}` of `costs` replaced by its cost expression (the names in
    the expression are filled in with the template's)."""
    for name, expression in costs.items():
        template = template.replace("{" + name + "}", expression)
    return template


def _hourly_cost(alias: str) -> str:
    """What rental `alias` costs per hour at its locked price, all its GPUs together."""
    return cost_micros_sql(
        price=f"{alias}.{{rental.price_per_gpu_hour}}",
        gpu_seconds=f"3600 * {alias}.{{rental.gpus_per_node}} * {alias}.{{rental.node_count}}",
    )


def _all(sql: str, params) -> list[tuple]:
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return cursor.fetchall()


# --- The funds check (a create's hold) -------------------------------------------------------
# bench/scheduler.py --parts api, database round trips per create (docs/benchmarks.md): the
# lock, these sums and the hold go in one pipelined round trip.

_ACCRUED = """
    SELECT coalesce(sum(m.{meter.charge_micros} - m.{meter.posted_charge_micros}), 0)
    FROM {meter} m JOIN {rental} r ON r.{rental.id} = m.{meter.rental_id}
    WHERE r.{rental.team_id} = %s AND m.{meter.charge_micros} <> m.{meter.posted_charge_micros}
"""
_HELD = """
    SELECT coalesce(sum(greatest(
        -- LEAST skips a NULL: an uncapped rental holds its booked time.
        LEAST(CASE WHEN r.{rental.price_per_gpu_hour} IS NULL THEN h.{hold.amount_micros}
                   ELSE {held_cost}
              END, h.{hold.max_charge_micros})
        - coalesce((SELECT sum(m.{meter.charge_micros}) FROM {meter} m
                    WHERE m.{meter.rental_id} = r.{rental.id}), 0),
        0)), 0)
    FROM {rental} r JOIN {hold} h ON h.{hold.rental_id} = r.{rental.id}
    WHERE r.{rental.team_id} = %s AND r.{rental.status} = ANY(%s)
"""


@cache
def _owed_sql() -> str:
    held_cost = cost_micros_sql(
        price="r.{rental.price_per_gpu_hour}",
        gpu_seconds="r.{rental.gpus_per_node} * r.{rental.node_count} * r.{rental.duration_s}",
        round_up=True,
    )
    return sql_named(
        _priced(f"SELECT ({_ACCRUED}), ({_HELD})", held_cost=held_cost),
        meter=UsageMeter,
        rental=Rental,
        hold=FundsHold,
    )


def team_owed_statement(*, team_id: int, active: Sequence[str]) -> tuple[str, list]:
    """The team's accrued usage (rated, not yet posted) and what its rentals in `active`
    statuses still hold (one row: accrued, held), for a caller that sends it with its lock."""
    return _owed_sql(), [team_id, team_id, list(active)]


def team_owed(*, team_id: int, active: Sequence[str]) -> tuple[int, int]:
    """team_owed_statement, run: (accrued, held) in micro-dollars."""
    ((accrued, held),) = _all(*team_owed_statement(team_id=team_id, active=active))
    return int(accrued), int(held)


@cache
def _account_locked_sql() -> tuple[str, tuple]:
    fields = tuple(Account._meta.concrete_fields)
    columns = ", ".join(connection.ops.quote_name(f.column) for f in fields)
    sql = sql_named(
        f"SELECT {columns} FROM {{account}}"  # noqa: S608 - the model's own names
        f" WHERE {{account.kind}} = '{AccountKind.CUSTOMER.value}' AND {{account.team}} = %s"
        " FOR UPDATE",
        account=Account,
    )
    return sql, fields


def team_account_locked_statement(*, team_id: int) -> tuple[str, list]:
    """The team's customer account row, locked (FOR UPDATE): compiling this lookup through the
    ORM cost more CPU than running it, on every create (a create's server CPU,
    docs/benchmarks.md)."""
    return _account_locked_sql()[0], [team_id]


def team_account_from_row(row: Sequence) -> Account:
    return model_from_row(Account, _account_locked_sql()[1], row)


def team_account_locked(*, team_id: int) -> Account | None:
    rows = _all(*team_account_locked_statement(team_id=team_id))
    return team_account_from_row(rows[0]) if rows else None


@cache
def hold_insert_statement() -> tuple[tuple, str]:
    """The hold's INSERT with its account found by the team: it is sent before the account's
    row (and so its id) has been read. Returns the fields it writes (less the account) and the
    SQL, whose parameters are those fields' values and the team's id."""
    meta = FundsHold._meta
    fields = tuple(f for f in meta.local_concrete_fields if f.name != "account")
    quote = connection.ops.quote_name
    columns = ", ".join(quote(f.column) for f in [*fields, meta.get_field("account")])
    return fields, sql_named(
        f"INSERT INTO {{hold}} ({columns})"  # noqa: S608 - the models' own names
        f" SELECT {', '.join(['%s'] * len(fields))}, a.{{account.id}} FROM {{account}} a"
        f" WHERE a.{{account.kind}} = '{AccountKind.CUSTOMER.value}' AND a.{{account.team}} = %s",
        hold=FundsHold,
        account=Account,
    )


# --- Postings ---------------------------------------------------------------------------------


@cache
def _entry_insert_sql() -> tuple[str, tuple]:
    meta = LedgerEntry._meta
    quote = connection.ops.quote_name
    written = ("account", "kind", "amount_micros", "key", "memo", "actor", "created_at")
    returned = tuple(meta.concrete_fields)
    columns = ", ".join(quote(meta.get_field(name).column) for name in written)
    sql = sql_named(
        f"INSERT INTO {{entry}} ({columns})"  # noqa: S608 - the model's own names
        f" VALUES ({', '.join(['%s'] * len(written))})"
        " ON CONFLICT ({entry.key}) WHERE {entry.key} IS NOT NULL DO NOTHING"
        f" RETURNING {', '.join(quote(f.column) for f in returned)}",
        entry=LedgerEntry,
    )
    return sql, returned


def ledger_entry_insert(
    *,
    account_id: int,
    kind: str,
    amount_micros: int,
    key: str,
    memo: str,
    actor_id: int | None,
    now: datetime,
) -> LedgerEntry | None:
    """Append one keyed entry, or nothing when an entry has the key already (None): the ORM
    has no INSERT ... ON CONFLICT DO NOTHING that returns the row, and a savepoint around a
    plain insert costs two more round trips on every posting."""
    sql, returned = _entry_insert_sql()
    rows = _all(sql, [account_id, kind, amount_micros, key, memo, actor_id, now])
    return model_from_row(LedgerEntry, returned, rows[0]) if rows else None


# --- Budgets ----------------------------------------------------------------------------------
# bench/metering.py, the billing pass over 100,000 running rentals: every budgeted account and
# every capped rental in one statement each, not one query per account or rental.

_MONTH_SPENT = """
SELECT a.{account.id},
       coalesce((SELECT -sum(e.{entry.amount_micros}) FROM {entry} e
                 WHERE e.{entry.account_id} = a.{account.id} AND e.{entry.kind} = 'usage'
                   AND e.{entry.created_at} >= %(month_start)s), 0)
       + coalesce((SELECT sum(m.{meter.charge_micros} - m.{meter.posted_charge_micros})
                   FROM {meter} m JOIN {rental} r ON r.{rental.id} = m.{meter.rental_id}
                   WHERE r.{rental.team_id} = a.{account.team_id}
                     AND m.{meter.charge_micros} <> m.{meter.posted_charge_micros}), 0) AS spent,
       coalesce((SELECT sum({hourly_cost})
                 FROM {rental} r
                 WHERE r.{rental.team_id} = a.{account.team_id}
                     AND r.{rental.status} = ANY(%(burning)s)
                   AND r.{rental.price_per_gpu_hour} IS NOT NULL), 0) AS burn
FROM {account} a
WHERE a.{account.kind} = 'customer' {budgeted}
  AND (%(account_id)s::bigint IS NULL OR a.{account.id} = %(account_id)s::bigint)
"""


@cache
def _month_spent_sql(budgeted_only: bool) -> str:
    budgeted = "AND a.{account.monthly_budget_micros} IS NOT NULL" if budgeted_only else ""
    return sql_named(
        _priced(_MONTH_SPENT, hourly_cost=_hourly_cost("r"), budgeted=budgeted),
        entry=LedgerEntry,
        meter=UsageMeter,
        rental=Rental,
        account=Account,
    )


def accounts_month_spent(
    *,
    month_start: datetime,
    burning: Sequence[str],
    account_id: int | None = None,
    budgeted_only: bool = True,
) -> list[tuple[int, int, int]]:
    """(account id, the month's usage charges: posted since `month_start` plus rated and not
    yet posted, what its rentals in `burning` statuses cost per hour) for each customer
    account with a monthly budget (every customer account with `budgeted_only` False), or
    only `account_id`."""
    rows = _all(
        _month_spent_sql(budgeted_only),
        {"month_start": month_start, "account_id": account_id, "burning": list(burning)},
    )
    return [(account, int(spent), int(burn)) for account, spent, burn in rows]


_CAPPED = """
WITH capped AS (
    SELECT r.{rental.id}, r.{rental.team_id}, r.{rental.started_at}, r.{rental.node_count},
        h.{hold.max_charge_micros} AS cap,
           ({hourly_cost})::bigint
               AS per_hour
    FROM {rental} r JOIN {hold} h ON h.{hold.rental_id} = r.{rental.id}
    WHERE r.{rental.status} = ANY(%(burning)s) AND h.{hold.max_charge_micros} IS NOT NULL
      AND r.{rental.price_per_gpu_hour} IS NOT NULL
),
charged AS (
    SELECT m.{meter.rental_id}, sum(m.{meter.charge_micros})::bigint AS micros
    FROM {meter} m JOIN capped c ON c.id = m.{meter.rental_id} GROUP BY m.{meter.rental_id}
),
per_node AS (
    SELECT s.{segment.rental_id}, s.{segment.node_id}, max(s.{segment.confirmed_until}) AS last
    FROM {segment} s JOIN capped c ON c.id = s.{segment.rental_id}
    GROUP BY s.{segment.rental_id}, s.{segment.node_id}
),
confirmed AS (
    SELECT p.rental_id, count(*) AS nodes, min(p.last) AS until
    FROM per_node p GROUP BY p.rental_id
)
SELECT c.id, c.team_id, c.cap, coalesce(ch.micros, 0), c.per_hour,
       CASE WHEN coalesce(cf.nodes, 0) >= c.node_count THEN cf.until ELSE c.started_at END
FROM capped c
LEFT JOIN charged ch ON ch.rental_id = c.id
LEFT JOIN confirmed cf ON cf.rental_id = c.id
ORDER BY c.id
"""


@cache
def _capped_sql() -> str:
    return sql_named(
        _priced(_CAPPED, hourly_cost=_hourly_cost("r")),
        rental=Rental,
        hold=FundsHold,
        meter=UsageMeter,
        segment=UsageSegment,
    )


def capped_rentals(*, burning: Sequence[str]) -> list[tuple]:
    """Rentals in `burning` statuses with a cost cap: (id, team id, cap, charged so far, cost
    per hour, how far their usage is confirmed: the least of their nodes' latest
    confirmations, their start while a node has not reported), by id."""
    return _all(_capped_sql(), {"burning": list(burning)})


# --- Metering ---------------------------------------------------------------------------------
# bench/agents.py, server CPU per heartbeat, and bench/metering.py, usage reports per second:
# a batch of usage reports is applied in this one statement, atomic by itself.

_APPLY = """
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
    SELECT a.{allocation.rental_id}, max(upper(a.{allocation.during})) AS held_until,
           bool_and(a.{allocation.released_at} IS NOT NULL) AS released
    FROM {allocation} a
    WHERE a.{allocation.node_id} = %(node)s
        AND a.{allocation.rental_id} IN (SELECT rental_id FROM r)
    GROUP BY a.{allocation.rental_id}
),
clipped AS (
    SELECT r.*, h.rental_id IS NOT NULL AS allocated, h.released, h.held_until,
           LEAST(r.confirmed_at, h.held_until) AS until,
           old.{segment.id} AS old_id, old.{segment.confirmed_until} AS old_until,
               coalesce(old.{segment.final}, false)
               AS old_final,
           -- A final report ends the run: nothing confirmed after the first one counts.
           min(LEAST(r.confirmed_at, h.held_until)) FILTER (WHERE r.final)
               OVER (PARTITION BY r.rental_id, r.run_id) AS final_at
    FROM r
    LEFT JOIN held h ON h.rental_id = r.rental_id
    LEFT JOIN {segment} old
           ON old.{segment.rental_id} = r.rental_id AND old.{segment.node_id} = %(node)s
               AND old.{segment.run_id} = r.run_id
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
    INSERT INTO {segment} AS s
        (rental_id, node_id, run_id, gpu_count, started_at, confirmed_until, final,
         first_seq, last_seq, reports, created_at, updated_at)
    SELECT rental_id, %(node)s, run_id, gpu_count, started_at, confirmed_until, final,
           first_seq, last_seq, reports, %(now)s, %(now)s
    FROM folded
    ON CONFLICT (rental_id, node_id, run_id) DO UPDATE SET
        confirmed_until = GREATEST(s.{segment.confirmed_until}, EXCLUDED.confirmed_until),
        last_seq = CASE WHEN EXCLUDED.confirmed_until > s.{segment.confirmed_until}
                        THEN EXCLUDED.last_seq ELSE s.{segment.last_seq} END,
        first_seq = LEAST(s.{segment.first_seq}, EXCLUDED.first_seq),
        final = s.{segment.final} OR EXCLUDED.final,
        reports = s.{segment.reports} + EXCLUDED.reports,
        updated_at = EXCLUDED.updated_at
    -- A report that moves nothing (a duplicate, a replay, an older confirmation) is a no-op,
    -- and a final segment never moves again (a concurrent batch may have finalised it).
    WHERE NOT s.{segment.final}
      AND (EXCLUDED.confirmed_until > s.{segment.confirmed_until} OR EXCLUDED.final)
    RETURNING s.{segment.rental_id}, s.{segment.reports}
),
meters AS (
    -- The price is locked on the meter at its first report: a rental re-queued and re-booked
    -- elsewhere at another price leaves what ran here at the price it ran at.
    INSERT INTO {meter} AS m
        (rental_id, node_id, fee_bps, price_per_gpu_hour, usage_version, rated_version,
         gpu_seconds, charge_micros, posting_seq, posted_gpu_seconds, posted_charge_micros,
         posted_earning_micros, created_at)
    SELECT u.rental_id, %(node)s, %(fee_bps)s, rental.{rental.price_per_gpu_hour}, 1, 0, 0, 0, 0, 0,
           0, 0, %(now)s
    FROM (SELECT DISTINCT rental_id FROM seg) u
    JOIN {rental} rental ON rental.{rental.id} = u.rental_id
    ON CONFLICT (rental_id, node_id) DO UPDATE SET usage_version = m.{meter.usage_version} + 1
    RETURNING m.{meter.id}
)
SELECT coalesce(array_agg(idx ORDER BY idx) FILTER (WHERE refused IS NOT NULL), '{{}}'),
       coalesce(array_agg(refused ORDER BY idx) FILTER (WHERE refused IS NOT NULL), '{{}}'),
       (SELECT count(*) FROM meters)
FROM judged
"""


@cache
def _apply_sql() -> str:
    return sql_compact(
        sql_named(
            _APPLY, allocation=Allocation, segment=UsageSegment, meter=UsageMeter, rental=Rental
        )
    )


def usage_reports_apply(*, params: dict) -> tuple[list[int], list[str], int]:
    """Apply a node's usage reports (`params`: node, now, fee_bps and one array per report
    field, see billing.services.metering): (indexes refused, their reasons, meters touched)."""
    ((refused, reasons, meters),) = _all(_apply_sql(), params)
    return list(refused), list(reasons), int(meters)


# bench/metering.py: telemetry ingestion, a heartbeat's batch in one round trip and a large
# batch by COPY, beside a raw COPY of the same rows (the ceiling).
SAMPLE_FIELDS = (
    "node_id",
    "gpu_index",
    "ts",
    "util_pct",
    "mem_used_mb",
    "power_w",
    "temp_c",
    "rental_id",
)
_SAMPLE_TYPES = ("int8", "int2", "timestamptz", "float8", "int4", "float8", "float8", "uuid")

_INSERT_SAMPLES = """
WITH raw AS (
    INSERT INTO {sample} ({columns})
    SELECT %(node)s, * FROM unnest(%(s_gpu)s::int2[], %(s_ts)s::timestamptz[],
                                   %(s_util)s::float8[], %(s_mem)s::int4[],
                                   %(s_power)s::float8[], %(s_temp)s::float8[],
                                   %(s_rental)s::uuid[])
)
"""
_ROLLUP = """
INSERT INTO {minute} AS t
    (node_id, gpu_index, minute, rental_id, samples, util_sum, util_max, mem_max_mb,
     power_sum, temp_max)
SELECT %(node)s, v.gpu_index, v.minute,
       coalesce(v.rental_id, (
           -- Samples without a rental id belong to the rental that held the GPU in that
           -- minute (the latest, if the GPU changed hands within it).
           SELECT a.{allocation.rental_id} FROM {allocation} a
           JOIN {gpu} g ON g.{gpu.id} = a.{allocation.gpu_id}
           WHERE g.{gpu.node_id} = %(node)s AND g.{gpu.index} = v.gpu_index
             AND a.{allocation.during} && tstzrange(v.minute, v.minute + interval '1 minute')
           ORDER BY a.{allocation.id} DESC LIMIT 1)),
       v.samples, v.util_sum, v.util_max, v.mem_max, v.power_sum, v.temp_max
FROM unnest(%(gpu)s::int2[], %(minute)s::timestamptz[], %(rental)s::uuid[], %(n)s::int[],
            %(util_sum)s::float8[], %(util_max)s::float8[], %(mem_max)s::int4[],
            %(power_sum)s::float8[], %(temp_max)s::float8[])
     AS v(gpu_index, minute, rental_id, samples, util_sum, util_max, mem_max, power_sum,
          temp_max)
ON CONFLICT (node_id, gpu_index, minute) DO UPDATE SET
    rental_id = coalesce(t.{minute.rental_id}, EXCLUDED.rental_id),
    samples = t.{minute.samples} + EXCLUDED.samples,
    util_sum = t.{minute.util_sum} + EXCLUDED.util_sum,
    util_max = GREATEST(t.{minute.util_max}, EXCLUDED.util_max),
    mem_max_mb = GREATEST(t.{minute.mem_max_mb}, EXCLUDED.mem_max_mb),
    power_sum = t.{minute.power_sum} + EXCLUDED.power_sum,
    temp_max = GREATEST(t.{minute.temp_max}, EXCLUDED.temp_max)
"""


@cache
def _sample_columns() -> str:
    meta = TelemetrySample._meta
    return ", ".join(connection.ops.quote_name(meta.get_field(f).column) for f in SAMPLE_FIELDS)


@cache
def _rollup_sql(with_samples: bool) -> str:
    template = (_INSERT_SAMPLES if with_samples else "") + _ROLLUP
    return sql_named(
        _priced(template, columns=_sample_columns()),
        sample=TelemetrySample,
        minute=TelemetryMinute,
        allocation=Allocation,
        gpu=Gpu,
    )


def telemetry_samples_insert_and_roll_up(*, params: dict) -> None:
    """A small batch: the raw samples (`s_*` arrays) and the per-minute rollups, one statement."""
    with connection.cursor() as cursor:
        cursor.execute(_rollup_sql(True), params)


def telemetry_samples_copy_and_roll_up(*, rows: Sequence[tuple], params: dict) -> None:
    """A large batch: COPY the raw samples (rows of SAMPLE_FIELDS), then fold the rollups;
    call inside atomic()."""
    sql = sql_named(
        _priced("COPY {sample} ({columns}) FROM STDIN (FORMAT BINARY)", columns=_sample_columns()),
        sample=TelemetrySample,
    )
    with connection.cursor() as cursor:
        with cursor.cursor.copy(sql) as copy:
            copy.set_types(list(_SAMPLE_TYPES))
            for row in rows:
                copy.write_row(row)
        cursor.execute(_rollup_sql(False), params)


# --- The billing pass -------------------------------------------------------------------------
# bench/metering.py: one pass over 100,000 running rentals is a handful of set-based statements,
# not 100,000 round trips. The pass works through two temporary tables of its own session:
#   rate    every meter's totals, read from the usage, allocations and events in as few
#           statements as the meters allow (each reads those tables whole, by hash joins, so
#           one statement over 100,000 meters costs far less than four over 25,000), locking
#           nothing: the rows go to pg_temp.billing_pass_rated;
#   decide  which meters to write and which to post, in posting order (by team, so each
#           customer's balance is written by one posting chunk): pg_temp.billing_pass_decided;
#   post    a chunk of decided meters per transaction: the meters' totals, their ledger entries
#           and the balances, in one statement that reads nothing but the decided rows.

_CANDIDATES = """
    SELECT m.{meter.id}, m.{meter.rental_id}, m.{meter.node_id}, m.{meter.fee_bps},
        m.{meter.usage_version}, m.{meter.gpu_seconds},
           m.{meter.charge_micros}, m.{meter.posting_seq}, m.{meter.posted_gpu_seconds},
               m.{meter.posted_charge_micros},
           m.{meter.posted_earning_micros}, m.{meter.posted_at},
           m.{meter.credited_gpu_seconds}, m.{meter.credit_micros},
               m.{meter.posted_credited_gpu_seconds}, m.{meter.posted_credit_micros},
           coalesce(m.{meter.price_per_gpu_hour},
               r.{rental.price_per_gpu_hour}) AS price_per_gpu_hour,
           -- Rated again on a new report, and when the rental moved (a stop, an end, a
           -- release): those can only shorten what may be billed.
           ((m.{meter.rated_version} < m.{meter.usage_version}
               OR r.{rental.updated_at} > m.{meter.rated_at})
            AND coalesce(m.{meter.price_per_gpu_hour},
                r.{rental.price_per_gpu_hour}) IS NOT NULL) AS dirty,
           r.{rental.started_at}, r.{rental.ended_at}, r.{rental.status}, r.{rental.team_id},
               n.{node.provider_id}
    FROM {meter} m
    JOIN {rental} r ON r.{rental.id} = m.{meter.rental_id}
    JOIN {node} n ON n.{node.id} = m.{meter.node_id}
    WHERE m.{meter.id} >= %(first_id)s AND m.{meter.id} < %(end_id)s
      AND (m.{meter.rated_version} < m.{meter.usage_version}
          OR r.{rental.updated_at} > m.{meter.rated_at}
           OR m.{meter.charge_micros} <> m.{meter.posted_charge_micros}
           OR m.{meter.credit_micros} <> m.{meter.posted_credit_micros})
"""

# What rating leaves for the rest of the pass, per meter: the meter as read, then its new totals.
_RATED_COLUMNS = (
    ("id", "bigint"),
    ("rental_id", "uuid"),
    ("team_id", "bigint"),
    ("provider_id", "bigint"),
    ("fee_bps", "integer"),
    ("usage_version", "bigint"),
    ("dirty", "boolean"),
    ("status", "text"),
    ("posting_seq", "bigint"),
    ("posted_gpu_seconds", "bigint"),
    ("posted_charge_micros", "bigint"),
    ("posted_earning_micros", "bigint"),
    ("posted_at", "timestamptz"),
    ("posted_credited_gpu_seconds", "bigint"),
    ("posted_credit_micros", "bigint"),
    ("new_seconds", "bigint"),
    ("new_charge", "bigint"),
    ("new_credited_seconds", "bigint"),
    ("new_credit", "bigint"),
    ("credit_reason", "text"),
)
_DECIDED_COLUMNS = (
    ("k", "bigint"),
    *_RATED_COLUMNS,
    ("customer_account_id", "bigint"),
    ("provider_account_id", "bigint"),
    ("new_earning", "bigint"),
    ("post", "boolean"),
)

_RATE = """
INSERT INTO pg_temp.billing_pass_rated
WITH c AS ({candidates}),
confirmed AS (
    -- The union of the runs' confirmed spans: two runs that overlap (a restart confirmed
    -- late) never bill the same second twice.
    SELECT c.id, max(s.{segment.gpu_count}) AS gpus,
           range_agg(tstzrange(s.{segment.started_at}, s.{segment.confirmed_until})) AS spans
    FROM c JOIN {segment} s ON s.{segment.rental_id} = c.rental_id
        AND s.{segment.node_id} = c.node_id
    WHERE c.dirty
    GROUP BY c.id
),
moves AS (
    -- Only the moves that can end a RUNNING episode or its stop (%(moves)s, from the
    -- lifecycle's table) and RUNNING itself: those before a rental first ran, or a re-queued
    -- one ran again, are never the move after one of them, and skipping them halves the sort.
    SELECT ev.{event.rental_id}, ev.{event.to_status}, ev.{event.created_at}, c.ended_at,
           lead(ev.{event.to_status}) OVER w AS next_to,
           lead(ev.{event.created_at}) OVER w AS next_at,
           lead(ev.{event.created_at}, 2) OVER w AS after_next_at
    FROM (SELECT DISTINCT rental_id, ended_at FROM c WHERE dirty) c
    JOIN {event} ev ON ev.{event.rental_id} = c.rental_id
    WHERE ev.{event.to_status} = ANY(%(moves)s)
    WINDOW w AS (PARTITION BY ev.{event.rental_id} ORDER BY ev.{event.created_at}, ev.{event.id})
),
episodes AS (
    -- Each time the rental was RUNNING, in the server's own event times only: from the RUNNING
    -- event (never the start time an agent reports) to the next move; a stop counts for its
    -- grace at most, so a stop that never reaches the agent stops the bill anyway.
    SELECT rental_id, lo, GREATEST(lo, hi) AS hi
    FROM (SELECT rental_id, created_at AS lo,
                 LEAST(CASE WHEN next_to = 'stopping'
                            THEN LEAST(next_at + %(grace)s, coalesce(after_next_at, 'infinity'))
                            ELSE coalesce(next_at, 'infinity') END,
                       coalesce(ended_at, 'infinity')) AS hi
          FROM moves WHERE to_status = 'running') e
),
running AS (
    SELECT rental_id, range_agg(tstzrange(lo, hi)) AS spans FROM episodes GROUP BY rental_id
),
credits AS (
    -- GPU time node faults destroyed (marketplace.RentalCredit): rated apart, credited back.
    SELECT c.id, range_agg(fc.{credit.during}) AS spans,
           left(string_agg(DISTINCT fc.{credit.reason}, '; '), 500) AS reason
    FROM c JOIN {credit} fc ON fc.{credit.rental_id} = c.rental_id
    GROUP BY c.id
),
held AS (
    -- The allocations on the meter's node, by range (each GPU's, cut at its release): GPUs
    -- placed together share one, so its seconds are worked out once for all of them, and the
    -- agent's GPU count caps how many of them are billed.
    SELECT c.id, c.rental_id, al.{allocation.during}, count(*) AS gpus
    FROM c JOIN {allocation} al
           ON al.{allocation.rental_id} = c.rental_id AND al.{allocation.node_id} = c.node_id
    WHERE c.dirty
    GROUP BY c.id, c.rental_id, al.{allocation.during}
),
used_all AS (
    -- Billable: confirmed, inside the allocation held on this node, while the rental ran; and
    -- of that, what a node fault destroyed (credited).
    SELECT h.id,
           sum(LEAST(h.gpus, k.gpus) * floor(extract(epoch FROM (
               SELECT sum(upper(x) - lower(x))
               FROM unnest(k.spans * tstzmultirange(h.during) * ru.spans) AS x))))::bigint
               AS all_seconds,
           coalesce(sum(LEAST(h.gpus, k.gpus) * floor(extract(epoch FROM (
               SELECT sum(upper(x) - lower(x))
               FROM unnest(k.spans * tstzmultirange(h.during) * ru.spans * cr.spans) AS x)))),
               0)::bigint AS credited_seconds
    FROM held h
    JOIN confirmed k ON k.id = h.id
    JOIN running ru ON ru.rental_id = h.rental_id
    LEFT JOIN credits cr ON cr.id = h.id
    GROUP BY h.id
),
used AS (
    SELECT id, all_seconds - credited_seconds AS gpu_seconds, credited_seconds FROM used_all
)
SELECT c.id, c.rental_id, c.team_id, c.provider_id, c.fee_bps, c.usage_version, c.dirty,
       c.status, c.posting_seq, c.posted_gpu_seconds, c.posted_charge_micros,
       c.posted_earning_micros, c.posted_at, c.posted_credited_gpu_seconds,
       c.posted_credit_micros,
       CASE WHEN c.dirty THEN coalesce(used.gpu_seconds, 0) ELSE c.gpu_seconds END,
       CASE WHEN c.dirty THEN ({charge})::bigint ELSE c.charge_micros END,
       CASE WHEN c.dirty THEN coalesce(used.credited_seconds, 0)
            ELSE c.credited_gpu_seconds END,
       CASE WHEN c.dirty THEN ({charge_all})::bigint - ({charge})::bigint
            ELSE c.credit_micros END,
       cr.reason
FROM c
LEFT JOIN used ON used.id = c.id
LEFT JOIN credits cr ON cr.id = c.id
"""
_ENSURE_ACCOUNTS = """
INSERT INTO {account} (kind, team_id, provider_id, balance_micros, stripe_customer_id,
                       stripe_connect_account_id, created_at)
SELECT w.kind, w.team_id, w.provider_id, 0, '', '', %(now)s
FROM (SELECT DISTINCT 'customer' AS kind, team_id, NULL::bigint AS provider_id
      FROM pg_temp.billing_pass_rated
      UNION ALL
      SELECT DISTINCT 'provider', NULL::bigint, provider_id FROM pg_temp.billing_pass_rated) w
WHERE NOT EXISTS (SELECT 1 FROM {account} a
                  WHERE a.{account.kind} = w.kind
                    AND (a.{account.team_id} = w.team_id
                         OR a.{account.provider_id} = w.provider_id))
ON CONFLICT DO NOTHING
"""
_DECIDE = """
INSERT INTO pg_temp.billing_pass_decided
SELECT row_number() OVER (ORDER BY d.team_id, d.id), d.*
FROM (
    SELECT r.*, ca.{account.id} AS customer_account_id, pa.{account.id} AS provider_account_id,
           div(r.new_charge::numeric * (10000 - r.fee_bps), 10000)::bigint AS new_earning,
           ((r.new_charge <> r.posted_charge_micros OR r.new_credit <> r.posted_credit_micros)
            AND ca.{account.id} IS NOT NULL AND pa.{account.id} IS NOT NULL
            AND (r.posted_at IS NULL
                 OR r.posted_at <= %(cutoff)s
                 OR r.posted_at < %(month_start)s
                 OR r.status = ANY(%(terminal)s))) AS post
    FROM pg_temp.billing_pass_rated r
    LEFT JOIN {account} ca ON ca.{account.kind} = 'customer' AND ca.{account.team_id} = r.team_id
    LEFT JOIN {account} pa ON pa.{account.kind} = 'provider'
        AND pa.{account.provider_id} = r.provider_id
) d
WHERE d.dirty OR d.post
"""
_POST = """
WITH d AS (
    SELECT * FROM pg_temp.billing_pass_decided WHERE k >= %(first_k)s AND k < %(end_k)s
),
moved AS (
    -- The pass is the only writer of these columns (one pass at a time), so the values rated
    -- are still current (the posting guard says so again); a report racing the pass only
    -- moves usage_version, which stays ahead of rated_version and is rated next pass.
    UPDATE {meter} m
    SET gpu_seconds = d.new_seconds,
        charge_micros = d.new_charge,
        rated_version = CASE WHEN d.dirty THEN d.usage_version ELSE m.{meter.rated_version} END,
        rated_at = CASE WHEN d.dirty THEN %(now)s ELSE m.{meter.rated_at} END,
        posting_seq = d.posting_seq + d.post::int,
        posted_gpu_seconds = CASE WHEN d.post THEN d.new_seconds ELSE d.posted_gpu_seconds END,
        posted_charge_micros = CASE WHEN d.post THEN d.new_charge ELSE d.posted_charge_micros END,
        posted_earning_micros = CASE WHEN d.post THEN d.new_earning
                                     ELSE d.posted_earning_micros END,
        posted_at = CASE WHEN d.post THEN %(now)s ELSE d.posted_at END,
        credited_gpu_seconds = d.new_credited_seconds,
        credit_micros = d.new_credit,
        posted_credited_gpu_seconds = CASE WHEN d.post THEN d.new_credited_seconds
                                           ELSE d.posted_credited_gpu_seconds END,
        posted_credit_micros = CASE WHEN d.post THEN d.new_credit
                                    ELSE d.posted_credit_micros END
    FROM d
    WHERE m.{meter.id} = d.id AND m.{meter.posting_seq} = d.posting_seq
    RETURNING m.{meter.id}
),
entries AS (
    -- The deltas since the last posting, from totals: usage + fault credit + earning + fee
    -- = 0. The customer's usage is every billable second; the GPU time a node fault destroyed
    -- is credited back beside it with the reason, and the provider earns on the rest only.
    INSERT INTO {entry}
        (account_id, kind, amount_micros, rental_id, meter_id, posting_seq, gpu_seconds, memo,
         created_at)
    SELECT v.account_id, v.kind, v.amount, d.rental_id, d.id, d.posting_seq + 1, v.seconds,
           v.memo, %(now)s
    FROM d JOIN moved ON moved.id = d.id CROSS JOIN LATERAL (VALUES
        (d.customer_account_id, 'usage',
         (d.posted_charge_micros + d.posted_credit_micros) - (d.new_charge + d.new_credit),
         (d.new_seconds + d.new_credited_seconds)
             - (d.posted_gpu_seconds + d.posted_credited_gpu_seconds), ''),
        (d.customer_account_id, 'fault_credit', d.new_credit - d.posted_credit_micros,
         d.new_credited_seconds - d.posted_credited_gpu_seconds,
         left('node fault: ' || coalesce(d.credit_reason, ''), 500)),
        (d.provider_account_id, 'earning', d.new_earning - d.posted_earning_micros,
         NULL::bigint, ''),
        (%(platform)s::bigint, 'platform_fee',
         (d.new_charge - d.posted_charge_micros) - (d.new_earning - d.posted_earning_micros),
         NULL::bigint, '')
    ) AS v(account_id, kind, amount, seconds, memo)
    WHERE d.post AND v.amount <> 0
    RETURNING account_id, amount_micros
),
balances AS (
    UPDATE {account} a SET balance_micros = a.{account.balance_micros} + t.total
    FROM (SELECT account_id, sum(amount_micros) AS total FROM entries GROUP BY account_id) t
    WHERE a.{account.id} = t.account_id
    RETURNING a.{account.id}
)
SELECT (SELECT count(*) FROM d WHERE dirty), (SELECT count(*) FROM d WHERE post),
       (SELECT count(*) FROM entries), (SELECT count(*) FROM balances),
       (SELECT count(DISTINCT account_id) FROM entries)
"""


def _charge() -> str:
    return cost_micros_sql(
        price="c.price_per_gpu_hour", gpu_seconds="coalesce(used.gpu_seconds, 0)"
    )


def _charge_all() -> str:
    """The charge of every billable second, the credited ones included."""
    return cost_micros_sql(
        price="c.price_per_gpu_hour",
        gpu_seconds="coalesce(used.gpu_seconds, 0) + coalesce(used.credited_seconds, 0)",
    )


_PASS_TABLES = {
    "meter": UsageMeter,
    "rental": Rental,
    "node": Node,
    "segment": UsageSegment,
    "event": RentalEvent,
    "allocation": Allocation,
    "account": Account,
    "entry": LedgerEntry,
    "credit": RentalCredit,
}


@cache
def _pass_sql(name: str) -> str:
    template = {
        "rate": _RATE,
        "ensure": _ENSURE_ACCOUNTS,
        "decide": _DECIDE,
        "post": _POST,
    }[name]
    return sql_named(
        _priced(template, candidates=_CANDIDATES, charge=_charge(), charge_all=_charge_all()),
        **_PASS_TABLES,
    )


def _temp_table(name: str, columns: tuple[tuple[str, str], ...]) -> str:
    return f"CREATE TEMP TABLE {name} ({', '.join(f'{c} {t}' for c, t in columns)})"


def billing_pass_tables_create() -> None:
    """The pass's two temporary tables, empty (this session's own: one pass at a time holds
    them); billing_pass_tables_drop removes them when the pass is done."""
    with connection.cursor() as cursor:
        billing_pass_tables_drop()
        cursor.execute(_temp_table("billing_pass_rated", _RATED_COLUMNS))
        cursor.execute(_temp_table("billing_pass_decided", _DECIDED_COLUMNS))


def billing_pass_tables_drop() -> None:
    with connection.cursor() as cursor:
        cursor.execute(
            "DROP TABLE IF EXISTS pg_temp.billing_pass_rated, pg_temp.billing_pass_decided"
        )


class LedgerAccountMissing(Exception):
    """A posting named an account that does not exist; nothing of its chunk was written."""


class ChunkTimedOut(Exception):
    """A chunk of the billing pass ran past its statement timeout; nothing of it was written."""


def _chunk_run(sql: str, params: dict, *, timeout_ms: int, settings: Sequence[str]) -> tuple:
    """One chunk's statement with `settings` (SET LOCAL) and its own statement timeout, inside
    the caller's atomic(): its one row, or ChunkTimedOut."""
    with connection.cursor() as cursor:
        for setting in settings:
            cursor.execute(f"SET LOCAL {setting}")
        if timeout_ms:
            cursor.execute("SELECT set_config('statement_timeout', %s, true)", [str(timeout_ms)])
        try:
            cursor.execute(sql, params)
        except OperationalError as exc:
            if isinstance(exc.__cause__, psycopg.errors.QueryCanceled):
                raise ChunkTimedOut(str(exc)) from exc
            raise
        return cursor.fetchone() if cursor.description else (cursor.rowcount,)


# The planner sees each CTE scan of `c` joined on (rental, node) as a handful of rows (it
# multiplies the two columns' selectivities), so with nested loops it joined the per-meter spans
# pairwise: 50 million rows compared at 5,000 meters, a pass that grew with the square of the
# running rentals. Every join of the rating is set-based, so nested loops are off. The statement
# costs enough to be JIT-compiled, which took 4.9 of its 5.5 s at 5,000 meters: JIT is off. And
# its sorts (the events of every rental, in order) spilled to disk at the default work_mem.
_RATE_SETTINGS = ("enable_nestloop = off", "jit = off", "work_mem = '64MB'")
# Posting joins the decided rows, whose size the planner knows (the table is analysed), by id.
# Its commit does not wait for the WAL to reach disk (a chunk's commit took as long as its
# statement on a busy disk): a crash can lose only the last chunks whole (meters, entries and
# balances together, never one without the others), and the next pass posts them again from
# the meters' totals, as it does after any chunk that did not commit.
_POST_SETTINGS = ("enable_nestloop = on", "jit = off", "synchronous_commit = off")


def meters_rate(*, params: dict, timeout_ms: int = 0) -> int:
    """Rate the meters with ids from first_id to end_id into pg_temp.billing_pass_rated (see
    billing.services.rating): how many were rated or are still to post. Call inside atomic()."""
    (rows,) = _chunk_run(_pass_sql("rate"), params, timeout_ms=timeout_ms, settings=_RATE_SETTINGS)
    return rows


def billing_accounts_ensure(*, params: dict) -> None:
    """The customer and provider accounts the rated meters post to, created where missing."""
    with connection.cursor() as cursor:
        cursor.execute(_pass_sql("ensure"), params)


def meters_decide(*, params: dict) -> int:
    """Which rated meters are written and which posted, numbered 1.. in posting order (by team)
    in pg_temp.billing_pass_decided: how many."""
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE pg_temp.billing_pass_rated")
        cursor.execute(_pass_sql("decide"), params)
        decided = cursor.rowcount
        cursor.execute("CREATE INDEX ON pg_temp.billing_pass_decided (k)")
        cursor.execute("ANALYZE pg_temp.billing_pass_decided")
    return decided


def meters_post(*, params: dict, timeout_ms: int = 0) -> tuple[int, int, int]:
    """Write the decided meters numbered first_k to end_k, post their entries and move the
    balances: (meters rated, meters posted, ledger entries written). Call inside atomic()."""
    rated, posted, entries, balances, accounts = _chunk_run(
        _pass_sql("post"), params, timeout_ms=timeout_ms, settings=_POST_SETTINGS
    )
    if balances != accounts:
        # What the ledger's foreign key would have refused: the caller's atomic() rolls back.
        raise LedgerAccountMissing(f"entries name {accounts} accounts, {balances} exist")
    return rated, posted, entries


_POSITIONS = """
WITH burn AS (
    SELECT r.{rental.team_id}, sum({hourly_cost})::bigint AS micros_per_hour
    FROM {rental} r
    WHERE r.{rental.status} = ANY(%(burning)s) AND r.{rental.price_per_gpu_hour} IS NOT NULL
    GROUP BY r.{rental.team_id}
),
accrued AS (
    SELECT r.{rental.team_id},
        sum(m.{meter.charge_micros} - m.{meter.posted_charge_micros})::bigint AS micros
    FROM {meter} m JOIN {rental} r ON r.{rental.id} = m.{meter.rental_id}
    WHERE m.{meter.charge_micros} <> m.{meter.posted_charge_micros}
    GROUP BY r.{rental.team_id}
),
who AS (
    SELECT team_id FROM burn
    UNION SELECT team_id FROM accrued
    UNION SELECT f.{account.team_id} FROM {account} f
          WHERE f.{account.kind} = 'customer'
            AND (f.{account.low_balance_since} IS NOT NULL
                OR f.{account.depleted_since} IS NOT NULL)
)
SELECT who.team_id, a.{account.id},
       coalesce(a.{account.balance_micros}, 0) - coalesce(accrued.micros, 0) AS available,
       coalesce(burn.micros_per_hour, 0) AS burn,
       a.{account.low_balance_since} IS NOT NULL, a.{account.depleted_since} IS NOT NULL
FROM who
LEFT JOIN {account} a ON a.{account.kind} = 'customer' AND a.{account.team_id} = who.team_id
LEFT JOIN burn ON burn.team_id = who.team_id
LEFT JOIN accrued ON accrued.team_id = who.team_id
"""


@cache
def _positions_sql() -> str:
    return sql_named(
        _priced(_POSITIONS, hourly_cost=_hourly_cost("r")),
        rental=Rental,
        meter=UsageMeter,
        account=Account,
    )


def team_positions(*, burning: Sequence[str]) -> list[tuple]:
    """Teams with money at stake (a rental in `burning` statuses, accrued usage, or a flag to
    clear): (team id, account id, available, cost per hour, low flag set, depleted flag set)."""
    return _all(_positions_sql(), {"burning": list(burning)})
