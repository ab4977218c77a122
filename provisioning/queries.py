"""Provisioning's hand-written SQL: the statements of every heartbeat, here and nowhere else in
the app.

bench/agents.py measures the server CPU per heartbeat and the statements per idle heartbeat
(docs/benchmarks.md): compiling these lookups through the ORM cost more server time than
running them. Names come from the models' `_meta`
(core.rows.sql_named), each statement built once per process; tests/provisioning/
test_queries.py asks each one's question again through the ORM.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import cache

from django.db import connection

from accounts.models import SshKey, TeamSecret
from core.rows import model_from_row, sql_compact, sql_named
from marketplace.models import Allocation, Gpu, Node, Rental
from provisioning.models import ContainerRun, NodeCredential, RunLogLine, RunMetric

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
    "run": ContainerRun,
    "metric": RunMetric,
    "logline": RunLogLine,
    "sshkey": SshKey,
    "secret": TeamSecret,
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
  UPDATE {node} n SET {node.last_seen_at} = %s, {node.heartbeat_interval_s} = %s FROM node
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
    interval_s: int,
    offline: str,
    statuses: Sequence[str],
    health: tuple[str, str, str],
) -> tuple[int, bool, bool | None, bool, bool, list[int]] | None:
    """An idle heartbeat of the node whose unrevoked token has `key_hash`: marks it seen at
    `now`, asked to heartbeat next within `interval_s` (0: the base interval), unless its
    status is `offline`. (node id, marked seen, benchmark requested, holds
    GPUs for a rental in `statuses`, has a GPU whose health is `degraded`, the indices of its
    GPUs whose health is `failed`), `health` being (ok, degraded, failed); None for an unknown
    or revoked token."""
    ok, degraded, failed = health
    with connection.cursor() as cursor:
        cursor.execute(
            _idle_sql(),
            [key_hash, now, interval_s, offline, now, list(statuses), degraded, failed, ok],
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


# What the desired state of a held rental is made of, besides the rental's row, as one text
# that changes whenever any of it changes: the row's version (xmin: any UPDATE of the row), its
# team's SSH keys when it asked for SSH, the team secrets it names, and a gang's members (the
# nodes it holds GPUs on). `{node_id}` names the node: whether the run of the rental on it is
# recorded (`has_run`).
_VERSIONS = """
SELECT r.{rental.id},
  r.xmin::text
  || CASE WHEN r.{rental.ssh} THEN '|k' || coalesce((
       SELECT string_agg(k.{sshkey.id}::text || '.' || k.xmin::text, ',' ORDER BY k.{sshkey.id})
       FROM {sshkey} k WHERE k.{sshkey.team} = r.{rental.team}), '') ELSE '' END
  || CASE WHEN r.{rental.secrets} <> '[]'::jsonb OR r.{rental.registry_secret} <> '' THEN '|s'
     || coalesce((
       SELECT string_agg(s.{secret.id}::text || '.' || s.xmin::text, ',' ORDER BY s.{secret.id})
       FROM {secret} s WHERE s.{secret.team} = r.{rental.team}
         AND (s.{secret.name} = r.{rental.registry_secret} OR s.{secret.name} IN (
           SELECT e.value->>'name' FROM jsonb_array_elements(r.{rental.secrets}) e))), '')
     ELSE '' END
  || CASE WHEN r.{rental.node_count} > 1 THEN '|g' || coalesce((
       SELECT string_agg(DISTINCT m.{allocation.node}::text, ',')
       FROM {allocation} m
       WHERE m.{allocation.rental} = r.{rental.id} AND m.{allocation.released_at} IS NULL), '')
     ELSE '' END,
  EXISTS (SELECT 1 FROM {run} c
          WHERE c.{run.rental} = r.{rental.id} AND c.{run.node} = {node_id})
