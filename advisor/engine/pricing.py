"""Plans from live offers: GPU counts placed on nodes, priced, with the deadline or budget met,
and the cost of preemption for interruptible plans.

Gangs: one node gives any count up to its free GPUs; a gang over k nodes takes the same
power-of-two share on each (what a rental books: GPUs per node x nodes), the largest share k nodes
still offer, so 17 GPUs on nodes of 8 become 3 x 8 rather than 5 x 4 spread over more network.

Preemption (interruptible plans): a gang of k nodes is preempted at k times the pool's measured rate
per node-hour, mean time between preemptions M; checkpoints written every tau = sqrt(2 delta M)
(Young 1974, "A first order approximation to the optimum checkpoint interval"; Daly 2006, "A higher
order estimate of the optimum checkpoint interval for restart dumps", valid while delta << M) cost
delta / tau of the time, each preemption loses tau / 2 of work on average plus the restart.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from decimal import ROUND_CEILING, Decimal

from advisor.engine.compute import Card, Topology
from advisor.engine.layouts import Estimate, Run, estimate, fewest_fitting
from core.money import cost_micros

# Checkpoint write speed per node (local NVMe or object storage, approximate) and the time to be
# placed again and load the checkpoint after a preemption.
CHECKPOINT_GBS_PER_NODE = 2.0
RESTART_S = 600.0
# The largest cost a plan states: 14 digits with cents (what the API and the ledger can carry).
MAX_COST = Decimal("999999999999.99")
CENT = Decimal("0.01")
# What booking a plan books (plans.plan_book): the estimate plus a fifth, in whole minutes, at
# least ten minutes and at most the 30 days a rental may last.
BOOKING_MARGIN = 1.2
MIN_BOOKED_S = 600
MAX_BOOKED_S = 30 * 86400
MICROS_PER_USD = 1_000_000
# What a card's answer keeps: the cheapest, the fastest, the best value and the one meeting the
# deadline, then the next best values, up to this many.
PLANS_PER_CARD = 3


def bookings_needed(hours: float) -> int:
    """How many bookings of the longest a booking may last a run of this estimate takes: more
    than one is a series, each resuming from the checkpoint the one before it wrote."""
    return max(1, math.ceil(hours * 3600 / MAX_BOOKED_S))


def booked_seconds(hours: float) -> int:
    """The duration booking a plan of this estimate books, in seconds."""
    wanted = math.ceil(hours * 3600 * BOOKING_MARGIN / 60) * 60
    return min(MAX_BOOKED_S, max(MIN_BOOKED_S, wanted))


def hold_micros(*, price_per_gpu_hour: Decimal, gpus: int, duration_s: int) -> int:
    """What the booking holds against the balance until it ends: the whole booked time at the
    plan's price, rounded up to a micro-dollar: the one formula (core.money) that billing's
    hold uses too; tests/marketplace/test_advisor.py books a plan and compares the two exactly."""
    return cost_micros(
        price_per_gpu_hour=price_per_gpu_hour, gpu_seconds=gpus * duration_s, round_up=True
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class Offer:
    """Free GPUs of one card on one node, right now."""

    node_id: int
    card: str
    free_gpus: int
    nvlink: bool
    price_per_gpu_hour: Decimal
    min_bid_per_gpu_hour: Decimal
    network_gbits: float | None = None
    preemptions_per_node_hour: float = 0.0
    # The provider's cluster of the node (None: on its own, so single-node plans only) and its
    # fabric as customers read it ("InfiniBand 400 Gb/s"); `network_gbits` is then its
    # bandwidth per node.
    cluster: int | None = None
    interconnect: str | None = None
    interconnect_gbps: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class Placement:
    gpus_per_node: int
    offers: tuple[Offer, ...]

    @property
    def gpus(self) -> int:
        return self.gpus_per_node * len(self.offers)

    @property
    def interconnect(self) -> str | None:
        """The fabric between its nodes (all of one cluster); None on one node."""
        return self.offers[0].interconnect if len(self.offers) > 1 else None

    @property
    def interconnect_gbps(self) -> int:
        """The bandwidth it was priced with, which a booking asks of its cluster (0: one node)."""
        return self.offers[0].interconnect_gbps if len(self.offers) > 1 else 0

    def topology(self) -> Topology:
        nets = [o.network_gbits for o in self.offers]
        return Topology(
            gpus_per_node=self.gpus_per_node,
            nodes=len(self.offers),
            nvlink=all(o.nvlink for o in self.offers),
            network_gbits=min(nets) if all(nets) else None,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    """One way to run the workload, priced from live offers and bookable as it is."""

    estimate: Estimate
    placement: Placement
    hours: float
    price_per_gpu_hour: Decimal
    cost: Decimal
    interruptible: bool
    # What booking it books and holds: the estimate rounded up to what a booking takes.
    booked_s: int
    hold_micros: int
    checkpoint_interval_s: float | None = None
    preemption_overhead: float = 0.0
    # More than one: longer than a booking can hold, run as a series of bookings.
    bookings: int = 1
    flags: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def id(self) -> str:
        """Card and gang size: what booking re-prices against the offers free then."""
        return (
            f"{self.estimate.card.slug}:{len(self.placement.offers)}x{self.placement.gpus_per_node}"
        )

    @property
    def gpu_hours(self) -> float:
        return self.hours * self.placement.gpus

    @property
    def exact_cost(self) -> Decimal:
        """The estimated hours at the price, unrounded: what tells apart plans of a short run
        whose costs round to the same cent."""
        return Decimal(repr(self.hours)) * self.placement.gpus * self.price_per_gpu_hour

    @property
    def booked_hours(self) -> float:
        return self.booked_s / 3600

    @property
    def hold_usd(self) -> Decimal:
        return Decimal(self.hold_micros) / MICROS_PER_USD


def placements(offers: list[Offer], *, interruptible: bool) -> list[Placement]:
    """Every gang size the offers allow, fewest GPUs first, cheapest nodes chosen for each.

    A gang's nodes are all in one cluster, as the scheduler places it: multi-node placements
    are made per cluster, from the offers of its nodes only; a node on its own gives single-node
    placements only."""

    def price(o: Offer) -> Decimal:
        return o.min_bid_per_gpu_hour if interruptible else o.price_per_gpu_hour

    ranked = sorted(offers, key=lambda o: (price(o), -o.free_gpus, o.node_id))
    result = []
    most = max((o.free_gpus for o in ranked), default=0)
    for n in range(1, most + 1):
        result.append(
            Placement(gpus_per_node=n, offers=(next(o for o in ranked if o.free_gpus >= n),))
        )
    clusters: dict[int, list[Offer]] = {}
    for o in ranked:
        if o.cluster is not None:
            clusters.setdefault(o.cluster, []).append(o)
    for members in clusters.values():
        frees = sorted((o.free_gpus for o in members), reverse=True)
        # The members with at least `share` free, per share (a power of two: a handful).
        holding: dict[int, list[Offer]] = {}
        for k in range(2, len(members) + 1):
            share = 1 << int(math.log2(frees[k - 1]))
            if share not in holding:
                holding[share] = [o for o in members if o.free_gpus >= share]
            result.append(Placement(gpus_per_node=share, offers=tuple(holding[share][:k])))
    # A placement's nodes are in `ranked` order, so its dearest node is its last.
    result.sort(key=lambda p: (p.gpus, len(p.offers), price(p.offers[-1]), p.offers[0].node_id))
    # One placement per GPU count: the one on the fewest nodes, then the cheapest.
    return [p for i, p in enumerate(result) if i == 0 or result[i - 1].gpus != p.gpus]


def preemption_overhead(
    *, rate_per_node_hour: float, nodes: int, checkpoint_s: float
) -> tuple[float, float | None]:
    """(extra share of the run's time, checkpoint interval in seconds) under preemption."""
    rate = rate_per_node_hour * nodes / 3600.0
    if rate <= 0:
        return 0.0, None
    mtbf = 1.0 / rate
    interval = max(math.sqrt(2.0 * checkpoint_s * mtbf), checkpoint_s)
    lost = (interval / 2.0 + RESTART_S + checkpoint_s) / mtbf
    return checkpoint_s / interval + lost, interval


def price_plan(run: Run, found: Estimate, placement: Placement, *, interruptible: bool) -> Plan:
    offers = placement.offers
    price = max(o.min_bid_per_gpu_hour if interruptible else o.price_per_gpu_hour for o in offers)
    hours, interval, overhead, notes = found.hours, None, 0.0, []
    if interruptible:
        states = (found.memory.params + found.memory.optimizer) * found.gpus
        checkpoint_s = states / (CHECKPOINT_GBS_PER_NODE * 1e9 * len(offers))
        rate = max(o.preemptions_per_node_hour for o in offers)
        overhead, interval = preemption_overhead(
            rate_per_node_hour=rate, nodes=len(offers), checkpoint_s=checkpoint_s
        )
        hours *= 1 + overhead
        notes.append(
            f"{rate:.3f} preemptions per node-hour measured in this pool: "
            f"+{overhead:.0%} time for checkpoints and restarts"
        )
    raw = Decimal(repr(hours)) * placement.gpus * price
    cost = raw.quantize(CENT, ROUND_CEILING) if raw <= MAX_COST else None
    booked = booked_seconds(hours)
    held = hold_micros(price_per_gpu_hour=price, gpus=placement.gpus, duration_s=booked)
    notes.append(
        f"books {_span(booked)} (the estimate plus a fifth, in whole minutes, at least "
        f"{MIN_BOOKED_S // 60} min) and holds ${Decimal(held) / MICROS_PER_USD:.2f} of the "
        "balance until it ends; only the GPU-seconds it runs are charged"
    )
    bookings = bookings_needed(hours)
    if bookings > 1:
        notes.append(
            f"takes {hours:,.0f} h, longer than the {MAX_BOOKED_S // 3600} h one booking can "
            f"hold: it runs as a series of {bookings} bookings, each resuming from the last "
            "checkpoint of the one before (book each with resume_from); more GPUs make it shorter"
        )
    return Plan(
        estimate=found,
        placement=placement,
        hours=hours,
        price_per_gpu_hour=price,
        cost=cost,
        booked_s=booked,
        hold_micros=held,
        interruptible=interruptible,
        checkpoint_interval_s=interval,
        preemption_overhead=overhead,
        bookings=bookings,
        notes=notes,
    )


def _span(seconds: int) -> str:
    if seconds < 3600:
        return f"{seconds // 60} min"
    return f"{seconds / 3600:.2f} h"


def card_plans(
    run: Run,
    card: Card,
    offers: list[Offer],
    *,
    interruptible: bool,
    deadline_hours: float | None,
) -> tuple[list[Plan], str | None]:
    """A card's plans: the fewest GPUs that fit, the fewest that meet the deadline, and larger
    gangs by doubling up to all that is free; or why there is none."""
    gangs = placements(offers, interruptible=interruptible)
    if not gangs:
        return [], f"{card.name or card.slug}: no free GPUs"
    topologies = [g.topology() for g in gangs]
    first = fewest_fitting(run, card, topologies)
    if first is None:
        return [], (
            f"{card.name or card.slug}: the model does not fit the {gangs[-1].gpus} GPUs free "
            "with any layout"
        )
    chosen = {first, len(gangs) - 1}
    i = first
    while i < len(gangs):
        chosen.add(i)
        target = gangs[i].gpus * 2
        i = next((j for j in range(i, len(gangs)) if gangs[j].gpus >= target), len(gangs))
    if deadline_hours is not None:
        lo, hi = first, len(gangs)
        while lo < hi:
            mid = (lo + hi) // 2
            found = estimate(run, card, topologies[mid])
            if found is not None and found.fits and found.hours <= deadline_hours:
                hi = mid
            else:
                lo = mid + 1
        if lo < len(gangs):
            chosen.add(lo)
    plans = []
    for i in sorted(chosen):
        found = estimate(run, card, topologies[i])
        if found is not None and found.fits:
            plans.append(price_plan(run, found, gangs[i], interruptible=interruptible))
    return shortlist(plans, deadline_hours=deadline_hours), None


def _value(plan: Plan) -> Decimal:
    return plan.exact_cost * Decimal(repr(plan.hours))


def shortlist(plans: list[Plan], *, deadline_hours: float | None) -> list[Plan]:
    """A card's few plans worth showing: its fewest GPUs, cheapest, fastest and best value
    (least cost x hours), the fewest GPUs meeting the deadline, then the next best values,
    PLANS_PER_CARD in all unless those named are more."""
    if len(plans) <= PLANS_PER_CARD:
        return plans

    def cost(p: Plan) -> Decimal:
        return p.exact_cost

    keep = {
        min(plans, key=lambda p: (p.placement.gpus, cost(p))).id,
        min(plans, key=lambda p: (cost(p), p.hours)).id,
        min(plans, key=lambda p: (p.hours, cost(p))).id,
        min(plans, key=lambda p: (_value(p), cost(p))).id,
    }
    meeting = [p for p in plans if deadline_hours is not None and p.hours <= deadline_hours]
    if meeting:
        keep.add(min(meeting, key=lambda p: (p.placement.gpus, cost(p))).id)
    for plan in sorted(plans, key=lambda p: (_value(p), cost(p))):
        if len(keep) >= PLANS_PER_CARD:
            break
        keep.add(plan.id)
    return [p for p in plans if p.id in keep]


def choose(
    plans: list[Plan], *, deadline_hours: float | None, budget: Decimal | None
) -> tuple[list[Plan], list[str]]:
    """Keep the plans that meet the deadline and budget, flag the cheapest, fastest and best
    value (least cost x hours), cheapest first; say why plans were dropped."""
    reasons = []
    priced = [p for p in plans if p.cost is not None]
    if len(priced) < len(plans):
        reasons.append(
            f"{len(plans) - len(priced)} plans cost more than {MAX_COST} and are left out"
        )
    kept = priced
    if deadline_hours is not None:
        kept = [p for p in kept if p.hours <= deadline_hours]
        if priced and not kept:
            fastest = min(p.hours for p in priced)
            reasons.append(f"no plan meets {deadline_hours:g} h: the fastest takes {fastest:.1f} h")
    if budget is not None:
        within = [p for p in kept if p.cost <= budget]
        if kept and not within:
            cheapest = min(p.cost for p in kept)
            reasons.append(f"no plan fits a budget of {budget}: the cheapest costs {cheapest}")
        kept = within
    kept.sort(key=lambda p: (p.cost, p.hours, p.id))
    # A flag recommends booking the plan: never one that no booking can hold.
    bookable = [p for p in kept if p.bookings == 1]
    if bookable:
        min(bookable, key=lambda p: (p.exact_cost, p.hours)).flags.append("cheapest")
        min(bookable, key=lambda p: (p.hours, p.exact_cost)).flags.append("fastest")
        min(bookable, key=lambda p: (_value(p), p.exact_cost)).flags.append("best_value")
    elif kept:
        fastest = min(kept, key=lambda p: p.hours)
        reasons.append(
            f"no plan fits one booking of at most {MAX_BOOKED_S // 3600} h: the fastest takes "
            f"{fastest.hours:,.0f} h ({fastest.hours / 8766:,.1f} years), a series of "
            f"{fastest.bookings} bookings resuming from checkpoints; none is recommended: "
            "train on fewer tokens, a smaller model, or more GPUs"
        )
    return kept, reasons
