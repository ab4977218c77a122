"""The binding of the pure engine to the database: snapshot in, decisions written.

One cycle per pool at a time, under a PostgreSQL advisory lock. Whatever the engine decides,
the exclusion constraint on allocations has the last word: a conflicting bind is rolled back and
the rental stays PENDING for the next cycle ("re-plan"), so a cycle is safe to kill at any point.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime

import psycopg
from django.conf import settings
from django.core.cache import cache
from django.db import IntegrityError, OperationalError, connection, transaction
from django.utils import timezone

from agentprotocol.images import image_normalize
from core.locks import advisory_lock
from core.metrics import scheduler_cycle_observe
from core.wake import nodes_wake
from marketplace import lifecycle
from marketplace.models import Node, NodeStatus, Rental, RentalKind, RentalNetwork, RentalStatus
from marketplace.selectors import engine_nodes
from scheduler import queries
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
        ssh=row["ssh"] or row["jupyter"],  # both need a container with a published port
        internet=row["network"] == RentalNetwork.INTERNET,
        min_interconnect_gbps=row["min_interconnect_gbps"],
        image=image_normalize(row["image"]) if row["image"] else "",
    )


# pool -> (digest, nodes); per process (each worker keeps its own).
_inventory: dict[str, tuple[tuple, tuple[engine.Node, ...]]] = {}


def _inventory_digest(pool: str) -> tuple:
    return queries.inventory_digest(pool=pool, online=NodeStatus.ONLINE)


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
        queries.snapshot_isolation_set()
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
    busy = _busy(nodes, now)
    pending = [
        engine_request(row)
        for row in queries.rentals_pending(pool=pool, pending=RentalStatus.PENDING)
    ]
    return engine.Snapshot(now=_ts(now), nodes=nodes, busy=busy, pending=tuple(pending))


def _busy(nodes: tuple[engine.Node, ...], now: datetime) -> tuple[engine.Busy, ...]:
    """What holds the nodes' GPUs from `now` on."""
    rows = queries.allocations_busy(node_ids=[n.node_id for n in nodes], now=now)
    return tuple(
        engine.Busy(
            gpu_id=gpu_id,
            rental_id=rental_id,
            start=start,
            end=end,
            interruptible=kind == RentalKind.INTERRUPTIBLE,
            price=price or 0,
            priority=priority,
        )
        for gpu_id, rental_id, start, end, kind, price, priority in rows
    )


@dataclass
class CycleResult:
    """What one cycle did, for logs, tests and the benchmark."""

    ran: bool = False
    rounds: int = 0
    fast_rounds: int = 0
    placed: int = 0
    conflicts: int = 0
    preempted: int = 0
    expired: int = 0
    waiting: int = 0
    # Work was still arriving when the cycle's time budget ran out: the caller queues another.
    more: bool = False
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
    queries.allocations_copy(
        rows=(
            (str(p.rental_id), gpu_id, node_id, _range_literal(p), bound_at)
            for p in bound
            for node_id, gpu_ids in p.nodes
            for gpu_id in gpu_ids
        )
    )
    # The nodes' agents hear of their new runs after commit, each when its booking starts.
    by_start: dict[float, set[int]] = {}
    for p in bound:
        by_start.setdefault(p.start, set()).update(node_id for node_id, _ in p.nodes)
    for start, node_ids in by_start.items():
        nodes_wake(node_ids=node_ids, at=_dt(start))
    return bound