FROM {rental} r WHERE r.{rental.id} IN (SELECT h.rental FROM held h)
"""

_HELD_CTE = (
    "held AS (SELECT a.{allocation.rental} AS rental, g.{gpu.index} AS index, g.{gpu.uuid} AS uuid"
    + _HELD_FROM_WHERE.replace("%s::timestamptz", "%(now)s::timestamptz").replace(
        "ANY(%s)", "ANY(%(statuses)s)"
    )
    + ")"
)
_HELD_COLUMNS = """
  (SELECT json_agg(json_build_array(h.rental, h.index, h.uuid) ORDER BY h.rental, h.index)
   FROM held h),
  (SELECT json_agg(json_build_array(v.id, v.version, v.has_run)) FROM versions v)
"""
_VERSIONS_CTE = "versions (id, version, has_run) AS (" + _VERSIONS + ")"


@cache
def _held_versions_sql() -> str:
    return sql_named(
        "WITH " + _HELD_CTE.replace("{node_id}", "%(node)s") + ", "
        + _VERSIONS_CTE.replace("{node_id}", "%(node)s")
        + " SELECT" + _HELD_COLUMNS,
        **_TABLES,
    )  # fmt: skip


def _held_and_versions(held: list | None, versions: list | None) -> tuple[list, dict, bool]:
    return (
        [(uuid.UUID(rental), index, gpu_uuid) for rental, index, gpu_uuid in held or ()],
        {uuid.UUID(rental): version for rental, version, _ in versions or ()},
        all(has_run for _, _, has_run in versions or ()),
    )


def gpus_held_versions(
    *, node_id: int, now: datetime, statuses: Sequence[str]
) -> tuple[list[tuple], dict, bool]:
    """gpus_held, with each held rental's version (what its desired state is made of, as one
    text that changes when any of it does) and whether every held rental's run on the node is
    recorded."""
    with connection.cursor() as cursor:
        cursor.execute(
            _held_versions_sql(), {"node": node_id, "now": now, "statuses": list(statuses)}
        )
        return _held_and_versions(*cursor.fetchone())


# A busy heartbeat's reads in one statement, the node known: the node is marked seen (with the
# interval it is asked for) unless it is OFFLINE (the caller brings it back first), then what
# its GPUs' health is (as in _IDLE),
# the reported runs of the node (`runs`: run id, rental id, whether its row and rental say it
# runs steadily, its published ports, the rental's ports, SSH and JupyterLab, whether the rental
# names secrets) and the GPUs it holds with their rentals' versions (gpus_held_versions).
_BUSY = """
WITH seen AS (
  UPDATE {node} n SET {node.last_seen_at} = %(now)s, {node.heartbeat_interval_s} = %(interval)s
  WHERE n.{node.id} = %(node)s AND n.{node.status} <> %(offline)s
  RETURNING 1
), {held}, {versions}
SELECT
  (SELECT count(*) FROM seen),
  coalesce(unhealthy.degraded, false), coalesce(unhealthy.failed, '{{}}'),
  (SELECT json_agg(json_build_array(
     c.{run.run_id}, c.{run.rental},
     c.{run.status} = %(running)s AND c.{run.exit_code} IS NULL
       AND c.{run.started_at} IS NOT NULL AND c.{run.finished_at} IS NULL
       AND r.{rental.status} = %(running)s,
     c.{run.published}, r.{rental.ports}, r.{rental.ssh}, r.{rental.jupyter},
     r.{rental.secrets} <> '[]'::jsonb OR r.{rental.registry_secret} <> ''))
   FROM {run} c JOIN {rental} r ON r.{rental.id} = c.{run.rental}
   WHERE c.{run.node} = %(node)s AND c.{run.run_id} = ANY(%(runs)s::text[])),
  {held_columns}
