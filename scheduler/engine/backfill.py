"""Backfill: the earliest time a blocked request can start, given every interval of the plan.

The first `Policy.reserve_depth` requests that cannot start are given, by a sweep over interval
ends, the earliest time within the horizon (and their deadline) at which they fit; the planner
then holds their GPUs from then on, so the requests behind them only backfill where they do not
delay them. The sweep visits every admitted node, which is why only a few requests per cycle get
one.
"""

from __future__ import annotations

from scheduler.engine.capacity import Ask, CapacityIndex, NodeState
from scheduler.engine.intervals import Edge, Event, covered, latest_start, merge


def earliest_start(index: CapacityIndex, ask: Ask, start: float) -> float | None:
    """Earliest t from `start` on, within the horizon and the request's deadline, at which m
    nodes can each host the request over [t, t + duration), or None."""
    limit = index.now + index.policy.horizon
    if ask.req.start_deadline is not None:
        limit = min(limit, ask.req.start_deadline)
    if start > limit:
        return None
    m, opening, closing = ask.m, Edge.OPEN, Edge.CLOSE
    first: float | None = None
    events: list[Event] = []
    full_of = ask.match.full
    for tier in ask.match.tiers():
        full = full_of[tier.cls.cid]
        for _, node_id in tier.entries:
            ns = index.nodes[node_id]
            ranges = start_ranges(ns, ask.positions(ns, full), ask, start, limit)
            if not ranges:
                continue
            if m == 1:
                lo, _ = ranges[0]
                if first is None or lo < first:
                    first = lo
            else:
                for lo, hi in ranges:
                    events.append(Event(lo, opening))
                    events.append(Event(hi, closing))
    if m == 1:
        return first
    ranges = covered(events, m)
    if not ranges:
        return None
    lo, _ = ranges[0]
    return lo


def start_ranges(
    ns: NodeState, positions: list[int], ask: Ask, start: float, limit: float
) -> list[tuple[float, float]]:
    """Disjoint closed ranges of t in [start, limit] at which the node can host the request."""
    k, duration = ask.k, ask.req.duration
    opening, closing = Edge.OPEN, Edge.CLOSE
    if ask.same_group and ns.group is not None:
        groups: dict[int, list[int]] = {}
        for p in positions:
            groups.setdefault(ns.group[p], []).append(p)
        pools = list(groups.values())
    else:
        pools = [positions]
    ranges = []
    for pool in pools:
        if len(pool) < k:
            continue
        events: list[Event] = []
        for p in pool:
            lo = start
            for s, e, _, _ in ns.ivs[p]:
                hi = min(latest_start(s, duration), limit)
                if hi >= lo:
                    events.append(Event(lo, opening))
                    events.append(Event(hi, closing))
                lo = max(lo, e)
                if lo > limit:
                    break
            else:
                events.append(Event(lo, opening))
                events.append(Event(limit, closing))
        ranges += covered(events, k)
    return merge(ranges)
