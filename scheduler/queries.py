"""The scheduler's hand-written SQL, each statement here and nowhere else in the app.

bench/scheduler.py measures what these pay for (placements per second and p99 create to
SCHEDULED, `--parts stream`; docs/benchmarks.md): the snapshot's reads return times as epoch
seconds (float8), which the engine uses, instead of datetimes and ranges that cost more to parse
than the rest of the snapshot; the inventory is one digest row; the bind is a COPY and the
waiting reasons one set-based UPDATE per chunk. Names come from the models' `_meta`
(core.rows.sql_named), each statement built once per process; tests/scheduler/test_queries.py
asks each one's question again through the ORM.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime
from functools import cache

from django.db import connection

from core.rows import filters_set, sql_named
from marketplace.models import Allocation, Cluster, Gpu, GpuModel, Node, Rental

_TABLES = {
    "allocation": Allocation,
    "cluster": Cluster,
    "rental": Rental,
    "node": Node,
    "gpu_model": GpuModel,
    "gpu": Gpu,
}

_BUSY = """
SELECT a.{allocation.gpu}, a.{allocation.rental},
       extract(epoch FROM lower(a.{allocation.during}))::float8,
       extract(epoch FROM upper(a.{allocation.during}))::float8,
       r.{rental.kind}, r.{rental.price_per_gpu_hour}, r.{rental.priority}
FROM {allocation} a JOIN {rental} r ON r.{rental.id} = a.{allocation.rental}
WHERE a.{allocation.node} = ANY(%(nodes)s) AND a.{allocation.released_at} IS NULL
  AND upper(a.{allocation.during}) > %(now)s
