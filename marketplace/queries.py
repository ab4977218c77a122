"""The marketplace's hand-written SQL, each statement here and nowhere else in the app.

Each is written by hand because a `bench/` script shows the ORM's version costing more (the
comment above each names the figure). Names come from the models' `_meta`
(core.rows.sql_named), each statement built once per process (per filter combination for the
offers); tests/marketplace/test_queries.py asks each one's question again through the ORM.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from functools import cache
from typing import TYPE_CHECKING

from django.db import connection

from core.rows import filters_set, sql_named
from marketplace.models import (
    Allocation,
    Cluster,
    Gpu,
    GpuHealth,
    GpuModel,
    Node,
    NodeStatus,
    Provider,
    Rental,
    RentalEvent,
)

if TYPE_CHECKING:
    from marketplace.selectors import OfferFilters

_TABLES = {
    "allocation": Allocation,
    "cluster": Cluster,
    "node": Node,
    "gpu_model": GpuModel,
    "gpu": Gpu,
    "provider": Provider,
    "rental": Rental,
    "event": RentalEvent,
}


def _all(sql: str, params) -> list[tuple]:
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return cursor.fetchall()


# --- Offers -----------------------------------------------------------------------------------
# The hot read of the marketplace. Written in SQL because it joins nodes to an aggregate of the
# allocations that hold GPUs right now, which the ORM can only express as a per-row subquery
# (ten times slower at 10,000 nodes; bench/offers.py measures the list).

# ordering name -> ORDER BY (whitelisted: never interpolate user text into SQL).
OFFER_ORDERINGS = {
    "price": "n.{node.price_per_gpu_hour}, n.{node.id}",
    "-price": "n.{node.price_per_gpu_hour} DESC, n.{node.id}",
    "memory": "m.{gpu_model.memory_gb}, n.{node.price_per_gpu_hour}, n.{node.id}",
    "-memory": "m.{gpu_model.memory_gb} DESC, n.{node.price_per_gpu_hour}, n.{node.id}",
    "price_per_tflop": "price_per_tflop_hour, n.{node.id}",
    "-price_per_tflop": "price_per_tflop_hour DESC, n.{node.id}",
    "tflops": "m.{gpu_model.tensor_tflops}, n.{node.price_per_gpu_hour}, n.{node.id}",
    "-tflops": "m.{gpu_model.tensor_tflops} DESC, n.{node.price_per_gpu_hour}, n.{node.id}",
    "reliability": "n.{node.reliability}, n.{node.price_per_gpu_hour}, n.{node.id}",
    "-reliability": "n.{node.reliability} DESC, n.{node.price_per_gpu_hour}, n.{node.id}",
    "free_gpus": "free_gpus, n.{node.price_per_gpu_hour}, n.{node.id}",
    "-free_gpus": "free_gpus DESC, n.{node.price_per_gpu_hour}, n.{node.id}",
}

_OFFER_ROWS = """
SELECT n.{node.id} AS node_id, n.{node.hostname}, p.{provider.name} AS provider,
       n.{node.region}, n.{node.nvlink}, n.{node.simulated}, n.{node.reliability},
       n.{node.internet_capable} AS internet, n.{node.price_per_gpu_hour},
       n.{node.min_bid_per_gpu_hour}, n.{node.cpu_cores},
       n.{node.ram_gb}, n.{node.disk_gb}, n.{node.cuda_version}, n.{node.gpu_count},
       m.{gpu_model.slug} AS gpu_model, m.{gpu_model.name} AS gpu_name,
       m.{gpu_model.memory_gb}, m.{gpu_model.tensor_tflops},
       n.{node.gpu_count} - COALESCE(busy.held, 0) - unhealthy.failed AS free_gpus,
       unhealthy.degraded AS degraded_gpus, n.{node.benchmark_below_band},
       round(n.{node.price_per_gpu_hour} / m.{gpu_model.tensor_tflops}, 6)
           AS price_per_tflop_hour,
       measured.tflops AS measured_tflops,
       round(n.{node.price_per_gpu_hour} / measured.tflops::numeric, 6)
           AS price_per_measured_tflop_hour,
       n.{node.cluster} AS cluster_id, c.{cluster.name} AS cluster,
       c.{cluster.interconnect} AS interconnect,
       c.{cluster.bandwidth_gbps} AS interconnect_gbps, sizes.nodes AS cluster_nodes{extra}