FROM (
  SELECT bool_or(u.{gpu.health} = %(degraded)s) AS degraded,
         array_agg(u.{gpu.index} ORDER BY u.{gpu.index})
             FILTER (WHERE u.{gpu.health} = %(failed)s) AS failed
  FROM {gpu} u WHERE u.{gpu.node} = %(node)s AND u.{gpu.health} <> %(ok)s
) unhealthy
"""


@cache
def _busy_sql() -> str:
    sql = (
        _BUSY.replace("{held}", _HELD_CTE)
        .replace("{versions}", _VERSIONS_CTE)
        .replace("{held_columns}", _HELD_COLUMNS)
        .replace("{node_id}", "%(node)s")
    )
    return sql_named(sql, **_TABLES)


@dataclass(frozen=True, slots=True)
class BusyState:
    """What busy_heartbeat read (see _BUSY)."""

    seen: bool  # marked seen: False for an OFFLINE node
    degraded: bool
    failed: list[int]
    runs: list[list]  # [run id, rental id, steady, published, ports, ssh, jupyter, secrets]
    held: list[tuple]  # as gpus_held
    versions: dict  # rental id -> version
    runs_recorded: bool


@dataclass(frozen=True, slots=True)
class BusyRead:
    """What a busy heartbeat reads besides its node: marked seen at `now`, asked to heartbeat
    next within `interval_s` (0: the base interval), unless its status is `offline`; its GPUs'
    health (`health`: ok, degraded, failed); its runs among `run_ids` (`running`: the run's and
    the rental's status of a steady run); the GPUs it holds for a rental in `statuses`, with
    their versions."""

    now: datetime
    interval_s: int
    offline: str
    running: str
    run_ids: Sequence[str]
    statuses: Sequence[str]
    health: tuple[str, str, str]

    def params(self) -> dict:
        ok, degraded, failed = self.health
        return {
            "now": self.now, "interval": self.interval_s, "offline": self.offline,
            "running": self.running,
            "runs": list(self.run_ids), "statuses": list(self.statuses),
            "ok": ok, "degraded": degraded, "failed": failed,
        }  # fmt: skip


def _busy_state(row: Sequence) -> BusyState:
    seen, is_degraded, failed_indices, runs, held, versions = row
    return BusyState(
        bool(seen), is_degraded, failed_indices, runs or [], *_held_and_versions(held, versions)
    )


def busy_heartbeat(*, node_id: int, read: BusyRead) -> BusyState:
    """A heartbeat with reports of the node `node_id`: marks it seen and reads (BusyRead)."""
    with connection.cursor() as cursor:
        cursor.execute(_busy_sql(), {**read.params(), "node": node_id})
        return _busy_state(cursor.fetchone())


# busy_heartbeat of the node whose token is given, its token checked and its row read in the
# same statement: one round trip less per busy heartbeat (bench/agents.py, busy phase).
_TOKEN_NODE = """
WITH token_node AS (
  SELECT c.{credential.node} AS id FROM {credential} c
  WHERE c.{credential.key_hash} = %(key)s AND c.{credential.revoked_at} IS NULL LIMIT 1
), """


@cache
def _busy_by_token_sql() -> tuple[str, tuple]:
    fields = tuple(Node._meta.concrete_fields)
    quote = connection.ops.quote_name
    node_id = "(SELECT t.id FROM token_node t)"
    busy = _busy_sql().removeprefix("\nWITH ").replace("%(node)s", node_id)
    # The node's columns first, NULL for an unknown or revoked token; nothing is written then,
    # since every part of the statement names the node through token_node.
    columns = ", ".join(f"node_row.{quote(f.column)}" for f in fields)
    busy = busy.replace("\nSELECT\n", f"\nSELECT {columns},\n", 1)
    busy = busy.replace(
        ") unhealthy\n",
        f") unhealthy LEFT JOIN {quote(Node._meta.db_table)} node_row"
        f" ON node_row.{quote(Node._meta.pk.column)} = {node_id}\n",
        1,
    )
    return sql_compact(sql_named(_TOKEN_NODE, **_TABLES) + busy), fields


def busy_heartbeat_by_token(*, key_hash: str, read: BusyRead) -> tuple[Node, BusyState] | None:
    """busy_heartbeat of the node of the unrevoked token with `key_hash` (node_by_token), with
    the node as that returns it; None, and nothing changed, for an unknown or revoked token."""
    sql, fields = _busy_by_token_sql()
    with connection.cursor() as cursor:
        cursor.execute(sql, {**read.params(), "key": key_hash})
        row = cursor.fetchone()
    if row[fields.index(Node._meta.pk)] is None:
        return None
    return model_from_row(Node, fields, row[: len(fields)]), _busy_state(row[len(fields) :])


# A heartbeat's writes in one statement: its steady runs marked reported, its metric lines and
# its log lines stored (a line stored before is kept once). Each part may be empty. The rows come
# as one JSON array each: psycopg writes a Python list as an array literal element by element
# (a quoting check per element), which cost a busy heartbeat more server time than the rows'
# JSON text (bench/agents.py, busy phase).
_WRITES = """
WITH steady AS (
  UPDATE {run} c SET {run.last_report_at} = %(now)s
  WHERE c.{run.node} = %(node)s AND c.{run.run_id} = ANY(%(steady)s::text[])
  RETURNING 1
), metrics AS (
  INSERT INTO {metric} ({metric.rental}, {metric.run_id}, {metric.line_hash}, {metric.event},
                        {metric.step}, {metric.data}, {metric.received_at})
  SELECT (m->>0)::uuid, m->>1, m->>2, m->>3, (m->>4)::int, (m->>5)::jsonb, %(now)s
  FROM json_array_elements(%(metrics)s::json) m
  ON CONFLICT DO NOTHING
  RETURNING 1
), logs AS (
  INSERT INTO {logline} ({logline.rental}, {logline.run_id}, {logline.line_no}, {logline.line},
                         {logline.received_at})
  SELECT (l->>0)::uuid, l->>1, (l->>2)::bigint, l->>3, %(now)s
  FROM json_array_elements(%(logs)s::json) l
  ON CONFLICT DO NOTHING
  RETURNING 1
)
SELECT (SELECT count(*) FROM steady), (SELECT count(*) FROM metrics), (SELECT count(*) FROM logs)
"""


@cache
def _writes_sql() -> str:
    return sql_named(_WRITES, **_TABLES)


_STARTED = """
UPDATE {run} c
SET {run.status} = %(status)s, {run.exit_code} = NULL,
    {run.started_at} = coalesce(c.{run.started_at}, v.started_at),
    {run.published} = v.published::jsonb, {run.last_report_at} = %(now)s
FROM unnest(%(ids)s::bigint[], %(started)s::timestamptz[], %(published)s::text[])
  AS v(id, started_at, published)
WHERE c.{run.id} = v.id
"""


@cache
def _started_sql() -> str:
    return sql_named(_STARTED, **_TABLES)


def runs_mark_started(
    *, status: str, now: datetime, runs: Sequence[tuple[int, datetime | None, list]]
) -> None:
    """Each run (id, the agent's start time, its published ports as stored) reported `status`
    at `now`, in one statement: a start time already kept is kept."""
    params = {
        "status": status, "now": now, "ids": [run[0] for run in runs],
        "started": [run[1] for run in runs], "published": [json.dumps(run[2]) for run in runs],
    }  # fmt: skip
    with connection.cursor() as cursor:
        cursor.execute(_started_sql(), params)


class Rows:
    """The rows of one INSERT of _WRITES: metric rows (rental, run, line hash, event, step,
    JSON text) or log rows (rental, run, line number, line)."""

    __slots__ = ("rows", "width")

    def __init__(self, width: int) -> None:
        self.width = width
        self.rows: list[tuple] = []

    @classmethod
    def metrics(cls) -> Rows:
        return cls(6)

    @classmethod
    def logs(cls) -> Rows:
        return cls(4)

    def add(self, *values) -> None:
        if len(values) != self.width:
            raise ValueError(f"a row of {self.width} values, got {len(values)}")
        self.rows.append(values)

    def json(self) -> str:
        """The rows as a JSON array of arrays (a rental id as its text)."""
        return json.dumps(self.rows, default=str)


def heartbeat_writes(
    *, node_id: int, now: datetime, steady: Sequence[str], metrics: Rows, logs: Rows
) -> tuple[int, int, int]:
    """Mark the runs `steady` of the node reported at `now`, and insert the metric and log
    rows (Rows), received at `now`; those already stored are left as they are. Returns how
    many runs were marked and rows inserted."""
    params = {
        "node": node_id, "now": now, "steady": list(steady),
        "metrics": metrics.json(), "logs": logs.json(),
    }  # fmt: skip
    with connection.cursor() as cursor:
        cursor.execute(_writes_sql(), params)
        return cursor.fetchone()
