"""Rental writes: create (validated; refused when it can never fit), state changes, cancel, stop.

Placement itself is the scheduler's (scheduler.services); these functions only move a rental
through the one table of allowed transitions and record every change as an event row.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from decimal import Decimal

from django.conf import settings
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from marketplace.errors import Conflict, NotFound, ValidationFailed
from marketplace.models import (
    Allocation,
    GpuModel,
    Node,
    Rental,
    RentalEvent,
    RentalKind,
    RentalStatus,
    User,
)
from marketplace.models.rentals import ALLOWED_TRANSITIONS, TERMINAL_STATUSES
from scheduler.engine import feasibility
from scheduler.engine import types as engine

# A request that names no deadline may wait this long for capacity before it expires.
DEFAULT_START_WINDOW = timedelta(hours=1)
MAX_DURATION = timedelta(days=30)
MAX_ADVANCE_BOOKING = timedelta(days=90)


@dataclass(frozen=True, slots=True, kw_only=True)
class RuntimeSpec:
    """What runs in the rental's container."""

    image: str
    command: list[str] = field(default_factory=list)
    harness_config: dict | None = None
    env: dict[str, str] = field(default_factory=dict)
    ports: list[int] = field(default_factory=list)


@dataclass(frozen=True, slots=True, kw_only=True)
class RentalRequest:
    """What a customer asks for; validated field by field before this is built."""

    gpus_per_node: int
    duration_s: int
    runtime: RuntimeSpec
    node_count: int = 1
    name: str = ""
    gpu_models: tuple[str, ...] = ()
    gpu_families: tuple[str, ...] = ()
    min_memory_gb: int = 0
    min_tensor_tflops: Decimal = Decimal(0)
    same_group: bool = False
    region: str = ""
    pool: str = "default"
    max_price_per_gpu_hour: Decimal | None = None
    kind: str = RentalKind.ON_DEMAND
    bid_per_gpu_hour: Decimal | None = None
    start_at: datetime | None = None
    start_deadline: datetime | None = None
    priority: int = 0


def rental_transition(
    *,
    rental: Rental,
    to_status: str,
    actor_kind: str,
    actor: User | None = None,
    reason: str = "",
    **fields,
) -> Rental:
    """Move a locked rental along one allowed edge and record the event; call inside atomic()."""
    if to_status not in ALLOWED_TRANSITIONS[rental.status]:
        raise Conflict(f"a {rental.status} rental cannot become {to_status}")
    RentalEvent.objects.create(
        rental=rental,
        from_status=rental.status,
        to_status=to_status,
        actor_kind=actor_kind,
        actor=actor,
        reason=reason[:500],
    )
    rental.status = to_status
    rental.status_reason = reason[:500]
    for name, value in fields.items():
        setattr(rental, name, value)
    rental.save(update_fields=["status", "status_reason", "updated_at", *fields])
    return rental


def allocations_release(*, rental: Rental, at: datetime) -> int:
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


def _harness_config(runtime: RuntimeSpec) -> dict | None:
    """The harness image asked for with neither a command nor a config trains the harness's
    default config: every runtime then gets the same explicit harness command, including the
    local-process one, which has no image entrypoint to fall back on."""
    if (
        runtime.harness_config is None
        and not runtime.command
        and runtime.image == settings.GPUMARKET["HARNESS_IMAGE"]
    ):
        return {}
    return runtime.harness_config


def _engine_request(req: RentalRequest, start: datetime, deadline: datetime) -> engine.Request:
    return engine.Request(
        rental_id="new",
        created_at=timezone.now().timestamp(),
        gpus_per_node=req.gpus_per_node,
        node_count=req.node_count,
        duration=float(req.duration_s),
        start=start.timestamp(),
        start_deadline=deadline.timestamp(),
        gpu_models=frozenset(req.gpu_models) or None,
        gpu_families=frozenset(req.gpu_families) or None,
        min_memory_gb=req.min_memory_gb,
        min_tensor_tflops=float(req.min_tensor_tflops),
        same_group=req.same_group,
        region=req.region or None,
        pool=req.pool,
        max_price=req.max_price_per_gpu_hour,
        interruptible=req.kind == RentalKind.INTERRUPTIBLE,
        bid=req.bid_per_gpu_hour,
    )