FROM {node} n
JOIN {gpu_model} m ON m.{gpu_model.id} = n.{node.gpu_model}
-- A measured rate outside the plausible band is not shown nor divided by (1e-20 TFLOPS would
-- price a TFLOP beyond any number the API can write).
CROSS JOIN LATERAL (
    SELECT CASE WHEN n.{node.measured_tflops}
        BETWEEN m.{gpu_model.tensor_tflops} * {min_share}
        AND GREATEST(m.{gpu_model.tensor_tflops},
                     COALESCE(m.{gpu_model.tensor_tflops_fp16_acc}, 0)) * {max_share}
        THEN n.{node.measured_tflops} END AS tflops
) measured
JOIN {provider} p ON p.{provider.id} = n.{node.provider}
-- A FAILED GPU is not offered; a DEGRADED one is, and counted for the customer to see.
CROSS JOIN LATERAL (
    SELECT count(*) FILTER (WHERE g.{gpu.health} = '{failed}') AS failed,
           count(*) FILTER (WHERE g.{gpu.health} = '{degraded}') AS degraded
    FROM {gpu} g WHERE g.{gpu.node} = n.{node.id}
) unhealthy
LEFT JOIN (
    SELECT x.{allocation.node} AS node_id, count(*) AS held FROM {allocation} x
    WHERE x.{allocation.released_at} IS NULL AND x.{allocation.during} @> now()
    GROUP BY x.{allocation.node}
) busy ON busy.node_id = n.{node.id}
-- The fabric a multi-node rental on this node would use, and how many online nodes share it.
LEFT JOIN {cluster} c ON c.{cluster.id} = n.{node.cluster}
LEFT JOIN (
    SELECT y.{node.cluster} AS cluster_id, count(*) AS nodes FROM {node} y
    WHERE y.{node.cluster} IS NOT NULL AND y.{node.status} = '{online}'
    GROUP BY y.{node.cluster}
) sizes ON sizes.cluster_id = n.{node.cluster}
WHERE n.{node.status} = '{online}'
  AND n.{node.gpu_count} - COALESCE(busy.held, 0) - unhealthy.failed >= %s{where}
"""
# A node whose benchmark drifted below its card's band is ranked after the others, and one with
# degraded GPUs after the healthy ones.
_OFFER_RANK = "n.{node.benchmark_below_band}, unhealthy.degraded > 0, {order}"
_OFFERS = _OFFER_ROWS.replace("{extra}", "") + f"ORDER BY {_OFFER_RANK}\nLIMIT %s OFFSET %s\n"
# Each card's first rows by price, in one statement: the advisor's question. The busy and
# cluster-size aggregates cost the same for one card as for all, so one card a statement cost
# sixteen of them every few seconds at 10,000 nodes (bench/marketplace.py, docs/benchmarks.md).
# The node's pool and uplink come along: what the advisor reads of the node besides the offer.
_OFFERS_BY_CARD = (
    "SELECT * FROM ({rows}) ranked WHERE card_rank <= %s ORDER BY gpu_model, card_rank\n".replace(
        "{rows}", _OFFER_ROWS
    )
    .replace(
        "{extra}",
        ",\n       n.{node.pool}, n.{node.net_up_mbps}, n.{node.net_down_mbps},"
        " row_number() OVER (PARTITION BY m.{gpu_model.slug} ORDER BY {rank}) AS card_rank",
    )
    # A window's ORDER BY cannot name the list's output columns: each card by price.
    .replace("{rank}", _OFFER_RANK.replace("{order}", OFFER_ORDERINGS["price"]))
)

# filter -> its condition (each value a parameter).
_OFFER_CONDITIONS = {
    "gpu_models": "m.{gpu_model.slug} = ANY(%s)",
    "gpu_families": "m.{gpu_model.family} = ANY(%s)",
    "min_memory_gb": "m.{gpu_model.memory_gb} >= %s",
    "min_tensor_tflops": "m.{gpu_model.tensor_tflops} >= %s",
    "nvlink": "n.{node.nvlink} = %s",
    "region": "(n.{node.region} = %s OR n.{node.region} LIKE %s)",
    "max_price": "n.{node.price_per_gpu_hour} <= %s",
    "min_reliability": "n.{node.reliability} >= %s",
    "fits": (
        "EXISTS (SELECT 1 FROM unnest(%s::text[], %s::int[], %s::int[]) AS f(slug, pcie, nvl)"
        " WHERE f.slug = m.{gpu_model.slug}"
        " AND n.{node.gpu_count} - COALESCE(busy.held, 0) - unhealthy.failed"
        " >= CASE WHEN n.{node.nvlink} THEN f.nvl ELSE f.pcie END)"
    ),
}


@cache
def _offers_sql(
    conditions: tuple[str, ...], ordering: str, shares: tuple[float, float], by_card: bool = False
) -> str:
    template = (_OFFERS_BY_CARD if by_card else _OFFERS).replace(
        "{where}", "".join(f" AND {_OFFER_CONDITIONS[name]}" for name in conditions)
    )
    template = template.replace("{order}", OFFER_ORDERINGS[ordering])
    template = template.replace("{min_share}", repr(shares[0]))
    template = template.replace("{max_share}", repr(shares[1]))
    template = template.replace("{online}", NodeStatus.ONLINE.value)
    template = template.replace("{failed}", GpuHealth.FAILED.value)
    template = template.replace("{degraded}", GpuHealth.DEGRADED.value)
    return sql_named(template, **_TABLES)


def like_escaped(text: str) -> str:
    return text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")


def offers_statement(
    *, filters: OfferFilters, limit: int, offset: int, shares: tuple[float, float]
) -> tuple[str, list]:
    """The offers statement and its parameters: nodes with free GPUs now, filtered and sorted,
    measured TFLOPS shown within `shares` (least, most) of the card's rating."""
    conditions, params = _offer_conditions(filters)
    params.extend([limit, offset])
    return _offers_sql(conditions, filters.ordering, shares), params


