"""Inventory writes: listing nodes and their GPUs, and the ops actions on them."""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal

from django.db import IntegrityError, transaction

from core.errors import Conflict, NotFound, ValidationFailed
from marketplace.models import (
    Cluster,
    Gpu,
    GpuModel,
    Node,
    NodeEvent,
    NodeStatus,
    Provider,
    User,
)

# Which ops actions may move a node from which status. OFFLINE <-> ONLINE is the agent's to say.
_NODE_ACTIONS: dict[str, tuple[frozenset[str], str]] = {
    "drain": (frozenset({NodeStatus.ONLINE}), NodeStatus.DRAINING),
    "maintenance": (
        frozenset({NodeStatus.ONLINE, NodeStatus.DRAINING, NodeStatus.OFFLINE}),
        NodeStatus.MAINTENANCE,
    ),
    "online": (
        frozenset({NodeStatus.DRAINING, NodeStatus.MAINTENANCE, NodeStatus.OFFLINE}),
        NodeStatus.ONLINE,
    ),
}


PROVIDER_NAME_MAX = Provider._meta.get_field("name").max_length


def provider_create(*, owner: User, name: str) -> Provider:
    """A provider profile owned by `owner` (the "become a provider" page); names are unique
    because customers see them beside the hosts."""
    name = " ".join(name.split())
    if not name:
        raise ValidationFailed("a provider needs a name", field="name")
    if len(name) > PROVIDER_NAME_MAX:
        raise ValidationFailed(f"at most {PROVIDER_NAME_MAX} characters", field="name")
    with transaction.atomic():
        if Provider.objects.filter(name__iexact=name).exists():
            raise ValidationFailed("a provider with this name exists already", field="name")
        try:
            with transaction.atomic():
                return Provider.objects.create(owner=owner, name=name)
        except IntegrityError:
            # The same name created concurrently: the unique constraint decided.
            raise ValidationFailed(
                "a provider with this name exists already", field="name"
            ) from None


def node_request_benchmark(*, node_id: int) -> None:
    """Ask the node's agent to benchmark again at its next heartbeat."""
    if not Node.objects.filter(pk=node_id).update(benchmark_requested=True):
        raise Conflict("no such node")


def node_set_status(*, node_id: int, action: str, actor: User | None, reason: str = "") -> Node:
    """Apply an ops action (drain, maintenance, online) and record who did it and when."""
    if action not in _NODE_ACTIONS:
        raise ValidationFailed(f"unknown action {action!r}", field="action")
    allowed_from, to_status = _NODE_ACTIONS[action]
    with transaction.atomic():
        node = Node.objects.select_for_update().filter(pk=node_id).first()
        if node is None:
            raise NotFound("no such node")
        if node.status == to_status:
            return node
        if node.status not in allowed_from:
            raise Conflict(f"cannot {action} a node that is {node.status}")
        NodeEvent.objects.create(
            node=node, from_status=node.status, to_status=to_status, actor=actor, reason=reason
        )
        node.status = to_status
        node.save(update_fields=["status"])
        return node


def node_drain(*, node_id: int, actor: User | None, reason: str = "") -> Node:
    """Stop placing new rentals on the node; running ones finish."""
    return node_set_status(node_id=node_id, action="drain", actor=actor, reason=reason)


def node_set_maintenance(*, node_id: int, actor: User | None, reason: str = "") -> Node:
    return node_set_status(node_id=node_id, action="maintenance", actor=actor, reason=reason)


def node_bring_online(*, node_id: int, actor: User | None, reason: str = "") -> Node:
    return node_set_status(node_id=node_id, action="online", actor=actor, reason=reason)


@dataclass(frozen=True, slots=True)
class GpuSpec:
    """One GPU as a provider (or its agent) reports it."""

    index: int
    uuid: str
    model_slug: str
    topology_group: str = ""


def node_internet_capable(*, internet_filtered: bool, simulated: bool, runtime: str) -> bool:
    """Whether rentals with the internet may be placed on a node (Node.internet_capable): its
    agent filters their traffic to the public internet, or the node is simulated and runs the
    local-process runtime, the development runtime, whose runs have the host's own network
    unfiltered (as everything else there: it isolates nothing). A real host never gets an
    unfiltered rental."""
    return internet_filtered or (simulated and runtime == "process")