def _never_fits(
    req: RentalRequest, start: datetime, deadline: datetime
) -> tuple[str | None, Decimal | None]:
    """Why the request could never be placed, judged by the engine's own feasibility rules,
    and, when it can be, the cheapest price per GPU-hour it could be placed at.

    The cheapest few nodes that meet every static constraint usually prove it fits (a cheap
    check on every create). Otherwise the candidate set widens one constraint at a time
    (price, size, hardware, location), cheapest first, so the reason names the first
    constraint no node meets.
    """
    from scheduler.services import engine_nodes  # the binding owns the row -> engine mapping

    located = Node.objects.filter(pool=req.pool)
    if req.region:
        located = located.filter(Q(region=req.region) | Q(region__startswith=f"{req.region}-"))
    hardware = located
    if req.gpu_models:
        hardware = hardware.filter(gpu_model__slug__in=req.gpu_models)
    if req.gpu_families:
        hardware = hardware.filter(gpu_model__family__in=req.gpu_families)
    if req.min_memory_gb:
        hardware = hardware.filter(gpu_model__memory_gb__gte=req.min_memory_gb)
    if req.min_tensor_tflops:
        hardware = hardware.filter(gpu_model__tensor_tflops__gte=req.min_tensor_tflops)
    sized = hardware.filter(gpu_count__gte=req.gpus_per_node)
    if req.kind == RentalKind.INTERRUPTIBLE and req.bid_per_gpu_hour is not None:
        priced = sized.filter(min_bid_per_gpu_hour__lte=req.bid_per_gpu_hour)
    elif req.max_price_per_gpu_hour is not None:
        priced = sized.filter(price_per_gpu_hour__lte=req.max_price_per_gpu_hour)
    else:
        priced = sized
    request = _engine_request(req, start, deadline)
    tiers = [(priced, 4 * req.node_count), (priced, 256), (sized, 256), (hardware, 256)]
    nodes: list[engine.Node] = []
    for i, (candidates, limit) in enumerate(tiers):
        nodes = engine_nodes(candidates.order_by("price_per_gpu_hour", "id")[:limit])
        if len(nodes) < req.node_count:
            continue
        reason = feasibility.never_fits(request, nodes)
        if reason is None:
            return None, nodes[0].price_per_gpu_hour
        if i > 0:
            return reason, None
    located_nodes = engine_nodes(located.order_by("price_per_gpu_hour", "id")[:256])
    return feasibility.never_fits(request, located_nodes), None


def rental_create(*, customer: User, request: RentalRequest) -> Rental:
    """Validate and store a PENDING rental, then queue a scheduler cycle after commit.

    A request that can never fit (no node has that many matching GPUs, a model nobody lists,
    a price below every offer) is refused with the reason instead of waiting forever.
    """
    now = timezone.now()
    start = request.start_at or now
    if start < now - timedelta(minutes=5):
        raise ValidationFailed("start_at is in the past", field="start_at")
    if start > now + MAX_ADVANCE_BOOKING:
        raise ValidationFailed("start_at is more than 90 days ahead", field="start_at")
    deadline = request.start_deadline or start + DEFAULT_START_WINDOW
    if deadline < start:
        raise ValidationFailed("start_deadline is before start_at", field="start_deadline")
    if not 0 < request.duration_s <= MAX_DURATION.total_seconds():
        raise ValidationFailed("duration must be between 1 s and 30 days", field="duration_s")
    interruptible = request.kind == RentalKind.INTERRUPTIBLE
    if interruptible and request.bid_per_gpu_hour is None:
        raise ValidationFailed("an interruptible rental needs a bid", field="bid_per_gpu_hour")
    if not interruptible and request.bid_per_gpu_hour is not None:
        raise ValidationFailed("only interruptible rentals bid", field="bid_per_gpu_hour")
    if request.gpu_models:
        known = set(
            GpuModel.objects.filter(slug__in=request.gpu_models).values_list("slug", flat=True)
        )
        unknown = sorted(set(request.gpu_models) - known)
        if unknown:
            raise ValidationFailed(f"unknown GPU model: {', '.join(unknown)}", field="gpu_models")
    reason, cheapest = _never_fits(request, start, deadline)
    if reason is not None:
        raise ValidationFailed(f"this request can never be placed: {reason}", field="non_field")
    from billing.services import funds_check  # billing imports marketplace: import at call

    # The first hour must be covered: at the bid, else the price cap, else the cheapest node
    # that could take it.
    price = request.bid_per_gpu_hour or request.max_price_per_gpu_hour or cheapest or Decimal(0)
    funds_check(
        customer=customer,
        hourly_cost=price * request.gpus_per_node * request.node_count,
        duration_s=request.duration_s,
    )
    with transaction.atomic():
        rental = Rental.objects.create(
            customer=customer,
            name=request.name,
            gpu_models=list(request.gpu_models),
            gpu_families=list(request.gpu_families),
            min_memory_gb=request.min_memory_gb,
            min_tensor_tflops=request.min_tensor_tflops,
            gpus_per_node=request.gpus_per_node,
            node_count=request.node_count,
            same_group=request.same_group,
            region=request.region,
            pool=request.pool,
            max_price_per_gpu_hour=request.max_price_per_gpu_hour,
            kind=request.kind,
            bid_per_gpu_hour=request.bid_per_gpu_hour,
            priority=request.priority,
            start_at=start,
            start_deadline=deadline,
            duration_s=request.duration_s,
            image=request.runtime.image,
            command=request.runtime.command,
            harness_config=_harness_config(request.runtime),
            env=request.runtime.env,
            ports=request.runtime.ports,
            status_reason="waiting for the scheduler",
        )
        RentalEvent.objects.create(
            rental=rental,
            from_status="",
            to_status=RentalStatus.PENDING,
            actor_kind=RentalEvent.Actor.CUSTOMER,
            actor=customer,
            reason="created",
        )
        from scheduler.tasks import scheduler_cycle_soon

        pool = rental.pool
        transaction.on_commit(lambda: scheduler_cycle_soon(pool))
    return rental


