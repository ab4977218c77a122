"""The binding of the pure engine to the database: snapshot in, decisions written.

One cycle per pool at a time, under a PostgreSQL advisory lock. Whatever the engine decides,
the exclusion constraint on allocations has the last word: a conflicting bind is rolled back and
the rental stays PENDING for the next cycle ("re-plan"), so a cycle is safe to kill at any point.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime

import psycopg
from django.core.cache import cache
from django.db import IntegrityError, OperationalError, connection, transaction
from django.utils import timezone

from marketplace import lifecycle
from marketplace.locks import advisory_lock
from marketplace.models import Node, NodeStatus, Rental, RentalKind, RentalStatus
from marketplace.selectors import engine_nodes
from scheduler.engine import planner
from scheduler.engine import types as engine

log = logging.getLogger(__name__)

BIND_CHUNK = 500
# A bind that loses to another writer: the exclusion constraint refuses the rows, or, when two
# binds insert conflicting rows at once, PostgreSQL aborts one of them as a deadlock. Django
# wraps what its cursor raises; COPY runs on psycopg's cursor and raises psycopg's own.
_DB_ERRORS = (IntegrityError, OperationalError, psycopg.Error)


def _lost_race(exc: Exception) -> bool:
    cause = exc if isinstance(exc, psycopg.Error) else exc.__cause__
    return isinstance(exc, IntegrityError) or isinstance(
        cause, psycopg.IntegrityError | psycopg.errors.DeadlockDetected
    )


def _ts(value: datetime) -> float:
    return value.timestamp()


def _dt(value: float) -> datetime:
    return datetime.fromtimestamp(value, tz=UTC)


def engine_request(row: dict) -> engine.Request:
    """A pending rental row (its times as epoch seconds) as the engine's request."""
    return engine.Request(
        rental_id=row["id"],
        created_at=row["created_at"],
        gpus_per_node=row["gpus_per_node"],
        node_count=row["node_count"],
        duration=float(row["duration_s"]),
        start=row["start_at"],
        start_deadline=row["start_deadline"],
        priority=row["priority"],
        gpu_models=frozenset(row["gpu_models"]) or None,
        gpu_families=frozenset(row["gpu_families"]) or None,
        min_memory_gb=row["min_memory_gb"],
        min_tensor_tflops=float(row["min_tensor_tflops"]),
        same_group=row["same_group"],
        region=row["region"] or None,
        pool=row["pool"],
        max_price=row["max_price_per_gpu_hour"],
        interruptible=row["kind"] == RentalKind.INTERRUPTIBLE,
        bid=row["bid_per_gpu_hour"],
    )


# The snapshot's hot reads in SQL: times come back as epoch seconds (float8), which the engine
# uses, instead of datetimes and ranges that cost more to parse than the rest of the snapshot.
_BUSY_SQL = """
SELECT a.gpu_id, a.rental_id,
       extract(epoch FROM lower(a.during))::float8, extract(epoch FROM upper(a.during))::float8,
       r.kind, r.price_per_gpu_hour, r.priority
FROM marketplace_allocation a JOIN marketplace_rental r ON r.id = a.rental_id
WHERE a.node_id = ANY(%(nodes)s) AND a.released_at IS NULL AND upper(a.during) > %(now)s
"""
_PENDING_SQL = """
SELECT id, extract(epoch FROM created_at)::float8 AS created_at, gpus_per_node, node_count,
       duration_s, extract(epoch FROM start_at)::float8 AS start_at,
       extract(epoch FROM start_deadline)::float8 AS start_deadline, priority, gpu_models,
       gpu_families, min_memory_gb, min_tensor_tflops, same_group, region, pool,
       max_price_per_gpu_hour, kind, bid_per_gpu_hour
FROM marketplace_rental
WHERE pool = %(pool)s AND status = %(pending)s
ORDER BY created_at
"""
# What the engine reads of a pool's online nodes and their GPUs, folded into one digest: while it
# is unchanged, the nodes mapped last time are still exact and are not read again.
_INVENTORY_DIGEST_SQL = """
SELECT count(*), md5(string_agg(concat_ws(
           ':', n.id, n.region, n.price_per_gpu_hour, n.min_bid_per_gpu_hour, n.reliability,
           n.nvlink, m.slug, m.family, m.memory_gb, m.tensor_tflops, g.gpus),
       ',' ORDER BY n.id))
FROM marketplace_node n
JOIN marketplace_gpumodel m ON m.id = n.gpu_model_id
CROSS JOIN LATERAL (
    SELECT string_agg(concat_ws('/', id, index, topology_group), ',' ORDER BY index) AS gpus
    FROM marketplace_gpu WHERE node_id = n.id
) g
WHERE n.pool = %(pool)s AND n.status = %(online)s
"""
# pool -> (digest, nodes); per process (each worker keeps its own).
_inventory: dict[str, tuple[tuple, tuple[engine.Node, ...]]] = {}


