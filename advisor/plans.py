"""Plans from the offers free now, and booking one of them in one step."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import timedelta
from decimal import Decimal

from django.conf import settings
from django.db import transaction
from django.db.models import DurationField, ExpressionWrapper, F, Sum
from django.db.models.functions import Coalesce, Now
from django.utils import timezone

from accounts.models import Team
from advisor.engine.layouts import Run, estimate
from advisor.engine.pricing import (
    MAX_BOOKED_S,
    Offer,
    Plan,
    card_plans,
    choose,
    placements,
    price_plan,
)
from advisor.engine.runs import harness_config, harness_problems
from advisor.selectors import advisor_card_get, advisor_cards
from core.errors import Conflict, ValidationFailed
from marketplace.models import (
    Rental,
    RentalEvent,
    RentalKind,
    RentalNetwork,
    RentalStatus,
    User,
    interconnect_label,
)
from marketplace.selectors import OfferFilters, nodes_internet_capable, offers_by_card
from marketplace.services.rentals import RentalRequest, RuntimeSpec, rental_create

# Preemption rate of a pool with little history: one per 50 node-hours, worth 10 node-hours of
# observation (a pool's measurements outweigh it once it has some).
PRIOR_PREEMPTIONS_PER_NODE_HOUR = 0.02
PRIOR_NODE_HOURS = 10.0
PREEMPTION_WINDOW = timedelta(days=30)
OFFERS_PER_CARD = 200


@dataclass(frozen=True, slots=True, kw_only=True)
class Query:
    run: Run
    interruptible: bool = False
    deadline_hours: float | None = None
    budget: Decimal | None = None
    region: str | None = None
    # A dataset of the team's token files the booked run trains on (None: the built-in tokens).
    dataset: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Answer:
    plans: list[Plan]
    reasons: list[str]


def preemption_rates() -> dict[str, float]:
    """Preemptions per node-hour of interruptible rentals, per pool, over the last 30 days."""
    since = timezone.now() - PREEMPTION_WINDOW
    ran = (
        Rental.objects.filter(
            kind=RentalKind.INTERRUPTIBLE, started_at__isnull=False, started_at__gte=since
        )
        .values("pool")
        .annotate(
            span=Sum(
                ExpressionWrapper(
                    (Coalesce("ended_at", Now()) - F("started_at")) * F("node_count"),
                    output_field=DurationField(),
                )
            )
        )
    )
    hours = {row["pool"]: row["span"].total_seconds() / 3600 for row in ran if row["span"]}
    preempted: dict[str, int] = {}
    for pool in RentalEvent.objects.filter(
        to_status=RentalStatus.PREEMPTED, created_at__gte=since
    ).values_list("rental__pool", flat=True):
        preempted[pool] = preempted.get(pool, 0) + 1
    return {
        pool: (preempted.get(pool, 0) + PRIOR_PREEMPTIONS_PER_NODE_HOUR * PRIOR_NODE_HOURS)
        / (hours.get(pool, 0.0) + PRIOR_NODE_HOURS)
        for pool in set(hours) | set(preempted)
    }


def offers(
    *, cards: tuple[str, ...], region: str | None, rates: dict[str, float], fresh: bool = False
) -> dict[str, list[Offer]]:
    """Each card's cheapest offers free now, by card slug (a card with none is absent). An
    answer reads every card in one statement as customers browse the offers
    (marketplace.selectors.offers_by_card through the offers cache: one statement every few
    seconds however many ask, where it costs tens of milliseconds of PostgreSQL at 10,000
    nodes); a booking (`fresh`) reads them at its instant."""
    found = offers_by_card(
        filters=OfferFilters(gpu_models=cards, region=region),
        per_card=OFFERS_PER_CARD,
        shape=_card_offers,
        cached=not fresh,
    )
    return {
        card: [
            Offer(
                node_id=node_id,
                card=card,
                free_gpus=free_gpus,
                nvlink=nvlink,
                price_per_gpu_hour=price,
                min_bid_per_gpu_hour=min_bid,
                network_gbits=net,
                preemptions_per_node_hour=rates.get(pool, PRIOR_PREEMPTIONS_PER_NODE_HOUR),
                cluster=cluster,
                interconnect=interconnect,
                interconnect_gbps=gbps,
            )
            for (
                pool,
                node_id,
                free_gpus,
                nvlink,
                price,
                min_bid,
                net,
                cluster,
                interconnect,
                gbps,
            ) in rows
        ]
        for card, rows in found.items()
    }


def _card_offers(rows: list[dict]) -> dict[str, list[tuple]]:
    """The offers statement's rows by card, each what an Offer is made of (and the node's
    pool, for its preemption rate): what the offers cache keeps for the advisor, as tuples
    (a pickled dataclass is read back field by field, twice as slow)."""
    result: dict[str, list[tuple]] = {}
    for row in rows:
        # A clustered node's fabric is what its provider declared for the cluster (what a
        # multi-node plan on it crosses); a node on its own has only its uplink.
        if row["interconnect"] is not None:
            net = float(row["interconnect_gbps"])
            label = interconnect_label(row["interconnect"], row["interconnect_gbps"])
        else:
            net = min(row["net_up_mbps"], row["net_down_mbps"]) / 1000
            label = None
        result.setdefault(row["gpu_model"], []).append(
            (
                row["pool"],
                row["node_id"],
                row["free_gpus"],
                row["nvlink"],
                row["price_per_gpu_hour"],
                row["min_bid_per_gpu_hour"],
                net or None,
                row["cluster_id"],
                label,
                row["interconnect_gbps"] or 0,
            )
        )
    return result


def advise(query: Query, *, only_card: str | None = None, fresh: bool = False) -> Answer:
    """Every card's plans from the offers free now, filtered by deadline and budget; with
    `fresh`, offers read at this instant rather than from the offers cache (a booking)."""
    rates = preemption_rates() if query.interruptible else {}
    plans, reasons = [], []
    cards = [c for c in advisor_cards() if only_card is None or c.slug == only_card]
    by_card = offers(
        cards=tuple(c.slug for c in cards), region=query.region, rates=rates, fresh=fresh
    )
    for card in cards:
        card_offers = by_card.get(card.slug)
        if not card_offers:
            continue
        found, why = card_plans(
            query.run,
            card,
            card_offers,
            interruptible=query.interruptible,
            deadline_hours=query.deadline_hours,
        )
        plans.extend(found)
        if why:
            reasons.append(why)
    if not plans and not reasons:
        # Name only what was asked: a region when there is one.
        where = f" in region {query.region}" if query.region else ""
        reasons.append(f"no offer matches: no GPUs are free{where} now")
    kept, why = choose(plans, deadline_hours=query.deadline_hours, budget=query.budget)
    return Answer(plans=kept, reasons=reasons + why)


def plan_estimate(plan: Plan) -> dict:
    """What booking stores on the rental, to compare with the run's measurements."""
    found = plan.estimate
    return {
        "plan": plan.id,
        "card": found.card.slug,
        "gpus": found.gpus,
        "layout": found.layout.to_dict(),
        "precision": str(found.precision),
        "mfu_prior": found.prior,
        "mfu": found.mfu,
        "step_s": found.step.total,
        "tokens_per_step": found.step.tokens,
        "tokens_per_s": found.tokens_per_s,
        "per_gpu_gb": found.memory.gb(),
        "hours": plan.hours,
        "bookings": plan.bookings,
        "booked_s": plan.booked_s,
        "hold_micros": plan.hold_micros,
    }


