"""The rental lifecycle: the only code that writes a rental's status and its event rows.

Every state change is one edge of ALLOWED_TRANSITIONS, recorded as a RentalEvent in the same
transaction. Each thing that can happen to a rental is a named function here; the scheduler,
provisioning and billing call them and this module calls none of them (a scheduler cycle is
queued by task name, after commit).

Two kinds of function, as in Zulip's `zerver/actions/`:
- outer actions (`rental_cancel`, `rental_stop`, `rental_stop_for_funds`) own a durable
  transaction and lock the rental themselves;
- composable ones take a rental the caller has locked (`select_for_update`) and must run in the
  caller's transaction, which holds that lock: they refuse to run outside one.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import Decimal

from celery import current_app
from django.core.cache import cache
from django.core.exceptions import ImproperlyConfigured
from django.db import connection, transaction
from django.db.transaction import TransactionManagementError
from django.utils import timezone

from accounts.models import Team
from core.errors import Conflict, NotFound
from core.rows import models_insert
from core.wake import nodes_wake
from marketplace.models import (
    Allocation,
    EndCause,
    PreemptionPolicy,
    Rental,
    RentalCredit,
    RentalEvent,
    RentalStatus,
    User,
)

S = RentalStatus
A = RentalEvent.Actor
C = EndCause

# The one table of allowed transitions; nothing else moves a rental.
ALLOWED_TRANSITIONS: dict[str, frozenset[str]] = {
    S.PENDING: frozenset({S.SCHEDULED, S.CANCELLED, S.EXPIRED}),
    S.SCHEDULED: frozenset(
        {
            S.PROVISIONING,
            S.PENDING,  # node lost before start: re-queued
            S.CANCELLED,
            S.PREEMPTED,
            S.FAILED,
        }
    ),
    S.PROVISIONING: frozenset({S.RUNNING, S.STOPPING, S.FAILED, S.PENDING, S.PREEMPTED}),
    S.RUNNING: frozenset({S.STOPPING, S.COMPLETED, S.FAILED, S.PREEMPTED, S.PENDING}),
    S.STOPPING: frozenset({S.COMPLETED, S.FAILED, S.PREEMPTED}),
    S.COMPLETED: frozenset(),
    S.FAILED: frozenset(),
    S.CANCELLED: frozenset(),
    S.PREEMPTED: frozenset(),
    S.EXPIRED: frozenset(),
}

# The status groupings, each defined once here.
TERMINAL = frozenset(s for s, targets in ALLOWED_TRANSITIONS.items() if not targets)
ACTIVE = frozenset(ALLOWED_TRANSITIONS) - TERMINAL
# Not started: a cancel frees the GPUs at once.
CANCELLABLE = frozenset({S.PENDING, S.SCHEDULED})
# The GPUs are billed now; a stop asks the agent to checkpoint and exit.
BURNING = frozenset({S.PROVISIONING, S.RUNNING})
# Still holds (or will hold) GPUs and is not yet asked to stop.
STOPPABLE = CANCELLABLE | BURNING
# The allocations still hold the GPUs.
HOLDS_GPUS = frozenset({S.SCHEDULED, S.PROVISIONING, S.RUNNING, S.STOPPING})
# The rental's container should be running on its nodes.
CONTAINER_WANTED = frozenset({S.SCHEDULED, S.PROVISIONING, S.RUNNING})

# The placement edge has one source in the table, so the set-based bind knows every event's
# from_status without reading it back (unpacking fails loudly if the table ever gains another).
(_PLACED_FROM,) = (s for s, targets in ALLOWED_TRANSITIONS.items() if S.SCHEDULED in targets)

# A re-queued rental may wait this long to be placed again, whatever its first deadline was (a
# rental that ran for hours would otherwise expire the moment it is re-queued).
REQUEUE_START_WINDOW = timedelta(hours=1)

# The scheduler's Celery task, by name: the lifecycle does not import the scheduler.
SCHEDULER_CYCLE_TASK = "scheduler.cycle"

log = logging.getLogger(__name__)


# The notifications app records what a transition is worth telling in the transition's own
# transaction (its outbox). It depends on the marketplace, not the reverse, so it hands its
# recorder in when its app is ready.
EventRecorder = Callable[..., object]
_event_recorder: EventRecorder | None = None
MISSING_EVENT_RECORDER = "no rental event recorder is registered: is notifications installed?"


def event_recorder_registered() -> bool:
    return _event_recorder is not None


def event_recorder_register(
    recorder: EventRecorder, *, statuses: frozenset[str] | None = None
) -> None:
    """Called as `recorder(events=[(rental, event), ...])` after a transition, or a batch of
    them, into one of `statuses` (every status when None), in its transaction; a batch is
    told in one call, so that the recorder writes its rows for all of it at once."""
    global _event_recorder, _recorded_statuses
    _event_recorder = recorder
    _recorded_statuses = statuses


# The statuses the recorder wants to hear of; None: all of them.
_recorded_statuses: frozenset[str] | None = None


def _recorded(status: str) -> bool:
    return _recorded_statuses is None or status in _recorded_statuses


def _require_transaction() -> None:
    if not connection.in_atomic_block:
        raise TransactionManagementError(
            "a rental transition runs inside the transaction that holds the rental's row lock"
        )


def rental_transition(
    *,
    rental: Rental,
    to_status: str,
    actor_kind: str,
    actor: User | None = None,
    reason: str = "",
    cause: str = "",
    **fields,
) -> Rental:
    """Move a locked rental along one allowed edge and record the event. An ending or a
    re-queue records its `cause` (EndCause): whose doing it was (when not given: the
    customer's for a customer's or billing's move, else the platform's)."""
    _require_transaction()
    if to_status not in ALLOWED_TRANSITIONS[rental.status]:
        raise Conflict(f"a {rental.status} rental cannot become {to_status}")
    if (to_status in TERMINAL or to_status == S.PENDING) and not cause:
        # Never NODE by default: only rental_end_for_node_fault blames a node.
        cause = C.CUSTOMER if actor_kind in (A.CUSTOMER, A.BILLING) else C.PLATFORM
    if (rental.status in CONTAINER_WANTED) != (to_status in CONTAINER_WANTED):
        # What its nodes should run changes: their agents hear of it after commit.
        _nodes_wake(rental)
    event = RentalEvent.objects.create(
        rental=rental,
        from_status=rental.status,
        to_status=to_status,
        actor_kind=actor_kind,
        actor=actor,
        reason=reason[:500],
        cause=cause,
    )
    rental.status = to_status
    rental.status_reason = reason[:500]
    if to_status in TERMINAL:
        fields["end_cause"] = cause
    if to_status == S.RUNNING:
        # Billable time starts at the server's own RUNNING event, whatever the agent reports.
        fields["started_at"] = event.created_at
    for name, value in fields.items():
        setattr(rental, name, value)
    rental.save(update_fields=["status", "status_reason", "updated_at", *fields])
    if _event_recorder is None:
        # Fail closed: a transition nobody is told of is a notification silently lost.
        raise ImproperlyConfigured(MISSING_EVENT_RECORDER)
    if _recorded(event.to_status):
        _event_recorder(events=[(rental, event)])
    return rental


def _nodes_wake(rental: Rental) -> None:
    nodes_wake(
        node_ids=Allocation.objects.filter(rental=rental)
        .values_list("node_id", flat=True)
        .distinct()
    )


def _allocations_release(*, rental: Rental, at: datetime) -> int:
    """Free the rental's GPUs from `at` on: ranges are cut at `at`, future ones dropped."""
    released = 0
    for alloc in Allocation.objects.filter(rental=rental, released_at__isnull=True):
        lower, upper = alloc.during.lower, alloc.during.upper
        if upper is not None and upper <= at:
            alloc.released_at = at
            alloc.save(update_fields=["released_at"])
        elif lower >= at:
            alloc.delete()
        else:
            alloc.during = type(alloc.during)(lower, at)
            alloc.released_at = at
            alloc.save(update_fields=["during", "released_at"])
        released += 1
    return released