def _inventory_digest(pool: str) -> tuple:
    with connection.cursor() as cursor:
        cursor.execute(_INVENTORY_DIGEST_SQL, {"pool": pool, "online": NodeStatus.ONLINE})
        return tuple(cursor.fetchone())


def _pool_nodes(pool: str) -> tuple[engine.Node, ...]:
    digest = _inventory_digest(pool)
    cached = _inventory.get(pool)
    if cached is not None and cached[0] == digest:
        return cached[1]
    if connection.in_atomic_block:
        # Inside a caller's transaction the isolation is the caller's: read, use, keep nothing.
        _inventory.pop(pool, None)
        return _read_pool_nodes(pool)
    # The digest kept must describe exactly the rows kept: read both in one snapshot.
    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY")
        digest = _inventory_digest(pool)
        nodes = _read_pool_nodes(pool)
    _inventory[pool] = (digest, nodes)
    return nodes


def _read_pool_nodes(pool: str) -> tuple[engine.Node, ...]:
    return tuple(
        engine_nodes(Node.objects.filter(pool=pool, status=NodeStatus.ONLINE).order_by("id"))
    )


def snapshot_take(*, pool: str, now: datetime) -> engine.Snapshot:
    """Free capacity of the pool's online nodes, what holds it, and the pending queue."""
    nodes = _pool_nodes(pool)
    with connection.cursor() as cursor:
        cursor.execute(_BUSY_SQL, {"nodes": [n.node_id for n in nodes], "now": now})
        busy = [
            engine.Busy(
                gpu_id=gpu_id,
                rental_id=rental_id,
                start=start,
                end=end,
                interruptible=kind == RentalKind.INTERRUPTIBLE,
                price=price or 0,
                priority=priority,
            )
            for gpu_id, rental_id, start, end, kind, price, priority in cursor.fetchall()
        ]
        cursor.execute(_PENDING_SQL, {"pool": pool, "pending": RentalStatus.PENDING})
        columns = [c.name for c in cursor.description]
        pending = [engine_request(dict(zip(columns, row, strict=True))) for row in cursor]
    return engine.Snapshot(now=_ts(now), nodes=nodes, busy=tuple(busy), pending=tuple(pending))


@dataclass
class CycleResult:
    """What one cycle did, for logs, tests and the benchmark."""

    ran: bool = False
    rounds: int = 0
    placed: int = 0
    conflicts: int = 0
    preempted: int = 0
    expired: int = 0
    waiting: int = 0
    seconds: dict[str, float] = field(default_factory=dict)


def pool_lock(pool: str):
    """One cycle per pool cluster-wide."""
    return advisory_lock(f"scheduler:{pool}")


def _bind_chunk(placements: list[engine.Placement], now: datetime) -> list[engine.Placement]:
    """Bind a chunk in the caller's transaction; returns those whose rental was still PENDING.

    `now` is the cycle's planning instant; the events carry the time of the bind itself.
    """
    bound_at = timezone.now()
    bound_ids = lifecycle.rentals_mark_placed(
        placements=[
            lifecycle.PlacedRental(
                rental_id=str(p.rental_id),
                price_per_gpu_hour=p.price_per_gpu_hour,
                start=_dt(p.start),
                end=_dt(p.end),
                reason=f"placed on node(s) {', '.join(str(n) for n, _ in p.nodes)}"
                f" at ${p.price_per_gpu_hour}/GPU-hour",
            )
            for p in placements
        ],
        at=bound_at,
    )
    bound = [p for p in placements if str(p.rental_id) in bound_ids]
    if not bound:
        return []
    # COPY: the bind is the hot write of the scheduler, and the exclusion constraint checks
    # every row COPY writes exactly as it would an INSERT.
    with connection.cursor() as cursor:
        raw = cursor.cursor
        with raw.copy(
            "COPY marketplace_allocation (rental_id, gpu_id, node_id, during, created_at)"
            " FROM STDIN"
        ) as copy:
            for p in bound:
                during = f"[{_dt(p.start).isoformat()},{_dt(p.end).isoformat()})"
                for node_id, gpu_ids in p.nodes:
                    for gpu_id in gpu_ids:
                        copy.write_row((str(p.rental_id), gpu_id, node_id, during, bound_at))
    return bound


def allocation_bind(
    *, placements: list[engine.Placement], now: datetime
) -> tuple[list[engine.Placement], list[engine.Placement]]:
    """Write placements as allocation rows, a chunk per transaction; returns (bound, conflicts).

    A chunk that hits the exclusion constraint is retried placement by placement, each in its
    own savepoint, so one conflict (another writer got there first) costs only that rental a
    cycle of waiting.
    """
    bound: list[engine.Placement] = []
    conflicts: list[engine.Placement] = []
    for i in range(0, len(placements), BIND_CHUNK):
        chunk = placements[i : i + BIND_CHUNK]
        try:
            with transaction.atomic():
                bound.extend(_bind_chunk(chunk, now))
        except _DB_ERRORS as exc:
            if not _lost_race(exc):
                raise
            for p in chunk:
                try:
                    with transaction.atomic():
                        bound.extend(_bind_chunk([p], now))
                except _DB_ERRORS as exc:
                    if not _lost_race(exc):
                        raise
                    conflicts.append(p)
    if conflicts:
        log.info("bind conflicts, re-planned next cycle: %d", len(conflicts))
    return bound, conflicts