"""


@cache
def _busy_sql() -> str:
    return sql_named(_BUSY, **_TABLES)


def allocations_busy(*, node_ids: Sequence[int], now: datetime) -> list[tuple]:
    """The unreleased allocations of the nodes that end after `now`: (GPU id, rental id, start
    and end in epoch seconds, the rental's kind, locked price and priority)."""
    with connection.cursor() as cursor:
        cursor.execute(_busy_sql(), {"nodes": list(node_ids), "now": now})
        return cursor.fetchall()


# The pending rentals' columns the engine reads (scheduler.services.engine_request), times
# in epoch seconds under their own names.
PENDING_FIELDS = (
    "id",
    "created_at",
    "gpus_per_node",
    "node_count",
    "duration_s",
    "start_at",
    "start_deadline",
    "priority",
    "gpu_models",
    "gpu_families",
    "min_memory_gb",
    "min_tensor_tflops",
    "same_group",
    "region",
    "pool",
    "max_price_per_gpu_hour",
    "kind",
    "bid_per_gpu_hour",
    "ssh",
    "network",
    "jupyter",
    "min_interconnect_gbps",
    "image",
)
_EPOCH_FIELDS = frozenset({"created_at", "start_at", "start_deadline"})


@cache
def _pending_sql(limited: bool) -> str:
    meta = Rental._meta
    quote = connection.ops.quote_name
    columns = []
    for name in PENDING_FIELDS:
        column = f"r.{quote(meta.get_field(name).column)}"
        if name in _EPOCH_FIELDS:
            column = f"extract(epoch FROM {column})::float8"
        columns.append(f"{column} AS {quote(name)}")
    return sql_named(
        f"SELECT {', '.join(columns)} FROM {{rental}} r"  # noqa: S608 - the model's own names
        " WHERE r.{rental.pool} = %(pool)s AND r.{rental.status} = %(pending)s"
        " ORDER BY r.{rental.created_at}" + (" LIMIT %(limit)s" if limited else ""),
        rental=Rental,
    )


def rentals_pending(*, pool: str, pending: str, limit: int | None = None) -> list[dict]:
    """The pool's rentals in status `pending`, oldest first (at most `limit`): dicts of
    PENDING_FIELDS."""
    params = {"pool": pool, "pending": pending, "limit": limit}
    with connection.cursor() as cursor:
        cursor.execute(_pending_sql(limit is not None), params)
        return [dict(zip(PENDING_FIELDS, row, strict=True)) for row in cursor.fetchall()]


# What the engine reads of a pool's online nodes and their GPUs, folded into one digest: while
# it is unchanged, the nodes mapped last time are still exact and are not read again.
_DIGEST = """
SELECT count(*), md5(string_agg(concat_ws(
           ':', n.{node.id}, n.{node.region}, n.{node.price_per_gpu_hour},
           n.{node.min_bid_per_gpu_hour}, n.{node.reliability}, n.{node.nvlink},
           n.{node.ssh_capable}, n.{node.internet_capable}, coalesce(n.{node.cluster}, 0),
           coalesce(array_to_string(n.{node.image_allow}, ' '), '*unset*'), n.{node.images},
           coalesce(c.{cluster.bandwidth_gbps}, 0), m.{gpu_model.slug},
           m.{gpu_model.family}, m.{gpu_model.memory_gb}, m.{gpu_model.tensor_tflops}, g.gpus),
       ',' ORDER BY n.{node.id}))
FROM {node} n
JOIN {gpu_model} m ON m.{gpu_model.id} = n.{node.gpu_model}
LEFT JOIN {cluster} c ON c.{cluster.id} = n.{node.cluster}
CROSS JOIN LATERAL (
    SELECT string_agg(concat_ws('/', x.{gpu.id}, x.{gpu.index}, x.{gpu.topology_group}), ','
                      ORDER BY x.{gpu.index}) AS gpus
    -- A FAILED GPU (marketplace GpuHealth) is out of placement: not in what the engine reads.
    FROM {gpu} x WHERE x.{gpu.node} = n.{node.id} AND x.{gpu.health} <> 'failed'
) g
WHERE n.{node.pool} = %(pool)s AND n.{node.status} = %(online)s
"""


@cache
def _digest_sql() -> str:
    return sql_named(_DIGEST, **_TABLES)


def inventory_digest(*, pool: str, online: str) -> tuple[int, str | None]:
    """(count, md5) of what the engine reads of the pool's nodes in status `online`."""
    with connection.cursor() as cursor:
        cursor.execute(_digest_sql(), {"pool": pool, "online": online})
        return tuple(cursor.fetchone())


def snapshot_isolation_set() -> None:
    """The transaction's first statement: one snapshot for all its reads, no writes (the ORM
    has no word for an isolation level per transaction)."""
    with connection.cursor() as cursor:
        cursor.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY")


# Candidate nodes for one simple request: online nodes of the pool that match its hardware and
# have enough GPUs free over its window, fullest first (best fit), then cheapest. The engine
# still checks everything on what this returns; the SQL only chooses what it reads. Each
# optional filter is in the statement only when the request sets it (one statement per
# combination, each with its own plan: marketplace.queries' refusal check says why).
_CANDIDATES = """
SELECT n.{node.id}
FROM {node} n
JOIN {gpu_model} m ON m.{gpu_model.id} = n.{node.gpu_model}
LEFT JOIN (
    SELECT x.{allocation.node} AS node_id, count(DISTINCT x.{allocation.gpu}) AS held
    FROM {allocation} x
    WHERE x.{allocation.released_at} IS NULL
      AND x.{allocation.during} && tstzrange(%(start)s, %(end)s)
    GROUP BY x.{allocation.node}
) b ON b.node_id = n.{node.id}
WHERE n.{node.pool} = %(pool)s AND n.{node.status} = %(online)s
  AND n.{node.gpu_count} - coalesce(b.held, 0) >= %(k)s{optional}
ORDER BY n.{node.gpu_count} - coalesce(b.held, 0), n.{node.price_per_gpu_hour}, n.{node.id}
LIMIT %(limit)s
"""
_CANDIDATE_FILTERS = {
    "region": "n.{node.region} = %(region)s",
    "models": "m.{gpu_model.slug} = ANY(%(models)s::text[])",
    "families": "m.{gpu_model.family} = ANY(%(families)s::text[])",
    "memory": "m.{gpu_model.memory_gb} >= %(memory)s",
    "tflops": "m.{gpu_model.tensor_tflops} >= %(tflops)s",
    "max_price": "n.{node.price_per_gpu_hour} <= %(max_price)s",
    "ssh": "n.{node.ssh_capable}",
    "internet": "n.{node.internet_capable}",
}
_CANDIDATE_ALWAYS = ("pool", "online", "start", "end", "k", "limit")


@cache
def _candidates_sql(filters: frozenset[str]) -> str:
    optional = "".join(f"\n  AND {_CANDIDATE_FILTERS[name]}" for name in sorted(filters))
    return sql_named(_CANDIDATES.replace("{optional}", optional), **_TABLES)


def candidate_nodes(*, params: dict) -> list[int]:
    """The ids of the candidate nodes for one request shape (`params`: pool, online, start,
    end, region, models, families, memory, tflops, max_price, k, ssh, internet, limit), best
    fit first. A max_price of None, and any other optional filter false, zero or empty, does
    not filter (core.rows.filters_set)."""
    filters = filters_set(params, _CANDIDATE_FILTERS, nullable=("max_price",))
    used = {name: params[name] for name in (*_CANDIDATE_ALWAYS, *filters)}
    with connection.cursor() as cursor:
        cursor.execute(_candidates_sql(filters), used)
        return [row[0] for row in cursor.fetchall()]


@cache
def _copy_allocations_sql() -> str:
    meta = Allocation._meta
    quote = connection.ops.quote_name
    columns = ", ".join(
        quote(meta.get_field(name).column)
        for name in ("rental", "gpu", "node", "during", "created_at")
    )
    return sql_named(f"COPY {{allocation}} ({columns}) FROM STDIN", allocation=Allocation)


def allocations_copy(*, rows: Iterable[tuple[str, int, int, str, datetime]]) -> None:
    """COPY allocation rows (rental id, GPU id, node id, during as a range literal, created
    at): the bind is the scheduler's hot write, and the exclusion constraint checks every row
    COPY writes exactly as it would an INSERT."""
    with connection.cursor() as cursor, cursor.cursor.copy(_copy_allocations_sql()) as copy:
        for row in rows:
            copy.write_row(row)


@cache
def _waiting_sql(count: int) -> str:
    values = ", ".join(["(%s::uuid, %s)"] * count)
    return sql_named(
        "UPDATE {rental} r SET {rental.status_reason} = v.reason"  # noqa: S608 - placeholders
        f" FROM (VALUES {values}) AS v(id, reason)"
        " WHERE r.{rental.id} = v.id AND r.{rental.status} = %s"
        " AND r.{rental.status_reason} IS DISTINCT FROM v.reason",
        rental=Rental,
    )


def waiting_reasons_set(*, reasons: Sequence[tuple[str, str]], status: str) -> None:
    """Set each (rental id, reason) on rentals still in `status`, writing only reasons that
    changed, in one statement."""
    params = [x for rental_id, reason in reasons for x in (rental_id, reason)]
    with connection.cursor() as cursor:
        cursor.execute(_waiting_sql(len(reasons)), [*params, status])