def _range_literal(p: engine.Placement) -> str:
    return f"[{_dt(p.start).isoformat()},{_dt(p.end).isoformat()})"


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
    # "requeue": a preempted rental waits for GPUs again and resumes from its last checkpoint.
    requeue = settings.GPUMARKET.get("PREEMPTION_POLICY", "end") == "requeue"
    done = 0
    for pre in preemptions:
        with transaction.atomic():
            rental = Rental.objects.select_for_update().filter(pk=pre.victim_rental_id).first()
            if rental is not None and lifecycle.rental_preempt(
                rental=rental, reason=pre.reason, at=now, requeue=requeue
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
        queries.waiting_reasons_set(
            reasons=[(str(w.rental_id), w.reason[:500]) for w in chunk],
            status=RentalStatus.PENDING,
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


# A queue of simple requests is placed without reading the whole pool: at most this many pending
# rentals, each looking at this many candidate nodes (best fit first). Anything else, or any
# request the candidates cannot take, goes to a full round over the whole pool.
FAST_PATH_MAX = 256
FAST_PATH_NODES = 24
# A cycle keeps running rounds while work arrives for at most this long, then hands the pool
# to a fresh task so that other pools' cycles on the same worker get their turn.
CYCLE_BUDGET_S = 60.0
# While creates stream in, a cycle's rounds begin at least this far apart, so that each round
# places what arrived meanwhile together: a round costs the worker about as much for one rental
# as for ten (bench/scheduler.py --parts stream, docs/benchmarks.md). A create that finds no
# cycle running is placed at once; one that arrives mid-stream waits at most this much more.
ROUND_GATHER_S = 0.1


def _fast_path_fits(req: engine.Request, now: float, policy: engine.Policy) -> bool:
    """One node, on demand, to start within the horizon and before its deadline."""
    return (
        req.node_count == 1
        and not req.interruptible
        and req.start <= now + policy.horizon
        and (req.start_deadline is None or req.start_deadline >= max(now, req.start))
    )


def _fast_round(
    *, pool: str, now: datetime, policy: engine.Policy, result: CycleResult
) -> int | None:
    """Place a small queue from a snapshot of its candidate nodes only; returns how many were
    pending (0: none), or None, having written nothing, when the queue is not small and simple
    or the candidates do not take every request: a full round decides instead, with the
    reasons and reservations only the whole pool gives."""
    at = _ts(now)
    pending = [
        engine_request(row)
        for row in queries.rentals_pending(
            pool=pool, pending=RentalStatus.PENDING, limit=FAST_PATH_MAX + 1
        )
    ]
    if not pending:
        return 0
    if len(pending) > FAST_PATH_MAX or not all(_fast_path_fits(r, at, policy) for r in pending):
        return None
    # Requests alike share one candidate query (a stream of identical asks reads once).
    shapes: dict[tuple, int] = {}
    for req in pending:
        start = max(at, req.start)
        shape = (
            start,
            start + req.duration,
            req.region or "",
            tuple(sorted(req.gpu_models or ())),
            tuple(sorted(req.gpu_families or ())),
            req.min_memory_gb,
            req.min_tensor_tflops,
            req.max_price,
            req.gpus_per_node,
            req.ssh,
            req.internet,
        )
        shapes[shape] = shapes.get(shape, 0) + 1
    node_ids: set[int] = set()
    for shape, count in shapes.items():
        start, end, region, models, families, memory, tflops, max_price, k, ssh, internet = shape
        found = queries.candidate_nodes(
            params={
                "pool": pool,
                "online": NodeStatus.ONLINE,
                "start": _dt(start),
                "end": _dt(end),
                "region": region,
                "models": list(models),
                "families": list(families),
                "memory": memory,
                "tflops": tflops,
                "max_price": max_price,
                "k": k,
                "ssh": ssh,
                "internet": internet,
                "limit": FAST_PATH_NODES + count,
            },
        )
        node_ids.update(found)
    if not node_ids:
        return None
    nodes = tuple(engine_nodes(Node.objects.filter(pk__in=node_ids).order_by("id")))
    snapshot = engine.Snapshot(now=at, nodes=nodes, busy=_busy(nodes, now), pending=tuple(pending))
    decided = planner.plan(snapshot, replace(policy, preemption=False))
    if len(decided.placements) != len(pending) or decided.expired:
        return None
    plan_apply(plan=decided, now=now, result=result)
    return len(pending)


def _full_round(
    *, pool: str, now: datetime, policy: engine.Policy, result: CycleResult
) -> engine.Snapshot:
    t0 = time.perf_counter()
    snapshot = snapshot_take(pool=pool, now=now)
    t1 = time.perf_counter()
    if snapshot.pending:
        decided = planner.plan(snapshot, policy)
        t2 = time.perf_counter()
        plan_apply(plan=decided, now=now, result=result)
        t3 = time.perf_counter()
        for name, secs in (("snapshot", t1 - t0), ("plan", t2 - t1), ("bind", t3 - t2)):
            result.seconds[name] = result.seconds.get(name, 0.0) + secs
    return snapshot


# Set by every cycle request before it tries the pool's lock and cleared by the holder at the
# start of each round: a request that found the lock taken is never lost, because the holder
# looks at the flag again after it lets the lock go.
_WANTED_KEY = "scheduler:wanted:{pool}"


def _wanted_set(pool: str) -> None:
    try:
        cache.set(_WANTED_KEY.format(pool=pool), 1, timeout=3600)
    except Exception:  # Redis down: no task message arrives either; beat's tick covers it
        log.warning("cycle request flag not set for pool %s (cache unreachable)", pool)


def _wanted_take(pool: str) -> bool:
    try:
        return bool(cache.delete(_WANTED_KEY.format(pool=pool)))
    except Exception:
        return False


def _rounds(*, pool: str, policy: engine.Policy, result: CycleResult, until: float) -> None:
    """Rounds back to back while work arrives, under the caller's lock."""
    while True:
        _wanted_take(pool)
        _snapshot_mark(pool)
        now = timezone.now()
        conflicts = result.conflicts
        result.rounds += 1
        t0 = time.perf_counter()
        handled = _fast_round(pool=pool, now=now, policy=policy, result=result)
        if handled == 0:
            return
        if handled is not None:
            result.fast_rounds += 1
            result.seconds["fast"] = result.seconds.get("fast", 0.0) + time.perf_counter() - t0
        else:
            snapshot = _full_round(pool=pool, now=now, policy=policy, result=result)
            if not snapshot.pending:
                return
        # Another round for what arrived during this one: a request's flag, or rows committed
        # after the snapshot whose message is still on its way; and for a lost bind race.
        again = (
            _wanted_take(pool)
            or result.conflicts > conflicts
            or Rental.objects.filter(
                pool=pool, status=RentalStatus.PENDING, created_at__gt=now
            ).exists()
        )
        if not again:
            return
        if time.monotonic() > until:
            result.more = True
            return
        time.sleep(max(0.0, ROUND_GATHER_S - (time.perf_counter() - t0)))


def scheduler_cycle_run(
    *, pool: str = "default", budget_s: float = CYCLE_BUDGET_S, policy: engine.Policy | None = None
) -> CycleResult:
    """Plan and bind the pool's pending rentals; when another cycle holds the pool, leave the
    work to it (it runs one more round for this request) and return at once."""
    result = CycleResult()
    started = time.monotonic()
    until = started + budget_s
    _wanted_set(pool)
    while True:
        with pool_lock(pool) as got:
            if not got:
                break
            began = time.time()
            result.ran = True
            _rounds(pool=pool, policy=policy or planner.DEFAULT_POLICY, result=result, until=until)
            log.info(
                "scheduler cycle pool=%s began=%.6f ended=%.6f placed=%d",
                pool, began, time.time(), result.placed,
            )  # fmt: skip
        # A request that came while the lock was held but after the last round began.
        if result.more or time.monotonic() > until or not _wanted_take(pool):
            break
        _wanted_set(pool)
    if result.ran:
        log.info("scheduler cycle %s: %s", pool, result)
        scheduler_cycle_observe(
            pool=pool, seconds=time.monotonic() - started, placements=result.placed
        )
    return result


_SNAPSHOT_KEY = "scheduler:last-snapshot:{pool}"


def _snapshot_mark(pool: str) -> None:
    try:
        cache.set(_SNAPSHOT_KEY.format(pool=pool), time.time(), timeout=3600)
    except Exception:  # Redis down: a request that came before is not dropped, it runs again
        log.warning("cycle start not recorded for pool %s (cache unreachable)", pool)


def last_snapshot_at(pool: str) -> float:
    """When the latest cycle of the pool began reading (epoch seconds; 0 when unknown, so a
    request is never dropped for a cycle nobody could record)."""
    try:
        return cache.get(_SNAPSHOT_KEY.format(pool=pool), 0.0)
    except Exception:
        return 0.0


def pools_with_pending() -> list[str]:
    return list(
        Rental.objects.filter(status=RentalStatus.PENDING)
        .values_list("pool", flat=True)
        .distinct()
        .order_by("pool")
    )