def _apply_preemptions(preemptions: tuple[engine.Preemption, ...], now: datetime) -> int:
    done = 0
    for pre in preemptions:
        with transaction.atomic():
            rental = Rental.objects.select_for_update().filter(pk=pre.victim_rental_id).first()
            if rental is not None and lifecycle.rental_preempt(
                rental=rental, reason=pre.reason, at=now
            ):
                done += 1
    return done


def _apply_expiry(expired: tuple[engine.Expired, ...], now: datetime) -> int:
    done = 0
    for exp in expired:
        with transaction.atomic():
            rental = (
                Rental.objects.select_for_update()
                .filter(pk=exp.rental_id, status=RentalStatus.PENDING)
                .first()
            )
            if rental is None:
                continue
            lifecycle.rental_expire(rental=rental, reason=exp.reason, at=now)
            done += 1
    return done


def _apply_waiting(waiting: tuple[engine.Waiting, ...]) -> None:
    """Show each waiting customer why, writing only reasons that changed."""
    if not waiting:
        return
    for i in range(0, len(waiting), BIND_CHUNK):
        chunk = waiting[i : i + BIND_CHUNK]
        values = ", ".join(["(%s::uuid, %s)"] * len(chunk))
        params = [x for w in chunk for x in (str(w.rental_id), w.reason[:500])]
        with connection.cursor() as cursor:
            cursor.execute(
                f"""
                UPDATE marketplace_rental r SET status_reason = v.reason
                FROM (VALUES {values}) AS v(id, reason)
                WHERE r.id = v.id AND r.status = %s AND r.status_reason IS DISTINCT FROM v.reason
                """,  # noqa: S608 - only placeholders are interpolated
                [*params, RentalStatus.PENDING],
            )


def plan_apply(*, plan: engine.Plan, now: datetime, result: CycleResult) -> None:
    """Preemptions first (they free what placements use), then expiry, binds, reasons."""
    result.preempted += _apply_preemptions(plan.preemptions, now)
    result.expired += _apply_expiry(plan.expired, now)
    bound, conflicts = allocation_bind(placements=list(plan.placements), now=now)
    result.placed += len(bound)
    result.conflicts += len(conflicts)
    _apply_waiting(plan.waiting)
    result.waiting = len(plan.waiting)


def scheduler_cycle_run(
    *, pool: str = "default", max_rounds: int = 5, policy: engine.Policy | None = None
) -> CycleResult:
    """Plan and bind the pool's pending rentals; skipped when another cycle holds the pool.

    Rounds repeat while rentals arrived after the last snapshot, so a burst of creates that
    found the lock taken is still served by the cycle that holds it.
    """
    result = CycleResult()
    with pool_lock(pool) as got:
        if not got:
            return result
        result.ran = True
        for _ in range(max_rounds):
            cache.set(_SNAPSHOT_KEY.format(pool=pool), time.time(), timeout=3600)
            now = timezone.now()
            t0 = time.perf_counter()
            snapshot = snapshot_take(pool=pool, now=now)
            t1 = time.perf_counter()
            if not snapshot.pending:
                break
            decided = planner.plan(snapshot, policy or planner.DEFAULT_POLICY)
            t2 = time.perf_counter()
            plan_apply(plan=decided, now=now, result=result)
            t3 = time.perf_counter()
            result.rounds += 1
            for name, secs in (("snapshot", t1 - t0), ("plan", t2 - t1), ("bind", t3 - t2)):
                result.seconds[name] = result.seconds.get(name, 0.0) + secs
            newest = _dt(max(r.created_at for r in snapshot.pending))
            if not Rental.objects.filter(
                pool=pool, status=RentalStatus.PENDING, created_at__gt=newest
            ).exists():
                break
    if result.ran:
        log.info("scheduler cycle %s: %s", pool, result)
    return result


_SNAPSHOT_KEY = "scheduler:last-snapshot:{pool}"


def last_snapshot_at(pool: str) -> float:
    """When the latest cycle of the pool began reading (epoch seconds; 0 when unknown)."""
    return cache.get(_SNAPSHOT_KEY.format(pool=pool), 0.0)


def pools_with_pending() -> list[str]:
    return list(
        Rental.objects.filter(status=RentalStatus.PENDING)
        .values_list("pool", flat=True)
        .distinct()
        .order_by("pool")
    )
