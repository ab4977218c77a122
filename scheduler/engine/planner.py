"""One scheduling cycle: requests in priority order, one decision each, over a capacity index.

The planner owns the order of requests, the checks that make a request wait or expire before any
search, and the decisions and their reasons; where capacity is kept (`capacity`), how nodes are
found (`search`), who is preempted (`preemption`) and when a blocked request can start
(`backfill`) live in their own modules.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
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


def _gbps(part: Match) -> int:
    """The interconnect bandwidth of a cluster's match (every node of a cluster shares it)."""
    cls, _ = part.classes[0]
    return cls.example.interconnect_gbps


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
        if not match.classes and (
            req.node_count == 1 or not self.index.match(replace(req, node_count=1)).classes
        ):
            group = " in one topology group" if req.same_group else ""
            return (
                f"no node in {describe_location(req)} has {req.gpus_per_node} matching "
                f"GPUs{describe_hardware(req)}{group}"
            )
        # A gang is searched once per cluster (all its members in one), anything else once.
        parts = match.clusters() if req.node_count > 1 else [match]
        if not parts:
            return (
                f"no cluster in {describe_location(req)} has nodes with {req.gpus_per_node} "
                f"matching GPUs{describe_hardware(req)}: a multi-node rental runs inside one "
                "cluster (nodes a provider declared on one fabric)"
            )
        if req.node_count > 1 and req.min_interconnect_gbps:
            fastest = max(_gbps(part) for part in parts)
            parts = [part for part in parts if _gbps(part) >= req.min_interconnect_gbps]
            if not parts:
                return (
                    f"min_interconnect_gbps: no matching cluster is that fast (the fastest "
                    f"has {fastest} Gb/s, {req.min_interconnect_gbps} asked)"
                )
        end = start + req.duration
        if len(parts) > 1:
            chosen = self._best_cluster(req, parts, start, end)
            if chosen is not None:
                self._place(req, start, end, chosen)
                return None
        asks = [ask for ask in (Ask(req, part) for part in parts) if ask.match.classes]
        if not asks:
            return self._priced_out(req, parts)
        largest = max(ask.match.nodes for ask in asks)
        if largest < req.node_count:
            return (
                f"no cluster has {req.node_count} matching nodes (the largest has {largest}): "
                "a multi-node rental runs inside one cluster"
            )
        found = [(ask, search(self.index, ask, start, end)) for ask in asks]
        if len(found) == 1 and len(found[0][1]) == req.node_count:
            self._place(req, start, end, found[0][1])
            return None
        if start == now and self.policy.preemption and self._preempt(found, end):
            return None
        reason = self._no_capacity(asks, start, max(len(chosen) for _, chosen in found))
        if deadline is not None and deadline <= now:
            self._expire(
                req, f"start deadline {_iso(deadline)} reached without a placement: {reason}"
            )
            return None
        if self.reserves_left > 0:
            self.reserves_left -= 1
            reason += self._reserve(asks, start)
        return reason

    def _best_cluster(
        self, req: Request, parts: list[Match], start: float, end: float
    ) -> list[Choice] | None:
        """The nodes of the cluster whose members score best together (ties: the lowest node
        id), or None when no cluster can host the gang over [start, end) as things stand.

        A node scores at least its static score, so a cluster whose cheapest node times m
        cannot beat the best total found is not searched: clusters are visited in that order.
        Starting now, a cluster with fewer than m nodes idle enough is not searched either."""
        m, k, now = req.node_count, req.gpus_per_node, start == self.now
        best: tuple[int, int] | None = None
        found: list[Choice] | None = None
        for part in sorted(parts, key=lambda p: p.min_static):
            if best is not None and m * part.min_static > best[0]:
                break
            if now and m > sum(
                len(bucket) for cls, _ in part.classes for bucket in cls.buckets[k:]
            ):
                continue
            ask = Ask(req, part)
            if not ask.match.classes:
                continue
            chosen = search(self.index, ask, start, end)
            if len(chosen) < m:
                continue
            key = (sum(c.score for c in chosen), min(c.node_id for c in chosen))
            if best is None or key < best:
                best, found = key, chosen
        return found

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

    def _preempt(self, searched: list[tuple[Ask, list[Choice]]], t1: float) -> bool:
        """Place the request now by stopping the cheapest set of interruptible rentals, if one
        lets the whole request fit (a gang: in the cluster where its victims cost least)."""
        options = []
        for ask, fitting in searched:
            option = choose_preemption(self.index, ask, t1, fitting)
            if option is not None:
                cost = sum(self.index.victims[r].cost for r in option.victims)
                options.append((cost, len(option.victims), option.chosen[0].node_id, option))
        if not options:
            return False
        *_, found = min(options, key=lambda o: o[:3])
        req = searched[0][0].req
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

    def _reserve(self, asks: list[Ask], start: float) -> str:
        """Hold GPUs for a blocked request at its earliest possible start (a gang: in the
        cluster where that comes first), so that requests behind it can only backfill where
        they do not delay it; returns the reason's suffix."""
        starts = [
            (at, i)
            for i, ask in enumerate(asks)
            if (at := earliest_start(self.index, ask, start)) is not None
        ]
        if not starts:
            return f"; cannot start within the {_hours(self.policy.horizon)} planning horizon"
        at, i = min(starts)
        ask = asks[i]
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
    def _priced_out(req: Request, parts: list[Match]) -> str:
        classes = [cls for match in parts for cls, _ in match.classes]
        if req.interruptible:
            lowest = min(cls.ladders[Gate.MIN_BID].values[0] for cls in classes)
            return (
                f"bid: ${req.bid:.2f} is below every matching node's minimum bid "
                f"(lowest ${lowest:.2f})"
            )
        cheapest = min(cls.ladders[Gate.PRICE].values[0] for cls in classes)
        return f"price: cheapest matching node is ${cheapest:.2f} > max ${req.max_price:.2f}"

    def _no_capacity(self, asks: list[Ask], start: float, found: int) -> str:
        """Why a request that fits some nodes fits none now (a gang: `found` is the most nodes
        that fit in one cluster)."""
        req, k, m = asks[0].req, asks[0].k, asks[0].m
        priced = sum(ask.match.nodes for ask in asks)
        group = " in one topology group" if req.same_group else ""
        when = f" from {_iso(start)}" if start > self.now else ""
        span = f"{group}{when} for {_hours(req.duration)}"
        if m == 1:
            return f"no capacity: {priced} nodes match, none has {k} free GPUs{span}"
        if len(asks) == 1:
            return (
                f"no capacity: {priced} nodes match, {found} have {k} free GPUs{span}, {m} needed"
            )
        return (
            f"no capacity: {priced} nodes match in {len(asks)} clusters, at most {found} in one "
            f"cluster have {k} free GPUs{span}, {m} needed"
        )