def rental_submit(*, customer: User, team: Team, **fields) -> Rental:
    """Store a validated request as a PENDING rental of the team, created by `customer`, with
    its first event; a scheduler cycle for its pool is queued after commit."""
    _require_transaction()
    rental = Rental(
        customer=customer,
        team=team,
        status=S.PENDING,
        status_reason="waiting for the scheduler",
        **fields,
    )
    created = RentalEvent(
        rental=rental,
        from_status="",
        to_status=S.PENDING,
        actor_kind=A.CUSTOMER,
        actor=customer,
        reason="created",
    )
    # Every create writes these two rows: in one statement, prepared once (core.rows).
    models_insert(rental, created)
    # Its whole history so far, for the create's answer (selectors.rental_created_detail).
    rental.created_event = created
    pool = rental.pool
    transaction.on_commit(lambda: _cycle_soon(pool))
    return rental


# A cycle request sent and not yet begun, per pool: set by the create that sends the message,
# cleared by the task as it begins, before its cycle reads anything. A create that finds it set
# has committed before that task's snapshot, so it sends nothing (a burst of creates sends a
# message now and then, not one each). It expires, so a message the broker lost holds nothing
# back for long: beat's tick or a later create's message covers it.
CYCLE_QUEUED_KEY = "scheduler:queued:{pool}"
CYCLE_QUEUED_TTL_S = 2