def _locked_own_rental(*, customer: User, rental_id) -> Rental:
    rental = Rental.objects.select_for_update().filter(pk=rental_id, customer=customer).first()
    if rental is None:
        raise NotFound("no such rental")
    return rental


def rental_cancel(
    *, customer: User, rental_id, reason: str = "cancelled by the customer"
) -> Rental:
    """Cancel a rental that has not started running; its GPUs are freed at once."""
    with transaction.atomic():
        rental = _locked_own_rental(customer=customer, rental_id=rental_id)
        if rental.status not in (RentalStatus.PENDING, RentalStatus.SCHEDULED):
            raise Conflict(f"a {rental.status} rental cannot be cancelled; stop it instead")
        now = timezone.now()
        allocations_release(rental=rental, at=now)
        return rental_transition(
            rental=rental,
            to_status=RentalStatus.CANCELLED,
            actor_kind=RentalEvent.Actor.CUSTOMER,
            actor=customer,
            reason=reason,
            ended_at=now,
        )


def rental_stop_by_system(*, rental_id, actor_kind: str, reason: str) -> Rental | None:
    """Stop (or cancel, if not started) a rental for the platform: billing at zero balance,
    ops, a lost node. Returns None when the rental is already over."""
    with transaction.atomic():
        rental = Rental.objects.select_for_update().filter(pk=rental_id).first()
        if rental is None or rental.status in TERMINAL_STATUSES:
            return None
        if rental.status == RentalStatus.STOPPING:
            return rental
        if rental.status in (RentalStatus.PENDING, RentalStatus.SCHEDULED):
            now = timezone.now()
            allocations_release(rental=rental, at=now)
            return rental_transition(
                rental=rental,
                to_status=RentalStatus.CANCELLED,
                actor_kind=actor_kind,
                reason=reason,
                ended_at=now,
            )
        return rental_transition(
            rental=rental, to_status=RentalStatus.STOPPING, actor_kind=actor_kind, reason=reason
        )


def rental_stop(*, customer: User, rental_id, reason: str = "stopped by the customer") -> Rental:
    """Ask a running rental to stop: the agent checkpoints (SIGTERM), stops and reports."""
    with transaction.atomic():
        rental = _locked_own_rental(customer=customer, rental_id=rental_id)
        if rental.status in (RentalStatus.PENDING, RentalStatus.SCHEDULED):
            return rental_cancel(customer=customer, rental_id=rental_id, reason=reason)
        if rental.status == RentalStatus.STOPPING:
            return rental
        if rental.status in TERMINAL_STATUSES:
            raise Conflict(f"the rental is already {rental.status}")
        return rental_transition(
            rental=rental,
            to_status=RentalStatus.STOPPING,
            actor_kind=RentalEvent.Actor.CUSTOMER,
            actor=customer,
            reason=reason,
        )