def node_register(
    *,
    provider: Provider,
    hostname: str,
    region: str,
    cpu_cores: int,
    ram_gb: int,
    disk_gb: int,
    price_per_gpu_hour: Decimal,
    min_bid_per_gpu_hour: Decimal,
    gpus: list[GpuSpec],
    status: str = NodeStatus.OFFLINE,
    simulated: bool = False,
    nvlink: bool = False,
    reliability: Decimal = Decimal("0.95"),
    net_up_mbps: int = 0,
    net_down_mbps: int = 0,
    driver_version: str = "",
    cuda_version: str = "",
    pool: str = "default",
    runtime: str = "",
    ssh_capable: bool = True,
    internet_filtered: bool = False,
    image_allow: list[str] | None = None,
    fabric_address: str | None = None,
    cluster: Cluster | None = None,
) -> Node:
    """List a server and its GPUs in one transaction; unknown card models are refused, and so is
    another provider's cluster."""
    if not gpus:
        raise ValidationFailed("a node needs at least one GPU", field="gpus")
    indices = [g.index for g in gpus]
    if len(set(indices)) != len(indices):
        raise ValidationFailed("GPU indices must be unique on a node", field="gpus")
    slugs = {g.model_slug for g in gpus}
    if len(slugs) != 1:
        raise ValidationFailed(
            "a node lists one GPU model; found " + ", ".join(sorted(slugs)), field="gpus"
        )
    if cluster is not None and cluster.provider_id != provider.pk:
        raise ValidationFailed("a cluster of the node's own provider", field="cluster")
    model = GpuModel.objects.filter(slug__in=slugs).first()
    if model is None:
        raise ValidationFailed(f"unknown GPU model: {slugs.pop()}", field="gpus")
    with transaction.atomic():
        node = Node.objects.create(
            provider=provider,
            hostname=hostname,
            region=region,
            pool=pool,
            cpu_cores=cpu_cores,
            ram_gb=ram_gb,
            disk_gb=disk_gb,
            net_up_mbps=net_up_mbps,
            net_down_mbps=net_down_mbps,
            driver_version=driver_version,
            cuda_version=cuda_version,
            gpu_model=model,
            gpu_count=len(gpus),
            nvlink=nvlink,
            status=status,
            reliability=reliability,
            reliability_declared=reliability,
            simulated=simulated,
            runtime=runtime,
            ssh_capable=ssh_capable,
            internet_filtered=internet_filtered,
            internet_capable=node_internet_capable(
                internet_filtered=internet_filtered, simulated=simulated, runtime=runtime
            ),
            image_allow=image_allow,
            fabric_address=fabric_address,
            cluster=cluster,
            price_per_gpu_hour=price_per_gpu_hour,
            min_bid_per_gpu_hour=min_bid_per_gpu_hour,
        )
        Gpu.objects.bulk_create(
            Gpu(
                node=node,
                index=g.index,
                uuid=g.uuid,
                model=model,
                topology_group=g.topology_group,
            )
            for g in gpus
        )
    return node


# What a provider may do to its own nodes. OFFLINE is the agent's to end (by its heartbeat), so a
# provider neither relists nor takes for maintenance a node whose agent is silent.
PROVIDER_ACTIONS: dict[str, frozenset[str]] = {
    "drain": frozenset({NodeStatus.ONLINE}),
    "maintenance": frozenset({NodeStatus.ONLINE, NodeStatus.DRAINING}),
    "online": frozenset({NodeStatus.DRAINING, NodeStatus.MAINTENANCE}),
}


def _owned_node(*, owner: User, node_id: int) -> Node:
    node = (
        Node.objects.select_for_update(of=("self",))
        .filter(pk=node_id, provider__owner=owner)
        .first()
    )
    if node is None:  # another provider's node is as absent as one that never existed
        raise NotFound("no such node")
    return node


def provider_node_action(*, owner: User, node_id: int, action: str, reason: str = "") -> Node:
    """Drain (unlist: running rentals finish), maintenance, or relist one of the owner's nodes.

    Maintenance takes a node out at once, so it is refused while rentals hold GPUs on it (drain
    first); relisting needs the node's agent heard from within the silence timeout."""
    from django.utils import timezone

    from marketplace.models import Allocation

    if action not in PROVIDER_ACTIONS:
        raise ValidationFailed(
            f"action must be one of {', '.join(sorted(PROVIDER_ACTIONS))}", field="action"
        )
    with transaction.atomic():
        node = _owned_node(owner=owner, node_id=node_id)
        target = _NODE_ACTIONS[action][1]
        if node.status == target:
            return node
        if node.status not in PROVIDER_ACTIONS[action]:
            raise Conflict(f"cannot {action} a node that is {node.status}", field="action")
        now = timezone.now()
        if (
            action == "maintenance"
            and Allocation.objects.filter(
                node=node, released_at__isnull=True, during__endswith__gt=now
            ).exists()
        ):
            raise Conflict(
                "rentals hold GPUs on this node: drain it, and take it for maintenance once "
                "they have ended",
                field="action",
            )
        if action == "online" and (
            node.last_seen_at is None
            or (now - node.last_seen_at).total_seconds() > node.silence_timeout_s()
        ):
            raise Conflict(
                "the node's agent has not been heard from: start it, and the node comes back "
                "by itself",
                field="action",
            )
        return node_set_status(
            node_id=node.pk, action=action, actor=owner, reason=reason or f"provider: {action}"
        )


def provider_node_price(
    *,
    owner: User,
    node_id: int,
    price_per_gpu_hour: Decimal | None = None,
    min_bid_per_gpu_hour: Decimal | None = None,
) -> Node:
    """Set one of the owner's node prices for new bookings; booked rentals keep their price."""
    with transaction.atomic():
        node = _owned_node(owner=owner, node_id=node_id)
        price = node.price_per_gpu_hour if price_per_gpu_hour is None else price_per_gpu_hour
        bid = node.min_bid_per_gpu_hour if min_bid_per_gpu_hour is None else min_bid_per_gpu_hour
        if price <= 0:
            raise ValidationFailed("must be positive", field="price_per_gpu_hour")
        if not 0 < bid <= price:
            if min_bid_per_gpu_hour is None:  # only the price was given: it fell below the bid
                raise ValidationFailed(
                    f"must be at least the minimum bid ({bid})", field="price_per_gpu_hour"
                )
            raise ValidationFailed(
                "must be positive and at most the price", field="min_bid_per_gpu_hour"
            )
        node.price_per_gpu_hour, node.min_bid_per_gpu_hour = price, bid
        node.save(update_fields=["price_per_gpu_hour", "min_bid_per_gpu_hour"])
        return node