def _cycle_soon(pool: str) -> None:
    """Ask for a cycle of the pool. Best effort: with the broker down the request is logged and
    dropped, and beat's tick (or a worker's start) places the rental, so a committed create never
    turns into an error for the customer."""
    key = CYCLE_QUEUED_KEY.format(pool=pool)
    try:
        if not cache.add(key, 1, timeout=CYCLE_QUEUED_TTL_S):
            return  # a queued task that has not begun covers this rental
    except Exception:  # cache unreachable: send anyway
        log.warning("cycle request flag not read for pool %s (cache unreachable)", pool)
    try:
        # The time is taken after commit: any cycle that snapshots later sees this rental.
        current_app.send_task(SCHEDULER_CYCLE_TASK, args=(pool, time.time()))
    except Exception:
        log.warning("scheduler cycle not queued (broker unreachable); the tick will place it")
        with contextlib.suppress(Exception):
            cache.delete(key)


def cycle_request_begin(pool: str) -> bool:
    """Called by a cycle task as it begins, before its cycle reads anything: clears the pool's
    queued flag; True when it was set (creates since the request may rely on this task)."""
    try:
        return bool(cache.delete(CYCLE_QUEUED_KEY.format(pool=pool)))
    except Exception:
        return False


@dataclass(frozen=True, slots=True, kw_only=True)
class PlacedRental:
    """One rental the scheduler placed: its locked price, its booked window, the event text."""

    rental_id: str
    price_per_gpu_hour: Decimal
    start: datetime
    end: datetime
    reason: str


def rentals_mark_placed(*, placements: Sequence[PlacedRental], at: datetime) -> set[str]:
    """PENDING -> SCHEDULED for a batch, set-based: one UPDATE guarded by the table's source
    status, one COPY of the events. Returns the ids moved; a rental that is no longer PENDING
    (cancelled, placed by another cycle) is left alone."""
    _require_transaction()
    values = []
    params: list = []
    for p in placements:
        values.append("(%s::uuid, %s::numeric, %s::timestamptz, %s::timestamptz)")
        params.extend([p.rental_id, p.price_per_gpu_hour, p.start, p.end])
    with connection.cursor() as cursor:
        cursor.execute(
            f"""
            UPDATE marketplace_rental r
            SET status = %s, status_reason = %s, price_per_gpu_hour = v.price,
                scheduled_start = v.s, scheduled_end = v.e, updated_at = %s
            FROM (VALUES {", ".join(values)}) AS v(id, price, s, e)
            WHERE r.id = v.id AND r.status = %s
            RETURNING r.id
            """,  # noqa: S608 - only placeholders are interpolated
            [S.SCHEDULED, "placed", at, *params, _PLACED_FROM],
        )
        placed = {str(row[0]) for row in cursor.fetchall()}
    if not placed:
        return placed
    # COPY: the bind is the scheduler's hot write.
    with (
        connection.cursor() as cursor,
        cursor.cursor.copy(
            "COPY marketplace_rentalevent (rental_id, from_status, to_status, actor_kind,"
            " reason, created_at) FROM STDIN"
        ) as copy,
    ):
        for p in placements:
            if p.rental_id in placed:
                copy.write_row(
                    (p.rental_id, _PLACED_FROM.value, S.SCHEDULED.value, A.SCHEDULER.value,
                     p.reason, at)
                )  # fmt: skip
    if _event_recorder is None:
        raise ImproperlyConfigured(MISSING_EVENT_RECORDER)
    if _recorded(S.SCHEDULED):
        # The batch's events were copied in without their rows coming back: read them for the
        # recorder, which the lifecycle promises after every transition, batched ones too.
        events = RentalEvent.objects.filter(
            rental_id__in=placed, to_status=S.SCHEDULED, created_at=at
        ).select_related("rental")
        _event_recorder(events=[(event.rental, event) for event in events])
    return placed


