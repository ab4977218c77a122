"""One scheduling cycle: requests in priority order, one decision each, over a capacity index.

The planner owns the order of requests, the checks that make a request wait or expire before any
search, and the decisions and their reasons; where capacity is kept (`capacity`), how nodes are
found (`search`), who is preempted (`preemption`) and when a blocked request can start
(`backfill`) live in their own modules.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import UTC, datetime

from scheduler.engine.backfill import earliest_start
from scheduler.engine.capacity import Ask, CapacityIndex, Choice, Gate, Match
from scheduler.engine.feasibility import describe_hardware, describe_location
from scheduler.engine.intervals import Tag
from scheduler.engine.preemption import choose_preemption, preemption_reason
from scheduler.engine.search import search
from scheduler.engine.types import (
    Expired,
    NodeGpus,
    Placement,
    Plan,
    Policy,
    Preemption,
    Request,
    Reservation,
    Snapshot,
    Waiting,
)

DEFAULT_POLICY = Policy()


def plan(snapshot: Snapshot, policy: Policy = DEFAULT_POLICY) -> Plan:
    """Decide, for every pending request of the snapshot, a placement or why it waits."""
    return _Planner(snapshot, policy).run()


def effective_priority(request: Request, now: float, policy: Policy = DEFAULT_POLICY) -> float:
    """Priority class plus `aging_per_second` for every second the request has waited."""
    return request.priority + policy.aging_per_second * max(0.0, now - request.created_at)


def node_gpus(chosen: Iterable[Choice]) -> NodeGpus:
    """The GPU ids of the chosen nodes, nodes by id, GPUs by index."""
    gpus = ((ns.node_id, tuple(ns.gpu_ids[p] for p in positions)) for _, _, ns, positions in chosen)
    return tuple(sorted(gpus))


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _hours(seconds: float) -> str:
    return f"{seconds / 3600:g} h"


class _Planner:
    def __init__(self, snapshot: Snapshot, policy: Policy) -> None:
        self.now = snapshot.now
        self.policy = policy
        self.pending = snapshot.pending
        self.index = CapacityIndex(snapshot, policy)
        self.reserves_left = policy.reserve_depth
        self.placements: list[Placement] = []
        self.preemptions: list[Preemption] = []
        self.waiting: list[Waiting] = []
        self.expired: list[Expired] = []
        self.reservations: list[Reservation] = []

    def run(self) -> Plan:
        now, policy = self.now, self.policy
        order = sorted(
            self.pending,
            key=lambda r: (-effective_priority(r, now, policy), r.created_at, r.rental_id),
        )
        for req in order:
            reason = self._decide(req)
            if reason is not None:
                self.waiting.append(Waiting(rental_id=req.rental_id, reason=reason))
        return Plan(
            placements=tuple(self.placements),
            preemptions=tuple(self.preemptions),
            waiting=tuple(self.waiting),
            expired=tuple(self.expired),
            reservations=tuple(self.reservations),
        )

    def _expire(self, req: Request, reason: str) -> None:
        self.expired.append(Expired(rental_id=req.rental_id, reason=reason))

    def _decide(self, req: Request) -> str | None:
        """Place, preempt for, expire or hold the request; returns why it waits, if it does."""
        now = self.now
        deadline = req.start_deadline
        if deadline is not None and deadline < now:
            self._expire(req, f"start deadline {_iso(deadline)} passed without a placement")
            return None
        start = max(now, req.start)
        if deadline is not None and start > deadline:
            self._expire(req, "start_deadline is before start")
            return None
        if start > now + self.policy.horizon:
            return (
                f"start in the future: {_iso(start)} is beyond the "
                f"{_hours(self.policy.horizon)} planning horizon"
            )
        if req.interruptible and (req.bid is None or req.bid <= 0):
            return "an interruptible request needs a positive bid"
        if req.interruptible and req.max_price is not None and req.bid > req.max_price:
            return f"bid ${req.bid:.2f} is above max price ${req.max_price:.2f}"
        match = self.index.match(req)
        if not match.classes:
            group = " in one topology group" if req.same_group else ""
            return (
                f"no node in {describe_location(req)} has {req.gpus_per_node} matching "
                f"GPUs{describe_hardware(req)}{group}"
            )
        ask = Ask(req, match)
        if not ask.match.classes:
            return self._priced_out(req, match)
        end = start + req.duration
        chosen = search(self.index, ask, start, end)
        if len(chosen) == ask.m:
            self._place(req, start, end, chosen)
            return None
        if start == now and self.policy.preemption and self._preempt(ask, end, chosen):
            return None
        reason = self._no_capacity(ask, start, len(chosen))
        if deadline is not None and deadline <= now:
            self._expire(
                req, f"start deadline {_iso(deadline)} reached without a placement: {reason}"
            )
            return None
        if self.reserves_left > 0:
            self.reserves_left -= 1
            reason += self._reserve(ask, start)
        return reason

    def _place(self, req: Request, t0: float, t1: float, chosen: list[Choice]) -> None:
        self.index.hold(req.rental_id, t0, t1, chosen, Tag.PLAN)
        # Interruptible pays its bid; a gang pays one rate, its dearest node's (within max_price).
        price = (
            req.bid
            if req.interruptible
            else max(ns.node.price_per_gpu_hour for _, _, ns, _ in chosen)
        )
        self.placements.append(
            Placement(
                rental_id=req.rental_id,
                start=t0,
                end=t1,
                price_per_gpu_hour=price,
                nodes=node_gpus(chosen),
            )
        )

    def _preempt(self, ask: Ask, t1: float, fitting: list[Choice]) -> bool:
        """Place the request now by stopping the cheapest set of interruptible rentals, if one
        lets the whole request fit."""
        found = choose_preemption(self.index, ask, t1, fitting)
        if found is None:
            return False
        req = ask.req
        for rental_id in found.victims:
            victim = self.index.evict(rental_id)
            self.preemptions.append(
                Preemption(
                    victim_rental_id=rental_id,
                    for_rental_id=req.rental_id,
                    reason=preemption_reason(req, victim),
                )
            )
        self._place(req, self.now, t1, found.chosen)
        return True

    def _reserve(self, ask: Ask, start: float) -> str:
        """Hold GPUs for a blocked request at its earliest possible start, so that requests
        behind it can only backfill where they do not delay it; returns the reason's suffix."""
        at = earliest_start(self.index, ask, start)
        if at is None:
            return f"; cannot start within the {_hours(self.policy.horizon)} planning horizon"
        end = at + ask.req.duration
        chosen = search(self.index, ask, at, end)
        # The sweep and the search apply the same interval rule, so this only guards against a
        # disagreement at a range end.
        if len(chosen) < ask.m:
            return ""
        self.index.hold(ask.req.rental_id, at, end, chosen, Tag.HOLD)
        self.reservations.append(
            Reservation(rental_id=ask.req.rental_id, start=at, end=end, nodes=node_gpus(chosen))
        )
        return f"; expected to start at {_iso(at)}"

    # -- reasons ------------------------------------------------------------------------------

    @staticmethod
    def _priced_out(req: Request, match: Match) -> str:
        if req.interruptible:
            lowest = min(cls.ladders[Gate.MIN_BID].values[0] for cls, _ in match.classes)
            return (
                f"bid: ${req.bid:.2f} is below every matching node's minimum bid "
                f"(lowest ${lowest:.2f})"
            )
        cheapest = min(cls.ladders[Gate.PRICE].values[0] for cls, _ in match.classes)
        return f"price: cheapest matching node is ${cheapest:.2f} > max ${req.max_price:.2f}"

    def _no_capacity(self, ask: Ask, start: float, found: int) -> str:
        req, k, m, priced = ask.req, ask.k, ask.m, ask.match.nodes
        group = " in one topology group" if req.same_group else ""
        when = f" from {_iso(start)}" if start > self.now else ""
        span = f"{group}{when} for {_hours(req.duration)}"
        if m == 1:
            return f"no capacity: {priced} nodes match, none has {k} free GPUs{span}"
        return f"no capacity: {priced} nodes match, {found} have {k} free GPUs{span}, {m} needed"