def plan_book(
    *,
    customer: User,
    team: Team,
    query: Query,
    plan_id: str | None,
    card: str | None,
    name: str,
    runtime: dict | None,
    series: bool = False,
    resume_from: uuid.UUID | None = None,
    network: str | None = None,
) -> Rental:
    """Book a plan in one step: its card and gang size (`card:NODESxGPUS`) re-priced against the
    offers free now, or the cheapest plan of a card when only the card is named. A plan longer
    than one booking is refused unless ``series`` asks for the next booking of its series: the
    longest booking, resuming from ``resume_from``'s checkpoint when given.

    The rental has ``network`` when given; otherwise the internet where every node the plan was
    priced on can filter it, else an internal network: the plan stays bookable as offered, and
    the harness needs none (the agent stages its data)."""
    if plan_id:
        chosen = _price_gang(query, plan_id)
    else:
        chosen = next(iter(advise(query, only_card=card, fresh=True).plans), None)
    field = "plan" if plan_id else "card"
    if chosen is None:
        raise Conflict(f"no free offers can run {plan_id or card} now", field=field)
    if chosen.cost is None:
        raise Conflict("this plan costs more than can be booked", field=field)
    if chosen.bookings > 1 and not series:
        # Booking it as one rental would end it after the longest booking, a fraction of the
        # way through: say so rather than book a run cut short.
        raise Conflict(
            f"this plan takes {chosen.hours:,.0f} h, longer than the {MAX_BOOKED_S // 3600} h "
            f"one booking can hold: it runs as a series of {chosen.bookings} bookings, each "
            "resuming from the checkpoint of the one before; book them with series: true (the "
            "next ones with resume_from: the previous rental's id), or choose more GPUs or fewer "
            "tokens",
            field=field,
        )
    run = _runtime(chosen, query, runtime)
    # What the plan said it books and holds (pricing.booked_seconds, pricing.hold_micros).
    duration = chosen.booked_s
    placement = chosen.placement
    price = chosen.price_per_gpu_hour
    with transaction.atomic():
        rental = rental_create(
            customer=customer,
            team=team,
            request=RentalRequest(
                name=name or f"advisor: {chosen.estimate.card.name or chosen.estimate.card.slug}",
                gpu_models=(chosen.estimate.card.slug,),
                gpus_per_node=placement.gpus_per_node,
                node_count=len(placement.offers),
                # The fabric the plan was priced with: a gang runs only on a cluster as fast.
                min_interconnect_gbps=placement.interconnect_gbps,
                # Only tensor parallelism needs one NVLink group; data parallel runs anywhere.
                same_group=chosen.estimate.layout.tp > 1,
                region=query.region or "",
                max_price_per_gpu_hour=None if query.interruptible else price,
                kind=RentalKind.INTERRUPTIBLE if query.interruptible else RentalKind.ON_DEMAND,
                bid_per_gpu_hour=price if query.interruptible else None,
                duration_s=duration,
                runtime=RuntimeSpec(
                    image=run["image"],
                    command=run.get("command", []),
                    harness_config=run.get("harness_config"),
                    env=run.get("env", {}),
                    ports=run.get("ports", []),
                ),
                datasets=(query.dataset,) if query.dataset else (),
                resume_from=resume_from,
                network=network
                or (
                    RentalNetwork.INTERNET
                    if nodes_internet_capable(o.node_id for o in placement.offers)
                    else RentalNetwork.INTERNAL
                ),
            ),
        )
        Rental.objects.filter(pk=rental.pk).update(advisor_estimate=plan_estimate(chosen))
    return rental


