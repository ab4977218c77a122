"""Preemption: which interruptible rentals to stop so that a request can start now.

An on-demand request starting now that fits nowhere may stop interruptible rentals; an
interruptible request may stop interruptible rentals whose bid is strictly lower than its own.
Never a rental of a higher priority class, never on-demand work, never work placed in this plan.
On each node the victims are taken lowest bid first, then the one that started longest ago, and
unnecessary ones are dropped; the nodes whose victims cost least (bid x GPUs) win.

The reclaimable-count buckets of the capacity index let the search visit only nodes running
interruptible work, and stop where victims get dearer than the best found. This module only
chooses; the planner evicts the victims and places the request.
"""

from __future__ import annotations

from bisect import insort
from decimal import Decimal
from typing import NamedTuple

from scheduler.engine.capacity import Ask, CapacityIndex, Choice, NodeState, Victim
from scheduler.engine.intervals import Tag
from scheduler.engine.topology import Pick, pick
from scheduler.engine.types import RentalId, Request

_ZERO = Decimal(0)


class VictimSet(NamedTuple):
    """The cheapest victims on one node that free enough GPUs, and the GPUs they free."""

    cost: Decimal
    victims: list[RentalId]
    positions: list[int]
    spans: int


class Candidate(NamedTuple):
    """A node for a preempting request; sorts by what its victims cost, then how many they are,
    then the node's score and id."""

    cost: Decimal
    victim_count: int
    score: int
    node_id: int
    state: NodeState
    positions: list[int]
    victims: list[RentalId]


class Preempting(NamedTuple):
    """The rentals to stop, in the order to stop them, and the nodes the request then takes."""

    victims: list[RentalId]
    chosen: list[Choice]


def choose_preemption(
    index: CapacityIndex, ask: Ask, t1: float, fitting: list[Choice]
) -> Preempting | None:
    """The cheapest set of interruptible rentals to stop so the request fits now until t1.

    `fitting` are the nodes that already fit without preemption (fewer than m): they cost
    nothing. Other nodes are visited only if their GPUs are idle or held by interruptible work,
    skipping those whose victims cannot cost less than the m-th best found; each is given its
    cheapest sufficient set of victims and the m cheapest nodes are taken. None unless all m
    nodes fit once their victims are gone.
    """
    k, m, match, req = ask.k, ask.m, ask.match, ask.req
    best: list[Candidate] = [
        Candidate(_ZERO, 0, choice.score, choice.node_id, choice.state, choice.positions, [])
        for choice in fitting
    ]
    free_ids = {choice.node_id for choice in fitting}
    for level in range(k, index.max_level + 1):
        for cid in index.rlive[level] & match.ids:
            full = match.full[cid]
            partial = match.partial.get(cid)
            cls = index.class_list[cid]
            for cheapest, node_id in cls.rbuckets[level]:
                # Every node left needs a victim, which costs at least the node's cheapest, and
                # the bucket is sorted by that.
                if len(best) == m and cheapest > best[-1].cost:
                    break
                if node_id in free_ids:
                    continue
                ns = index.nodes[node_id]
                if partial is not None and ns.ranks_in(cls)[match.gate] >= partial.tiers:
                    continue
                if ns.level < k and ns.min_spot is not None:
                    # At least k - level GPUs must be freed, each at a bid of min_spot or more;
                    # an interruptible request can only stop lower bids.
                    if len(best) == m and ns.min_spot * (k - ns.level) > best[-1].cost:
                        continue
                    if req.interruptible and ns.min_spot >= req.bid:
                        continue
                found = victims_on(index, ns, ask.positions(ns, full), ask, t1)
                if found is None:
                    continue
                score = ns.static + index.topo * (found.spans - 1)
                insort(
                    best,
                    Candidate(
                        found.cost,
                        len(found.victims),
                        score,
                        node_id,
                        ns,
                        found.positions,
                        found.victims,
                    ),
                )
                if len(best) > m:
                    best.pop()
    if len(best) < m:
        return None
    stopped: dict[RentalId, None] = {}
    for candidate in best:
        stopped.update(dict.fromkeys(candidate.victims))
    chosen = [Choice(c.score, c.node_id, c.state, c.positions) for c in best]
    return Preempting(list(stopped), chosen)


def victims_on(
    index: CapacityIndex, ns: NodeState, positions: list[int], ask: Ask, t1: float
) -> VictimSet | None:
    """The cheapest victims on one node that free k fitting GPUs over [now, t1)."""
    req, victims, spot = ask.req, index.victims, Tag.SPOT.value
    blockers: dict[int, set[RentalId]] = {}
    for p in positions:
        held: set[RentalId] | None = set()
        for start, _, rental_id, tag in ns.ivs[p]:
            if start >= t1:
                break
            victim = victims.get(rental_id) if tag == spot else None
            if victim is None or not may_preempt(req, victim):
                held = None
                break
            held.add(rental_id)
        if held is not None:
            blockers[p] = held
    k, same_group, best_fit = ask.k, ask.same_group, index.best_fit
    if len(blockers) < k:
        return None
    stopped: set[RentalId] = set()

    def fit() -> Pick | None:
        free = [p for p, held in blockers.items() if held <= stopped]
        return pick(ns.group, free, k, same_group, best_fit)

    def victim_order(rental_id: RentalId) -> tuple[Decimal, float]:
        # Lowest bid first, then the one that started longest ago (it has had its run).
        victim = victims[rental_id]
        return victim.price, victim.start

    picked = fit()
    order = sorted({r for held in blockers.values() for r in held}, key=victim_order)
    taken: list[RentalId] = []
    for rental_id in order:
        if picked is not None:
            break
        taken.append(rental_id)
        stopped.add(rental_id)
        picked = fit()
    if picked is None:
        return None
    # Greedy order may have taken victims a later one made unnecessary: drop the dearest first
    # while the request still fits.
    for rental_id in reversed(taken[:-1]):
        stopped.discard(rental_id)
        trial = fit()
        if trial is None:
            stopped.add(rental_id)
        else:
            picked = trial
    taken = [r for r in taken if r in stopped]
    cost = sum((victims[r].cost for r in taken), start=Decimal(0))
    return VictimSet(cost, taken, picked.positions, picked.spans)


def may_preempt(req: Request, victim: Victim) -> bool:
    """Never a higher class; an interruptible request only outbids strictly lower bids."""
    if victim.priority > req.priority:
        return False
    return not req.interruptible or (req.bid is not None and victim.price < req.bid)


def preemption_reason(req: Request, victim: Victim) -> str:
    """Why the victim was stopped, as its customer is told."""
    if req.interruptible:
        return (
            f"outbid by rental {req.rental_id}: ${req.bid:.2f} > ${victim.price:.2f} per GPU-hour"
        )
    return f"preempted for on-demand rental {req.rental_id}"