def rental_mark_provisioning(*, rental: Rental, hostname: str) -> None:
    """The run was handed to the node's agent: a SCHEDULED rental starts provisioning."""
    if rental.status == S.SCHEDULED:
        rental_transition(
            rental=rental,
            to_status=S.PROVISIONING,
            actor_kind=A.AGENT,
            reason=f"starting on {hostname}",
        )


def rental_mark_container_started(*, rental: Rental, hostname: str, waiting_for: str = "") -> None:
    """The agent reports the rental's container ran: the rental is RUNNING from the server's
    event (the agent's own start time is kept on its container run, as reported). A multi-node
    rental passes `waiting_for` while some of its members have not started yet: it stays
    PROVISIONING (unbilled) until the last one runs."""
    if rental.status == S.SCHEDULED:
        rental_transition(
            rental=rental,
            to_status=S.PROVISIONING,
            actor_kind=A.AGENT,
            reason=f"started on {hostname}; {waiting_for}" if waiting_for else "",
        )
    if rental.status == S.PROVISIONING and waiting_for:
        reason = f"started on {hostname}; {waiting_for}"
        if rental.status_reason != reason:  # the wait is told, with no transition
            rental.status_reason = reason
            rental.save(update_fields=["status_reason", "updated_at"])
        return
    if rental.status == S.PROVISIONING:
        rental_transition(
            rental=rental,
            to_status=S.RUNNING,
            actor_kind=A.AGENT,
            reason=f"container running on {hostname}",
        )


def rentals_mark_provisioning(*, rentals: Sequence[Rental], hostname: str) -> set[str]:
    """The runs of these rentals were handed to the agent on `hostname` in one heartbeat: each
    single-node SCHEDULED rental starts provisioning, as rental_mark_provisioning moves one,
    set-based (_rentals_move). Returns the ids moved."""
    return _rentals_move(
        rentals=rentals, source=S.SCHEDULED, target=S.PROVISIONING,
        reason=f"starting on {hostname}",
    )  # fmt: skip


def rentals_mark_running(*, rentals: Sequence[Rental], hostname: str) -> set[str]:
    """The agent on `hostname` reports the containers of these rentals running, in one
    heartbeat: each single-node PROVISIONING rental becomes RUNNING, as
    rental_mark_container_started moves one, set-based (_rentals_move). Returns the ids
    moved."""
    return _rentals_move(
        rentals=rentals, source=S.PROVISIONING, target=S.RUNNING,
        reason=f"container running on {hostname}",
    )  # fmt: skip


_MOVED_SQL = """
UPDATE marketplace_rental r SET status = %s, status_reason = %s, updated_at = %s{started}
FROM unnest(%s::uuid[], %s::timestamptz[]) AS v(id, at)
WHERE r.id = v.id
"""


