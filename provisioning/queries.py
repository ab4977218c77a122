"""Provisioning's hand-written SQL: the statements of every heartbeat, here and nowhere else in
the app.

bench/agents.py measures the server CPU per heartbeat and the statements per idle heartbeat
(docs/benchmarks.md): compiling these lookups through the ORM cost more server time than
running them. Names come from the models' `_meta`
(core.rows.sql_named), each statement built once per process; tests/provisioning/
test_queries.py asks each one's question again through the ORM.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from functools import cache

from django.db import connection

from core.rows import model_from_row, sql_named
from marketplace.models import Allocation, Gpu, Node, Rental
from provisioning.models import NodeCredential

# The GPUs a node holds now, for rentals whose container should run; {node_id} names the node.
_HELD_FROM_WHERE = """
FROM {allocation} a
JOIN {gpu} g ON g.{gpu.id} = a.{allocation.gpu}
JOIN {rental} r ON r.{rental.id} = a.{allocation.rental}
WHERE a.{allocation.node} = {node_id} AND a.{allocation.released_at} IS NULL
  AND a.{allocation.during} @> %s::timestamptz AND r.{rental.status} = ANY(%s)
"""
_TABLES = {
    "allocation": Allocation,
    "gpu": Gpu,
    "rental": Rental,
    "node": Node,
    "credential": NodeCredential,
}


@cache
def _held_sql() -> str:
    return sql_named(
        "SELECT a.{allocation.rental}, g.{gpu.index}, g.{gpu.uuid}"
        + _HELD_FROM_WHERE.replace("{node_id}", "%s")
        + " ORDER BY a.{allocation.rental}, g.{gpu.index}",
        **_TABLES,
    )


def gpus_held(*, node_id: int, now: datetime, statuses: Sequence[str]) -> list[tuple]:
    """(rental id, GPU index, GPU uuid) of each GPU the node holds at `now` for a rental in
    `statuses`, by rental and index."""
    with connection.cursor() as cursor:
        cursor.execute(_held_sql(), [node_id, now, list(statuses)])
        return cursor.fetchall()


# An idle heartbeat in one statement, from the token alone: the token names the node (no row:
# it is unknown or revoked), the node is marked seen unless it is coming back from OFFLINE (the
# full path brings it back under its row lock: `seen` is NULL), `holds` says whether it
# holds GPUs for a container that should run (the full path hands it over), `degraded`
# whether a GPU of it is DEGRADED (the full path sees whether its signals cleared) and `failed`
# the indices of its FAILED GPUs (where a check it is asked for runs).
_IDLE = """
WITH node AS (
  SELECT c.{credential.node} AS id FROM {credential} c
  WHERE c.{credential.key_hash} = %s AND c.{credential.revoked_at} IS NULL
  LIMIT 1
), seen AS (
  UPDATE {node} n SET {node.last_seen_at} = %s FROM node
  WHERE n.{node.id} = node.id AND n.{node.status} <> %s
  RETURNING n.{node.id}, n.{node.benchmark_requested}
)
SELECT node.id, seen.id IS NOT NULL, seen.benchmark_requested,
       EXISTS (SELECT 1 {held}) AS holds,
       coalesce(unhealthy.degraded, false), coalesce(unhealthy.failed, '{{}}')
FROM node LEFT JOIN seen ON true
LEFT JOIN LATERAL (
  SELECT bool_or(u.{gpu.health} = %s) AS degraded,
         array_agg(u.{gpu.index} ORDER BY u.{gpu.index})
             FILTER (WHERE u.{gpu.health} = %s) AS failed
  FROM {gpu} u WHERE u.{gpu.node} = node.id AND u.{gpu.health} <> %s
) unhealthy ON true
"""


@cache
def _idle_sql() -> str:
    held = _HELD_FROM_WHERE.replace("{node_id}", "node.id")
    return sql_named(_IDLE.replace("{held}", held), **_TABLES)


def idle_heartbeat(
    *,
    key_hash: str,
    now: datetime,
    offline: str,
    statuses: Sequence[str],
    health: tuple[str, str, str],
) -> tuple[int, bool, bool | None, bool, bool, list[int]] | None:
    """An idle heartbeat of the node whose unrevoked token has `key_hash`: marks it seen at
    `now` unless its status is `offline`. (node id, marked seen, benchmark requested, holds
    GPUs for a rental in `statuses`, has a GPU whose health is `degraded`, the indices of its
    GPUs whose health is `failed`), `health` being (ok, degraded, failed); None for an unknown
    or revoked token."""
    ok, degraded, failed = health
    with connection.cursor() as cursor:
        cursor.execute(
            _idle_sql(), [key_hash, now, offline, now, list(statuses), degraded, failed, ok]
        )
        return cursor.fetchone()


@cache
def _node_by_token_sql() -> tuple[str, tuple]:
    fields = tuple(Node._meta.concrete_fields)
    quote = connection.ops.quote_name
    columns = ", ".join(f"n.{quote(f.column)}" for f in fields)
    sql = sql_named(
        f"SELECT {columns} FROM {{node}} n"  # noqa: S608 - the models' own names
        " JOIN {credential} c ON c.{credential.node} = n.{node.id}"
        " WHERE c.{credential.key_hash} = %s AND c.{credential.revoked_at} IS NULL LIMIT 1",
        **_TABLES,
    )
    return sql, fields


def node_by_token(*, key_hash: str) -> Node | None:
    """The node of the unrevoked token with `key_hash` (a raw queryset's column mapping cost
    more server time too: core.rows makes the instance)."""
    sql, fields = _node_by_token_sql()
    with connection.cursor() as cursor:
        cursor.execute(sql, [key_hash])
        row = cursor.fetchone()
    return None if row is None else model_from_row(Node, fields, row)