def plan_harness_config(plan: Plan, query: Query) -> dict:
    """The harness config that runs the plan: its model, layout, precision, the query's tokens
    as steps and its dataset; checked by the harness's own rules for the GPUs the plan books
    (ValidationFailed naming the field the harness would refuse at start)."""
    found = plan.estimate
    config = harness_config(
        shape=query.run.shape,
        layout=found.layout,
        precision=found.precision,
        micro_batches=found.step.micro_batches,
        tokens=query.run.tokens,
        dataset=query.dataset,
    )
    problems = harness_problems(
        config,
        world_size=plan.placement.gpus,
        local_world_size=plan.placement.gpus_per_node,
    )
    if problems:
        key, reason = problems[0]
        raise ValidationFailed(
            f"the harness cannot run this plan: {key}: {reason}", field=_request_field(key)
        )
    return config


# The request field behind each harness config key the harness can refuse.
_FIELDS = {
    "layout.dp": "dp",
    "layout.tp": "tp",
    "layout.pp": "pp",
    "layout.shard": "zero_stage",
    "layout.recompute": "checkpointing",
    "layout.micro_batch": "micro_batch",
    "layout.grad_accum": "global_batch",
    "layout.pp_microbatches": "micro_batch",
    "train.precision": "precision",
    "train.steps": "tokens_b",
    "data.seq_len": "seq_len",
    "model.seq_len": "seq_len",
    "data.batch_size": "micro_batch",
    "data.path": "dataset",
}


def _request_field(key: str) -> str:
    if key in _FIELDS:
        return _FIELDS[key]
    return "model" if key.startswith("model.") else "plan"


def _runtime(plan: Plan, query: Query, runtime: dict | None) -> dict:
    """What the rental runs: the harness with the plan's config, unless the customer gave a
    command or a harness config of their own."""
    harness = settings.GPUMARKET["HARNESS_IMAGE"]
    run = dict(runtime or {"image": harness})
    if run.get("image") == harness and run.get("harness_config") is None and not run.get("command"):
        run["harness_config"] = plan_harness_config(plan, query)
    return run


def _price_gang(query: Query, plan_id: str) -> Plan | None:
    """The plan's card and gang (`card:NODESxGPUS`) priced on the offers free now."""
    slug, _, gang = plan_id.partition(":")
    card = advisor_card_get(slug)
    if card is None:
        return None
    rates = preemption_rates() if query.interruptible else {}
    gangs = placements(
        offers(cards=(slug,), region=query.region, rates=rates, fresh=True).get(slug, []),
        interruptible=query.interruptible,
    )
    for placement in gangs:
        if f"{len(placement.offers)}x{placement.gpus_per_node}" == gang:
            found = estimate(query.run, card, placement.topology())
            if found is not None and found.fits:
                return price_plan(query.run, found, placement, interruptible=query.interruptible)
    return None