def _rentals_move(*, rentals: Sequence[Rental], source: str, target: str, reason: str) -> set[str]:
    """An agent's edge `source` -> `target` for a batch of rentals whose row locks the caller
    holds: one INSERT of the events, one UPDATE of the rentals, then the recorder once, as
    rental_transition does one by one (neither edge changes what the nodes run: no wake-up).
    A rental in another state, or of several nodes (a gang waits for its barrier), is left to
    the one-by-one path."""
    _require_transaction()
    moving = [r for r in rentals if r.status == source and r.node_count == 1]
    if not moving:
        return set()
    reason = reason[:500]
    events = RentalEvent.objects.bulk_create(
        RentalEvent(rental=r, from_status=source, to_status=target, actor_kind=A.AGENT,
                    reason=reason)
        for r in moving
    )  # fmt: skip
    now = timezone.now()
    for rental, event in zip(moving, events, strict=True):
        rental.status, rental.status_reason, rental.updated_at = target, reason, now
        if target == S.RUNNING:
            # Billable time starts at the server's own RUNNING event, whatever the agent says.
            rental.started_at = event.created_at
    # One UPDATE from arrays: bulk_update's CASE per field costs more to compile than to run.
    with connection.cursor() as cursor:
        cursor.execute(
            _MOVED_SQL.format(started=", started_at = v.at" if target == S.RUNNING else ""),
            [target, reason, now, [r.pk for r in moving], [e.created_at for e in events]],
        )
    if _event_recorder is None:
        raise ImproperlyConfigured(MISSING_EVENT_RECORDER)
    if _recorded(target):
        _event_recorder(events=list(zip(moving, events, strict=True)))
    return {str(rental.pk) for rental in moving}


# What an agent's start error says when the customer's image or command is at fault (the node
# refuses the image, the registry has no such image, the command cannot be executed), not the
# node. Matched case-insensitively on the error the agent reports.
CUSTOMER_START_ERRORS = (
    "is not allowed on this node",
    "is too large for this node",
    "no such image",
    "pull access denied",  # the registry refused the credentials, or asked for some
    "manifest unknown",
    "image not found",
    "repository does not exist",
    "invalid reference format",
    "executable file not found",
    "exec format error",
    'exec: "',  # the runtime could not run the customer's (quoted) command: not executable
)


def start_error_cause(error: str) -> str:
    """Whose fault a start failure is, from what the agent reported: the customer's for their
    image or command, else the node's."""
    lowered = error.lower()
    if any(marker in lowered for marker in CUSTOMER_START_ERRORS):
        return C.CUSTOMER
    return C.NODE


def _stop_cause(rental: Rental) -> str:
    """Whose doing a stop was: the scheduler's is a preemption, every other one (the
    customer, their booked time, funds or budget) the customer's."""
    stop = rental.events.filter(to_status=S.STOPPING).order_by("-created_at", "-id").first()
    return C.PREEMPTION if stop is not None and stop.actor_kind == A.SCHEDULER else C.CUSTOMER


def rental_mark_container_ended(
    *,
    rental: Rental,
    hostname: str,
    exit_code: int | None,
    error: str,
    ended_at: datetime,
    log_tail: str,
    at: datetime,
) -> None:
    """The agent reports the container gone (exited, failed to start, or missing): the rental
    ends, its GPUs freed at `at`, the server's end time. How it ends, and whose doing that is,
    depends on why the container stopped; `ended_at` is the agent's, read only against the
    booked window."""
    if rental.status in TERMINAL:
        return
    cause = C.CUSTOMER
    if rental.status == S.STOPPING:
        to, reason, cause = S.COMPLETED, "stopped", _stop_cause(rental)
    elif rental.scheduled_end is not None and min(ended_at, at) >= rental.scheduled_end:
        # The agent stops a run when its allocation ends, maybe before the booked-time sweep
        # asked for the stop: the customer got what was booked, whatever the exit code.
        to, reason = S.COMPLETED, "booked time ended"
    elif error:
        to, reason = S.FAILED, f"cannot start on {hostname}: {error}"
        cause = start_error_cause(error)
    elif exit_code == 0:
        to, reason = S.COMPLETED, "finished"
    elif exit_code is not None:
        to, reason = S.FAILED, f"container exited with code {exit_code}"
        # As Kubernetes' FallbackToLogsOnError: the run's last line says why (a config the
        # harness refused, the exception that ended it).
        last = last_log_line(log_tail)
        if last:
            reason = f"{reason}: {last}"
    else:
        to, reason, cause = S.FAILED, f"container disappeared from {hostname}", C.NODE
    if to not in ALLOWED_TRANSITIONS[rental.status]:
        return
    fields = {"exit_code": exit_code, "log_tail": log_tail}
    if cause == C.NODE:
        rental_end_for_node_fault(
            rental=rental, hostname=hostname, reason=reason, at=at, requeue=False, **fields
        )
        return
    _allocations_release(rental=rental, at=at)
    rental_transition(
        rental=rental,
        to_status=to,
        actor_kind=A.AGENT,
        reason=reason,
        cause=cause,
        ended_at=at,
        **fields,
    )


