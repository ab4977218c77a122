"""Rental writes: validate a request (refused when it can never fit) and submit it.

Placement itself is the scheduler's (scheduler.services); every state change after that is
the lifecycle's (marketplace.lifecycle).
"""

from __future__ import annotations

import secrets
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Protocol

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.db import transaction
from django.utils import timezone

from accounts.models import Membership, Team
from accounts.selectors import ssh_key_scope
from accounts.services.secrets import (
    registry_credentials,
    secret_name_check,
    secret_values,
    secrets_missing,
)
from agentprotocol.images import image_normalize
from core.errors import NotFound, ValidationFailed
from marketplace.lifecycle import rental_submit
from marketplace.models import (
    CLUSTER_GBPS_MAX,
    GpuModel,
    PreemptionPolicy,
    Rental,
    RentalKind,
    RentalNetwork,
    User,
)
from marketplace.selectors import (
    NodeFilter,
    engine_nodes_cheapest,
    rental_owned,
)
from scheduler.engine import DEFAULT_POLICY, feasibility
from scheduler.engine import types as engine

# A request that names no deadline may wait this long for capacity before it expires.
DEFAULT_START_WINDOW = timedelta(hours=1)
MAX_DURATION = timedelta(days=30)
# The command of a Jupyter rental that names none: it keeps the container (and the notebook
# server the agent starts beside it) up.
JUPYTER_IDLE_COMMAND = ("sleep", "infinity")
# A booking is accepted only as far ahead as the planner places one: within the horizon it is
# planned (its GPUs allocated) at the next cycle, so it is guaranteed when made or refused then;
# further ahead it would wait PENDING with nothing held.
MAX_ADVANCE_BOOKING = timedelta(seconds=DEFAULT_POLICY.horizon)


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
    # The most this rental may be charged, in dollars: billing stops it there.
    max_charge: Decimal | None = None
    # Names of the customer's ready datasets the run reads (at /data/<name>).
    datasets: tuple[str, ...] = ()
    # An earlier rental of the customer's whose last synced checkpoint the run starts from.
    resume_from: uuid.UUID | None = None
    ssh: bool = False  # an sshd in the container for the account's SSH keys
    # The public internet (filtered by the node) or no network at all (RentalNetwork).
    network: str = RentalNetwork.INTERNET
    jupyter: bool = False  # JupyterLab beside the command, with a token of the rental's own
    # A gang: only a cluster whose interconnect is at least this fast, Gb/s per node (0: any).
    min_interconnect_gbps: int = 0
    # What a preemption does to it (PreemptionPolicy); None: preemption_policy_default.
    preemption_policy: str | None = None
    # The team secrets the run gets ([{"name", "env", "file"}], secret_uses_parse), and the
    # one its image is pulled with ("": none).
    secrets: tuple[dict, ...] = ()
    registry_secret: str = ""


def preemption_policy_default(*, harness_config: dict | None) -> str:
    """settings.GPUMARKET["PREEMPTION_POLICY"] when it names a policy; "auto" (the default):
    REQUEUE for a rental that checkpoints (the harness syncs its checkpoints, so a re-queued
    run resumes), END for any other, whose work a re-queue would start over."""
    setting = settings.GPUMARKET.get("PREEMPTION_POLICY", "auto")
    if setting in PreemptionPolicy.values:
        return setting
    return PreemptionPolicy.REQUEUE if harness_config is not None else PreemptionPolicy.END


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
        # Jupyter, like SSH, needs a node whose agent runs containers and publishes ports.
        ssh=req.ssh or req.jupyter,
        internet=req.network == RentalNetwork.INTERNET,
        min_interconnect_gbps=req.min_interconnect_gbps,
        image=image_normalize(req.runtime.image) if req.runtime.image else "",
    )


@dataclass(frozen=True, slots=True)
class _Fit:
    """The create-time check's answer: why the request can never be placed and the field to
    name (None when it can be), or the cheapest price per GPU-hour it could be placed at."""

    reason: str | None
    field: str = "non_field"
    cheapest: Decimal | None = None