def offers_by_card_statement(
    *, filters: OfferFilters, per_card: int, shares: tuple[float, float]
) -> tuple[str, list]:
    """offers_statement's rows (filters' ordering aside), each card's `per_card` cheapest, ordered
    by card then price, with each node's pool, net_up_mbps and net_down_mbps."""
    conditions, params = _offer_conditions(filters)
    params.append(per_card)
    return _offers_sql(conditions, "price", shares, by_card=True), params


def _offer_conditions(filters: OfferFilters) -> tuple[tuple[str, ...], list]:
    f = filters
    conditions: list[str] = []
    params: list = [f.min_free_gpus or 1]
    for name, values in (
        ("gpu_models", [list(f.gpu_models)] if f.gpu_models else None),
        ("gpu_families", [list(f.gpu_families)] if f.gpu_families else None),
        ("min_memory_gb", None if f.min_memory_gb is None else [f.min_memory_gb]),
        ("min_tensor_tflops", None if f.min_tensor_tflops is None else [f.min_tensor_tflops]),
        ("nvlink", None if f.nvlink is None else [f.nvlink]),
        ("region", [f.region, f"{like_escaped(f.region)}-%"] if f.region else None),
        ("max_price", None if f.max_price is None else [f.max_price]),
        ("min_reliability", None if f.min_reliability is None else [f.min_reliability]),
        ("fits", None if f.fits is None else [[row[i] for row in f.fits] for i in range(3)]),
    ):
        if values is not None:
            conditions.append(name)
            params.extend(values)
    return tuple(conditions), params


def offers(
    *, filters: OfferFilters, limit: int, offset: int, shares: tuple[float, float]
) -> list[dict]:
    """offers_statement, run: one dict per node, keyed by the statement's column names."""
    sql, params = offers_statement(filters=filters, limit=limit, offset=offset, shares=shares)
    return offers_run(sql, params)


def offers_run(sql: str, params: list) -> list[dict]:
    """Run an offers statement from offers_statement: one dict per node."""
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        columns = [c.name for c in cursor.description]
        return [dict(zip(columns, row, strict=True)) for row in cursor.fetchall()]


# --- The create path --------------------------------------------------------------------------
# (The token and membership read of each request is accounts.queries.)

# The refusal check of every create: the cheapest listed nodes that could take a request, with
# their GPUs, in one statement (compiling it through the ORM cost more than running it: a
# create's server CPU, bench/scheduler.py --parts api, docs/benchmarks.md).
NODE_COLUMNS = (
    "id",
    "region",
    "pool",
    "price_per_gpu_hour",
    "min_bid_per_gpu_hour",
    "reliability",
    "nvlink",
    "ssh_capable",
    "internet_capable",
    "image_allow",
    "cluster",
)
MODEL_COLUMNS = ("slug", "family", "memory_gb", "tensor_tflops")


# Each optional filter's clause, in the statement only when the request sets it: one statement
# per combination in use (a handful), each prepared with a plan for what it filters. Written as
# `(%(price)s IS NULL OR ...)` in one statement, PostgreSQL's generic plan (which it may keep
# after five executions of a prepared statement) guessed one matching node, joined every node
# of the pool and sorted them: 3-4 ms a create at 1,000 nodes where it kept it (30 ms at 10,000
# forced; where it kept custom plans, 0.6 ms of planning a create), against 0.3 ms for the
# pool's price index read up to the limit (docs/benchmarks.md, 2026-12-07 night).
_CHEAPEST_FILTERS = {
    "region": "(n.{node.region} = %(region)s OR n.{node.region} LIKE %(zones)s)",
    "models": "m.{gpu_model.slug} = ANY(%(models)s::text[])",
    "families": "m.{gpu_model.family} = ANY(%(families)s::text[])",
    "memory": "m.{gpu_model.memory_gb} >= %(memory)s",
    "tflops": "m.{gpu_model.tensor_tflops} >= %(tflops)s",
    "bid": "n.{node.min_bid_per_gpu_hour} <= %(bid)s",
    "price": "n.{node.price_per_gpu_hour} <= %(price)s",
    "ssh": "n.{node.ssh_capable}",
    "internet": "n.{node.internet_capable}",
    "clustered": "c.{cluster.bandwidth_gbps} >= %(gbps)s",
}
# The parameters each optional clause reads, besides its own.
_CHEAPEST_ALSO = {"region": ("zones",), "clustered": ("gbps",)}