# The longest piece of a run's log that goes into a rental's status reason.
REASON_LOG_CHARS = 300


def last_log_line(log_tail: str) -> str:
    """The last non-empty line of a log, with control and bidirectional-override characters
    dropped and cut to REASON_LOG_CHARS ("" for none)."""
    for line in reversed(log_tail.splitlines()):
        shown = "".join(c for c in line if c.isprintable()).strip()
        if shown:
            return shown if len(shown) <= REASON_LOG_CHARS else shown[: REASON_LOG_CHARS - 1] + "…"
    return ""


# The storage app (which depends on the marketplace) hands in how to read a rental's last
# synced checkpoint time, when its app is ready.
CheckpointLookup = Callable[[Rental], "datetime | None"]
_last_checkpoint_at: CheckpointLookup | None = None
MISSING_CHECKPOINT_LOOKUP = "no checkpoint lookup is registered: is storage installed?"


def last_checkpoint_lookup_register(lookup: CheckpointLookup) -> None:
    """Called as `lookup(rental)`: when the rental's last checkpoint was synced, or None."""
    global _last_checkpoint_at
    _last_checkpoint_at = lookup


def checkpoint_lookup_registered() -> bool:
    return _last_checkpoint_at is not None


def rental_end_for_node_fault(
    *,
    rental: Rental,
    hostname: str,
    reason: str,
    at: datetime,
    requeue: bool,
    actor_kind: str = A.SYSTEM,
    **fields,
) -> Rental:
    """Every ending (or re-queue) that is a node's fault goes through here: the node went
    silent, could not start the container for a reason of its own, lost it, or its GPU failed.
    The rental's GPUs are freed at `at`; the GPU time since its last synced checkpoint (the
    whole run when it never checkpointed) is credited (a RentalCredit the billing pass neither
    charges nor pays the provider for); then it ends (FAILED, or COMPLETED when it was
    already stopping) or, with `requeue` and when not stopping, goes back to PENDING to resume
    from that checkpoint. The cause recorded is NODE, which alone counts against the node's
    measured reliability."""
    _require_transaction()
    if rental.status in TERMINAL:
        return rental
    if hostname not in reason:
        reason = f"{reason} on {hostname}"  # the node blamed is named (reliability reads it)
    if _last_checkpoint_at is None:
        raise ImproperlyConfigured(MISSING_CHECKPOINT_LOOKUP)
    _allocations_release(rental=rental, at=at)
    if rental.started_at is not None:
        # No checkpoint: the whole run was lost (an unbounded start; the billing pass credits
        # only what was billable in it).
        since = _last_checkpoint_at(rental)
        if since is None or since < at:
            RentalCredit.objects.create(
                rental=rental,
                hostname=hostname[:255],
                reason=reason[:500],
                during=(since, at),
                created_at=at,
            )
    if rental.status == S.STOPPING:
        return rental_transition(
            rental=rental, to_status=S.COMPLETED, actor_kind=actor_kind, reason=reason,
            cause=C.NODE, ended_at=at, **fields,
        )  # fmt: skip
    if requeue:
        _requeue(rental=rental, actor_kind=actor_kind, reason=f"{reason}; re-queued", at=at,
                 cause=C.NODE)  # fmt: skip
        return rental
    return rental_transition(
        rental=rental, to_status=S.FAILED, actor_kind=actor_kind, reason=reason, cause=C.NODE,
        ended_at=at, **fields,
    )  # fmt: skip


# Every end or re-queue a node caused starts its reason so ("node <hostname> went silent",
# "node <hostname> GPU 2 failed: Xid 79").
NODE_FAULT_REASON = "node {hostname} {fault}"