def _never_fits(req: RentalRequest, start: datetime, deadline: datetime) -> _Fit:
    """Whether the request could ever be placed, judged by the engine's own feasibility rules.

    The cheapest few nodes that meet every static constraint usually prove it fits (a cheap
    check on every create). Otherwise the candidate set widens one constraint at a time
    (network and SSH, price, size, hardware, location), cheapest first, so the reason names
    the first constraint no node meets; the engine judges the network and SSH last, so a
    refusal for either means that nodes meeting everything else are listed and none of them
    can give it: `network` or `ssh` is named.
    """
    located = NodeFilter(pool=req.pool, region=req.region or "")
    hardware = replace(
        located,
        gpu_models=tuple(req.gpu_models),
        gpu_families=tuple(req.gpu_families),
        min_memory_gb=req.min_memory_gb or 0,
        min_tensor_tflops=req.min_tensor_tflops or Decimal(0),
    )
    sized = replace(hardware, min_gpus=req.gpus_per_node)
    if req.kind == RentalKind.INTERRUPTIBLE and req.bid_per_gpu_hour is not None:
        priced = replace(sized, max_min_bid=req.bid_per_gpu_hour)
    elif req.max_price_per_gpu_hour is not None:
        priced = replace(sized, max_price=req.max_price_per_gpu_hour)
    else:
        priced = sized
    # A gang's members sit in one cluster: unclustered nodes never host one.
    capable = replace(
        priced,
        ssh=req.ssh or req.jupyter,
        internet=req.network == RentalNetwork.INTERNET,
        clustered=req.node_count > 1,
        min_interconnect_gbps=req.min_interconnect_gbps,
    )
    request = _engine_request(req, start, deadline)
    tiers = [
        (capable, 4 * req.node_count),
        (capable, 256),
        (priced, 256),
        (sized, 256),
        (hardware, 256),
    ]
    nodes: list[engine.Node] = []
    for i, (candidates, limit) in enumerate(tiers):
        nodes = engine_nodes_cheapest(candidates, limit=limit)
        if len(nodes) < req.node_count:
            continue
        reason = feasibility.never_fits(request, nodes)
        if reason is None:
            return _Fit(None, cheapest=nodes[0].price_per_gpu_hour)
        if i > 0:
            return _refusal(request, nodes, reason)
    nodes = engine_nodes_cheapest(located, limit=256)
    return _refusal(request, nodes, feasibility.never_fits(request, nodes))


def _refusal(request: engine.Request, nodes: list[engine.Node], reason: str | None) -> _Fit:
    """A refusal names `network` when the same nodes would take the request without the
    internet, `ssh` when they would without SSH."""
    without_internet = replace(request, internet=False)
    if (
        reason is not None
        and request.internet
        and feasibility.never_fits(without_internet, nodes) is None
    ):
        return _Fit(reason, field="network")
    without_ssh = replace(request, ssh=False)
    if reason is not None and request.ssh and feasibility.never_fits(without_ssh, nodes) is None:
        return _Fit(reason, field="ssh")
    for named in ("node_count", "min_interconnect_gbps", "image"):
        if reason is not None and reason.startswith(f"{named}:"):
            return _Fit(reason, field=named)
    return _Fit(reason)


def _secrets_check(*, team: Team, request: RentalRequest) -> None:
    """The secrets named are the team's; a variable a secret sets is not also in `env`."""
    if not request.secrets and not request.registry_secret:
        return  # most creates name none: no query set built for nothing
    missing = secrets_missing(team=team, names=[use["name"] for use in request.secrets])
    if missing:
        raise ValidationFailed(f"the team has no secret {', '.join(missing)}", field="secrets")
    clash = sorted({use["env"] for use in request.secrets} & set(request.runtime.env))
    if clash:
        raise ValidationFailed(
            f"{', '.join(clash)} is set by a secret and by env: give it once", field="secrets"
        )
    if request.registry_secret:
        secret_name_check(request.registry_secret, field="registry_secret")
        value = secret_values(pairs=[(team.pk, request.registry_secret)]).get(
            (team.pk, request.registry_secret)
        )
        if value is None:
            raise ValidationFailed(
                f"the team has no secret {request.registry_secret}", field="registry_secret"
            )
        registry_credentials(value, secret=request.registry_secret)


# The catalog's card slugs as this process last read them: ops add a card now and then and
# remove one never in practice, so a slug found here is known; one that is not is looked up
# again before it is refused, so a card added since is never refused.
_known_gpu_models: frozenset[str] = frozenset()


def _gpu_models_unknown(slugs: Sequence[str]) -> list[str]:
    """The slugs the catalog does not list, sorted; no statement when every one was seen."""
    global _known_gpu_models
    if not set(slugs) <= _known_gpu_models:
        _known_gpu_models = frozenset(GpuModel.objects.values_list("slug", flat=True))
    return sorted(set(slugs) - _known_gpu_models)


class FundsHolder(Protocol):
    """Holds a new rental's cost against its team's balance in the creating transaction,
    checking the account's limits and budgets, or refuses it (raises)."""

    def __call__(
        self, *, rental: Rental, price_per_gpu_hour: Decimal, max_charge: Decimal | None
    ) -> object: ...


_funds_hold: FundsHolder | None = None
MISSING_FUNDS_HOLD = "billing's funds hold is not registered: is the billing app installed?"


def funds_hold_registered() -> bool:
    return _funds_hold is not None


def funds_hold_register(hold: FundsHolder) -> None:
    """Billing, which depends on the marketplace and not the reverse, hands its funds hold to
    rental_create when its app is ready."""
    global _funds_hold
    _funds_hold = hold


class DatasetsAttacher(Protocol):
    """Links the named datasets (the rental's team's, ready) to a rental being stored, in its
    transaction, or refuses them (raises); returns the links."""

    def __call__(self, *, rental: Rental, names: Sequence[str]) -> list: ...


_datasets_attach: DatasetsAttacher | None = None
MISSING_DATASETS_ATTACH = (
    "storage's datasets attach is not registered: is the storage app installed?"
)