@cache
def _cheapest_nodes_sql(filters: frozenset[str]) -> str:
    quote = connection.ops.quote_name
    node = ", ".join(f"n.{quote(Node._meta.get_field(f).column)}" for f in NODE_COLUMNS)
    model = ", ".join(f"m.{quote(GpuModel._meta.get_field(f).column)}" for f in MODEL_COLUMNS)
    arrays = ", ".join(
        f"ARRAY(SELECT g.{{gpu.{name}}} FROM {{gpu}} g"  # noqa: S608 - the models' own names
        " WHERE g.{gpu.node} = n.{node.id} ORDER BY g.{gpu.index})"
        for name in ("id", "index", "topology_group")
    )
    optional = "".join(f" AND {_CHEAPEST_FILTERS[name]}" for name in sorted(filters))
    return sql_named(
        f"SELECT {node}, c.{{cluster.bandwidth_gbps}}, {model}, {arrays}"  # noqa: S608
        " FROM {node} n JOIN {gpu_model} m ON m.{gpu_model.id} = n.{node.gpu_model}"
        " LEFT JOIN {cluster} c ON c.{cluster.id} = n.{node.cluster}"
        " WHERE n.{node.pool} = %(pool)s AND n.{node.gpu_count} >= %(gpus)s"
        f"{optional}"
        " ORDER BY n.{node.price_per_gpu_hour}, n.{node.id} LIMIT %(limit)s",
        **_TABLES,
    )


def nodes_cheapest_statement(*, params: dict) -> tuple[str, dict]:
    """The statement of nodes_cheapest for `params`, and the parameters it reads."""
    filters = filters_set(params, _CHEAPEST_FILTERS, nullable=("bid", "price"))
    used = {"pool", "gpus", "limit"}.union(
        filters, *(_CHEAPEST_ALSO.get(name, ()) for name in filters)
    )
    return _cheapest_nodes_sql(filters), {name: params[name] for name in used}


def nodes_cheapest(*, params: dict) -> list[tuple]:
    """The `limit` cheapest nodes of the pool that meet `params` (region or its zones, models,
    families, memory, tflops, GPUs, bid, price, ssh, internet, clustered with at least gbps),
    whatever their state: the NODE_COLUMNS, their cluster's bandwidth (None: no cluster), the
    MODEL_COLUMNS of their card, then their GPUs' ids, indexes and groups as arrays."""
    return _all(*nodes_cheapest_statement(params=params))


# --- Metrics ----------------------------------------------------------------------------------
# The schedule-latency histogram of /metrics: the buckets counted in one statement over the
# recent events only, on every scrape.


_SCHEDULE_LATENCY = """
WITH first AS (
    SELECT extract(epoch FROM min(e.{event.created_at}) - r.{rental.created_at}) AS lat
    FROM {event} e JOIN {rental} r ON r.{rental.id} = e.{event.rental}
    WHERE e.{event.id} > (SELECT coalesce(max(x.{event.id}), 0) FROM {event} x) - %s
      AND e.{event.to_status} = %s AND e.{event.created_at} >= %s
    GROUP BY r.{rental.id}, r.{rental.created_at}
)
SELECT {counts}, count(*), coalesce(sum(lat), 0) FROM first
"""


@cache
def _schedule_latency_sql(buckets: tuple[float, ...]) -> str:
    counts = ", ".join(f"count(*) FILTER (WHERE lat <= {float(b)})" for b in buckets)
    return sql_named(_SCHEDULE_LATENCY.replace("{counts}", counts), **_TABLES)


def schedule_latencies(
    *, buckets: Sequence[float], last_events: int, status: str, since: datetime
) -> tuple[list[int], int, float]:
    """Create to first move into `status` (since `since`, among the `last_events` latest
    events) of each rental: (how many took at most each bucket's seconds, how many, their
    sum in seconds)."""
    ((*cumulative, total, total_sum),) = _all(
        _schedule_latency_sql(tuple(buckets)), [last_events, status, since]
    )
    return list(cumulative), total, float(total_sum)