def rental_mark_node_fault(
    *, rental: Rental, hostname: str, fault: str, at: datetime, requeue: bool
) -> bool:
    """The node failed the rental: it went silent, or a GPU the rental holds has a fatal fault.
    Not yet started -> back to PENDING; started -> FAILED (its state is on the faulty host)
    unless `requeue`; stopping -> COMPLETED; credited and blamed as a node fault
    (rental_end_for_node_fault). Returns False when the rental was already over."""
    if rental.status in TERMINAL:
        return False
    rental_end_for_node_fault(
        rental=rental,
        hostname=hostname,
        reason=NODE_FAULT_REASON.format(hostname=hostname, fault=fault),
        at=at,
        requeue=requeue or rental.status not in (S.RUNNING, S.STOPPING),
    )
    return True


def rental_mark_node_lost(*, rental: Rental, hostname: str, at: datetime, requeue: bool) -> bool:
    """A node of the rental went silent (rental_mark_node_fault)."""
    return rental_mark_node_fault(
        rental=rental, hostname=hostname, fault="went silent", at=at, requeue=requeue
    )


def _requeue(*, rental: Rental, actor_kind: str, reason: str, at: datetime, cause: str) -> None:
    """Back to PENDING to be placed again (on any node; it resumes from its last synced
    checkpoint), with a fresh start window."""
    rental_transition(
        rental=rental,
        to_status=S.PENDING,
        actor_kind=actor_kind,
        reason=reason,
        cause=cause,
        scheduled_start=None,
        scheduled_end=None,
        price_per_gpu_hour=None,
        start_deadline=max(rental.start_deadline, at + REQUEUE_START_WINDOW),
    )
    # Placed again at once, not at beat's next tick.
    pool = rental.pool
    transaction.on_commit(lambda: _cycle_soon(pool))


def rental_gang_requeue(*, rental: Rental, reason: str, at: datetime) -> None:
    """A multi-node rental whose members did not all start in time: its GPUs are freed and it
    goes back to the queue (never RUNNING, so never billed) to be placed again."""
    _allocations_release(rental=rental, at=at)
    _requeue(rental=rental, actor_kind=A.SYSTEM, reason=reason, at=at, cause=C.PLATFORM)


def rental_gang_fail(*, rental: Rental, reason: str, at: datetime) -> None:
    """A multi-node rental that could not start on its last try: failed, its GPUs freed."""
    _allocations_release(rental=rental, at=at)
    rental_transition(
        rental=rental,
        to_status=S.FAILED,
        actor_kind=A.SYSTEM,
        reason=reason,
        cause=C.PLATFORM,
        ended_at=at,
    )


def rental_mark_booked_time_ended(*, rental: Rental) -> bool:
    """The booked window is over: a provisioning or running rental is asked to stop
    (checkpoint, exit). Returns whether it was."""
    if rental.status not in BURNING:
        return False
    rental_transition(
        rental=rental, to_status=S.STOPPING, actor_kind=A.SYSTEM, reason="booked time ended"
    )
    return True


def rental_stop_grace_passed(*, rental: Rental, grace: timedelta, now: datetime) -> bool:
    """A STOPPING rental whose agent has not reported the container gone within the stop
    grace: its GPUs are freed at the grace's end and it is COMPLETED, whatever the agent
    reports later (a stop is never billed past its grace either). Returns whether it was."""
    if rental.status != S.STOPPING:
        return False
    stop = rental.events.filter(to_status=S.STOPPING).order_by("-created_at", "-id").first()
    if stop is None or stop.created_at + grace > now:
        return False
    at = stop.created_at + grace
    _allocations_release(rental=rental, at=at)
    rental_transition(
        rental=rental,
        to_status=S.COMPLETED,
        actor_kind=A.SYSTEM,
        reason="stopped: the stop grace passed, GPUs freed",
        cause=_stop_cause(rental),
        ended_at=at,
    )
    return True


def rental_preempt(
    *, rental: Rental, reason: str, at: datetime, requeue: bool | None = None
) -> bool:
    """The scheduler takes an interruptible rental's GPUs for a higher bid or priority; they
    are freed at `at`. The rental's own preemption policy, chosen at its create, decides: it
    ends PREEMPTED, or with REQUEUE (and not already stopping) goes back to PENDING to resume
    elsewhere from its last synced checkpoint. `requeue` is the scheduler's global setting,
    which that choice supersedes. Returns False when the rental no longer holds GPUs."""
    del requeue  # chosen per rental at create, from the same setting
    if rental.status not in HOLDS_GPUS:
        return False
    _allocations_release(rental=rental, at=at)
    if (
        rental.preemption_policy == PreemptionPolicy.REQUEUE
        and S.PENDING in ALLOWED_TRANSITIONS[rental.status]
    ):
        _requeue(rental=rental, actor_kind=A.SCHEDULER, reason=f"{reason}; re-queued", at=at,
                 cause=C.PREEMPTION)  # fmt: skip
        return True
    rental_transition(
        rental=rental,
        to_status=S.PREEMPTED,
        actor_kind=A.SCHEDULER,
        reason=reason,
        cause=C.PREEMPTION,
        ended_at=at,
    )
    return True