def datasets_attach_registered() -> bool:
    return _datasets_attach is not None


def datasets_attach_register(attach: DatasetsAttacher) -> None:
    """Storage, which depends on the marketplace and not the reverse, hands rental_create the
    service that links a rental to the datasets it reads when its app is ready."""
    global _datasets_attach
    _datasets_attach = attach


def rental_create(
    *, customer: User, team: Team, request: RentalRequest, member: Membership | None = None
) -> Rental:
    """Validate and store a PENDING rental of the team (asked for by `customer`, one of its
    members; any role may rent), then queue a scheduler cycle after commit. `member`: the
    customer's membership of the team as the caller read it in this request, so that it is not
    read again.

    A request that can never fit (no node has that many matching GPUs, a model nobody lists,
    a price below every offer) is refused with the reason instead of waiting forever.
    """
    if member is not None:
        if (member.user_id, member.team_id) != (customer.pk, team.pk):
            raise NotFound("no such team", field="team")
    elif not Membership.objects.filter(team=team, user=customer).exists():
        raise NotFound("no such team", field="team")
    now = timezone.now()
    start = request.start_at or now
    if start < now - timedelta(minutes=5):
        raise ValidationFailed("start_at is in the past", field="start_at")
    if start > now + MAX_ADVANCE_BOOKING:
        hours = round(MAX_ADVANCE_BOOKING.total_seconds() / 3600)
        raise ValidationFailed(
            f"start_at is more than {hours} h ahead: bookings are planned (and guaranteed) "
            f"only within the {hours} h planning horizon",
            field="start_at",
        )
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
        unknown = _gpu_models_unknown(request.gpu_models)
        if unknown:
            raise ValidationFailed(f"unknown GPU model: {', '.join(unknown)}", field="gpu_models")
    if not 0 <= request.min_interconnect_gbps <= CLUSTER_GBPS_MAX:
        raise ValidationFailed(f"0 to {CLUSTER_GBPS_MAX} Gb/s", field="min_interconnect_gbps")
    if request.min_interconnect_gbps and request.node_count == 1:
        raise ValidationFailed(
            "only a multi-node rental crosses an interconnect", field="min_interconnect_gbps"
        )
    if request.network not in RentalNetwork.values:
        raise ValidationFailed(
            f"network must be one of {', '.join(RentalNetwork.values)}", field="network"
        )
    if request.ssh and not ssh_key_scope(team=team).exists():
        raise ValidationFailed("add an SSH public key to your team first", field="ssh")
    _secrets_check(team=team, request=request)
    resume_from = (
        rental_owned(team=team, rental_id=request.resume_from)
        if request.resume_from is not None
        else None
    )
    runtime = request.runtime
    if request.jupyter and not runtime.command and runtime.harness_config is None:
        # Nothing else to run: the notebook is the work, and the rental lasts until it is
        # stopped or its time is up.
        runtime = replace(runtime, command=list(JUPYTER_IDLE_COMMAND))
    fit = _never_fits(request, start, deadline)
    if fit.field == "ssh" and not request.ssh:  # the engine's `ssh` stood for the notebook
        fit = _Fit("jupyter: no matching node can run a container with a published port",
                   field="jupyter")  # fmt: skip
    if fit.reason is not None:
        raise ValidationFailed(f"this request can never be placed: {fit.reason}", field=fit.field)
    with transaction.atomic():
        rental = rental_submit(
            customer=customer,
            team=team,
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
            image=runtime.image,
            command=runtime.command,
            harness_config=_harness_config(runtime),
            env=runtime.env,
            ports=runtime.ports,
            ssh=request.ssh,
            network=request.network,
            secrets=[dict(use) for use in request.secrets],
            registry_secret=request.registry_secret,
            jupyter=request.jupyter,
            jupyter_token=secrets.token_urlsafe(32) if request.jupyter else "",
            resume_from=resume_from,
            min_interconnect_gbps=request.min_interconnect_gbps,
            preemption_policy=request.preemption_policy
            or preemption_policy_default(harness_config=_harness_config(runtime)),
        )
        links = []
        if request.datasets:
            if _datasets_attach is None:
                # Fail closed: a rental would start without the data it was asked to read.
                raise ImproperlyConfigured(MISSING_DATASETS_ATTACH)
            links = _datasets_attach(rental=rental, names=request.datasets)
        rental.created_dataset_links = links  # for the create's answer, as its created_event
        if _funds_hold is None:
            # Fail closed: a rental no hold guards could run past the team's balance.
            raise ImproperlyConfigured(MISSING_FUNDS_HOLD)
        # The whole booked time is held, at the most the rental can be charged per GPU-hour:
        # the bid, else the price cap, else (no cap) the cheapest node that could take it now.
        # Refused, the rental is rolled back with the hold.
        price = request.bid_per_gpu_hour or request.max_price_per_gpu_hour or fit.cheapest
        _funds_hold(
            rental=rental,
            price_per_gpu_hour=price or Decimal(0),
            max_charge=request.max_charge,
        )
        return rental