def rental_expire(*, rental: Rental, reason: str, at: datetime) -> None:
    """A PENDING rental passed its start deadline without being placed."""
    rental_transition(
        rental=rental,
        to_status=S.EXPIRED,
        actor_kind=A.SCHEDULER,
        reason=reason,
        cause=C.PLATFORM,
        ended_at=at,
    )


def _cancel(*, rental: Rental, actor_kind: str, actor: User | None, reason: str) -> Rental:
    now = timezone.now()
    _allocations_release(rental=rental, at=now)
    return rental_transition(
        rental=rental,
        to_status=S.CANCELLED,
        actor_kind=actor_kind,
        actor=actor,
        reason=reason,
        cause=C.CUSTOMER,
        ended_at=now,
    )


def _locked_team_rental(*, team: Team, rental_id) -> Rental:
    rental = Rental.objects.select_for_update().filter(pk=rental_id, team=team).first()
    if rental is None:
        raise NotFound("no such rental")
    return rental


@transaction.atomic(durable=True)
def rental_cancel(
    *, team: Team, actor: User, rental_id, reason: str = "cancelled by the customer"
) -> Rental:
    """A member of the rental's team cancels it before it runs; its GPUs are freed at once."""
    rental = _locked_team_rental(team=team, rental_id=rental_id)
    if rental.status not in CANCELLABLE:
        raise Conflict(f"a {rental.status} rental cannot be cancelled; stop it instead")
    return _cancel(rental=rental, actor_kind=A.CUSTOMER, actor=actor, reason=reason)


@transaction.atomic(durable=True)
def rental_stop(
    *, team: Team, actor: User, rental_id, reason: str = "stopped by the customer"
) -> Rental:
    """A member of the rental's team asks it to stop: the agent checkpoints (SIGTERM), stops
    and reports. One not yet started is cancelled."""
    rental = _locked_team_rental(team=team, rental_id=rental_id)
    if rental.status in CANCELLABLE:
        return _cancel(rental=rental, actor_kind=A.CUSTOMER, actor=actor, reason=reason)
    if rental.status == S.STOPPING:
        return rental
    if rental.status in TERMINAL:
        raise Conflict(f"the rental is already {rental.status}")
    return rental_transition(
        rental=rental, to_status=S.STOPPING, actor_kind=A.CUSTOMER, actor=actor, reason=reason
    )


@transaction.atomic(durable=True)
def rental_stop_for_funds(*, rental_id, reason: str) -> Rental | None:
    """Billing found the balance exhausted: stop the rental (or cancel it, if not started).
    Returns None when the rental is already over."""
    rental = Rental.objects.select_for_update().filter(pk=rental_id).first()
    if rental is None or rental.status in TERMINAL:
        return None
    if rental.status == S.STOPPING:
        return rental
    if rental.status in CANCELLABLE:
        return _cancel(rental=rental, actor_kind=A.BILLING, actor=None, reason=reason)
    return rental_transition(
        rental=rental, to_status=S.STOPPING, actor_kind=A.BILLING, reason=reason
    )


# The start of every stop reason a budget gives: the rental's own cap or its account's monthly
# budget was reached.
BUDGET_REACHED = "budget reached"


def rental_stop_for_budget(*, rental_id, reason: str) -> Rental | None:
    """Billing found a budget reached: stop the rental as for an empty balance (the agent
    checkpoints, SIGTERM then grace; not started: cancelled), the reason starting with
    BUDGET_REACHED. Returns None when the rental is already over."""
    return rental_stop_for_funds(rental_id=rental_id, reason=f"{BUDGET_REACHED}: {reason}")
