"""Joining nodes: one-time join tokens, matching reported GPUs to the catalog, node tokens
(stored hashed) and their revocation, and the token lookup of every agent call."""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass
from datetime import timedelta
from decimal import Decimal

from django.db import transaction
from django.db.models import F
from django.utils import timezone

from accounts.services import token_hash, token_mint
from agentprotocol import (
    GpuInfo,
)
from core.errors import Conflict, ValidationFailed
from marketplace.models import (
    Cluster,
    Gpu,
    GpuModel,
    Node,
    NodeStatus,
    Provider,
    User,
)
from marketplace.services import GpuSpec, cluster_for_join, node_internet_capable, node_register
from provisioning import queries
from provisioning.models import JoinToken, NodeCredential

log = logging.getLogger(__name__)


def join_token_create(
    *,
    provider: Provider,
    created_by: User | None,
    region: str,
    price_per_gpu_hour: Decimal,
    min_bid_per_gpu_hour: Decimal,
    pool: str = "default",
    valid_for: timedelta = timedelta(days=1),
) -> tuple[JoinToken, str]:
    """A one-time join token for one new host; the secret is returned once."""
    if price_per_gpu_hour <= 0:
        raise ValidationFailed("price must be positive", field="price_per_gpu_hour")
    if not 0 < min_bid_per_gpu_hour <= price_per_gpu_hour:
        raise ValidationFailed(
            "minimum bid must be positive and at most the price", field="min_bid_per_gpu_hour"
        )
    prefix, raw = token_mint("gpj")
    token = JoinToken.objects.create(
        provider=provider,
        key_hash=token_hash(raw),
        prefix=prefix,
        region=region,
        pool=pool,
        price_per_gpu_hour=price_per_gpu_hour,
        min_bid_per_gpu_hour=min_bid_per_gpu_hour,
        created_by=created_by,
        expires_at=timezone.now() + valid_for,
    )
    return token, raw


def catalog_match(name: str, memory_mb: int) -> GpuModel | None:
    """The catalog card for an NVML device name ("NVIDIA H100 80GB HBM3") or a catalog slug.

    The family must appear in the name; among its cards the closest memory size wins (NVML
    reports a little less than the marketed size), then the form factor the name implies
    ("PCIe"; "SXM" or HBM3 memory otherwise), then the memory type.
    """
    exact = GpuModel.objects.filter(slug=name).first()
    if exact is not None:
        return exact
    lowered = name.lower()
    compact = lowered.replace("nvidia", "").replace("geforce", "").replace(" ", "").replace("-", "")
    memory_gb = memory_mb / 1024
    if "pcie" in compact:
        form = "pcie"
    elif "sxm" in compact or "hbm3" in compact:
        form = "sxm"
    else:
        form = ""
    best = None
    for model in GpuModel.objects.all():
        if model.family not in compact:
            continue
        model_form = "pcie" if model.form_factor.lower() == "pcie" else "sxm"
        score = (
            abs(model.memory_gb - memory_gb) // 4,
            0 if not form or form == model_form else 1,
            0 if model.memory_type.lower() in compact else 1,
            -len(model.family),
        )
        if best is None or score < best[0]:
            best = (score, model)
    if best is None or best[0][0] > max(1, memory_gb // 32):
        return None
    return best[1]


def _allow_list(patterns: tuple[str, ...] | None) -> list[str] | None:
    return None if patterns is None else list(patterns)


@dataclass(frozen=True, slots=True, kw_only=True)
class HostFacts:
    hostname: str
    cpu_cores: int
    ram_gb: int
    disk_gb: int
    driver_version: str = ""
    cuda_version: str = ""
    simulated: bool = False
    runtime: str = ""  # "docker" | "process"; "" from agents that predate saying it
    ssh_capable: bool = True
    # The agent keeps a rental with internet to the public internet (its packet filter works);
    # agents that predate saying it are taken as unable.
    internet_filtered: bool = False
    # The image patterns its agent accepts (None: it did not say, any image).
    image_allow: tuple[str, ...] | None = None
    # Where the other members of a multi-node rental reach this node (None: not known).
    fabric_address: str | None = None
    # The provider's cluster the node joins (by name; None: the agent named none), and what its
    # fabric is, to create the cluster when the provider has none of that name.
    cluster: str | None = None
    interconnect: str | None = None
    interconnect_gbps: int | None = None


def node_join(
    *, raw_join_token: str, host: HostFacts, gpus: list[GpuInfo], host_key: str = ""
) -> tuple[Node, str]:
    """Turn a one-time join token into a listed node and a node token (stored hashed).

    GPUs the catalog already lists, by UUID, make this a rejoin (`_node_rekey`): a host that
    lost its node token joins its own node again. Another provider's GPUs are refused (409).

    A join is safe to repeat: the host sends a secret of its own (`host_key`, kept across
    attempts), and a used token presented again with the same secret and the same GPUs, before
    it expires, gets the node it made back with a fresh node token (the earlier one revoked).
    That is the host whose first answer was lost (a timeout after the server committed);
    anyone else presenting a used token gets nothing.

    A host that names a cluster joins its node into the provider's cluster of that name,
    created when the host also says what its fabric is (`cluster_for_join`); a rejoin that
    names none keeps the node's cluster (the provider may have set it since).
    """
    if not gpus:
        raise ValidationFailed("a node needs at least one GPU", field="gpus")
    if len({g.uuid for g in gpus}) != len(gpus):
        raise ValidationFailed("GPU UUIDs must be unique", field="gpus")
    with transaction.atomic():
        token = (
            JoinToken.objects.select_for_update()
            .select_related("provider")
            .filter(key_hash=token_hash(raw_join_token))
            .first()
        )
        if token is None or token.expires_at <= timezone.now():
            raise ValidationFailed("invalid, used or expired join token", field="join_token")
        if token.used_at is not None:
            node = _join_repeated(token=token, host_key=host_key, gpus=gpus)
            return node, _node_credential_mint(node)
        cluster = None
        if host.cluster is not None:
            cluster = cluster_for_join(
                provider=token.provider,
                name=host.cluster,
                interconnect=host.interconnect,
                bandwidth_gbps=host.interconnect_gbps,
            )
        models = {g.index: catalog_match(g.name, g.memory_mb) for g in gpus}
        unknown = sorted({g.name for g in gpus if models[g.index] is None})
        if unknown:
            raise ValidationFailed(f"GPU not in the catalog: {', '.join(unknown)}", field="gpus")
        listed = list(
            Gpu.objects.select_for_update(of=("self",))
            .select_related("node")
            .filter(uuid__in=[g.uuid for g in gpus])
            .order_by("pk")
        )
        if listed:
            node = _node_rekey(token=token, host=host, gpus=gpus, listed=listed, cluster=cluster)
        else:
            if Node.objects.filter(provider=token.provider, hostname=host.hostname).exists():
                raise Conflict("this provider already lists a node of that name", field="hostname")
            node = node_register(
                provider=token.provider,
                hostname=host.hostname,
                region=token.region,
                pool=token.pool,
                cpu_cores=host.cpu_cores,
                ram_gb=host.ram_gb,
                disk_gb=host.disk_gb,
                price_per_gpu_hour=token.price_per_gpu_hour,
                min_bid_per_gpu_hour=token.min_bid_per_gpu_hour,
                gpus=[
                    GpuSpec(
                        index=g.index,
                        uuid=g.uuid,
                        model_slug=models[g.index].slug,
                        topology_group=g.topology_group,
                    )
                    for g in gpus
                ],
                status=NodeStatus.ONLINE,
                simulated=host.simulated,
                nvlink=any(g.topology_group.startswith("nvl") for g in gpus),
                driver_version=host.driver_version,
                cuda_version=host.cuda_version,
                runtime=host.runtime,
                ssh_capable=host.ssh_capable,
                internet_filtered=host.internet_filtered,
                image_allow=_allow_list(host.image_allow),
                fabric_address=host.fabric_address,
                cluster=cluster,
            )
        node.last_seen_at = timezone.now()
        node.benchmark_requested = True  # measured, not declared: benchmark on join
        node.save(update_fields=["last_seen_at", "benchmark_requested"])
        token.used_at = timezone.now()
        token.node = node
        token.host_key_hash = token_hash(host_key) if host_key else ""
        token.save(update_fields=["used_at", "node", "host_key_hash"])
        return node, _node_credential_mint(node)


def _node_credential_mint(node: Node) -> str:
    _, raw = token_mint("gpn")
    NodeCredential.objects.create(node=node, key_hash=token_hash(raw))
    return raw


def _join_repeated(*, token: JoinToken, host_key: str, gpus: list[GpuInfo]) -> Node:
    """The node of a used join token, for the host that used it (same secret, same GPUs) while
    the node token it was given is still valid, that token revoked; a refusal otherwise,
    worded as for any spent token."""
    refused = ValidationFailed("invalid, used or expired join token", field="join_token")
    if not host_key or not token.host_key_hash or token.node_id is None:
        raise refused
    if not secrets.compare_digest(token.host_key_hash, token_hash(host_key)):
        raise refused
    node = Node.objects.select_for_update().get(pk=token.node_id)
    listed = set(Gpu.objects.filter(node=node).values_list("uuid", flat=True))
    if listed != {g.uuid for g in gpus}:
        raise refused
    # The node token the lost answer carried is still valid; once revoked (by ops, say), a
    # repeat would undo the revocation, so the host needs a new join token like any other.
    if not NodeCredential.objects.filter(node=node, revoked_at__isnull=True).exists():
        raise refused
    node_credential_revoke(node_id=node.pk, actor=None)
    Node.objects.filter(pk=node.pk).update(last_seen_at=timezone.now())
    log.info("join repeated node=%s provider=%s", node.pk, token.provider_id)
    return node


def _node_rekey(
    *,
    token: JoinToken,
    host: HostFacts,
    gpus: list[GpuInfo],
    listed: list[Gpu],
    cluster: Cluster | None,
) -> Node:
    """A rejoin: the same node, its old token revoked, its host facts refreshed.

    Only the provider that listed the GPUs may rejoin them, and only with exactly the node's
    GPUs: a host presenting part of a node, or GPUs of two nodes, is refused (409) instead of
    guessing. The node keeps its id, history, allocations and listing terms (the new join
    token's region and prices are not applied: running rentals were priced on the old ones).
    """
    nodes = {gpu.node_id: gpu.node for gpu in listed}
    if any(n.provider_id != token.provider_id for n in nodes.values()):
        raise Conflict("these GPUs are listed by another provider", field="gpus")
    (node,) = nodes.values() if len(nodes) == 1 else (None,)
    if node is None or len(listed) != len(gpus) or node.gpu_count != len(gpus):
        raise Conflict(
            "the GPUs match a listed node only in part; retire that node first", field="gpus"
        )
    node_credential_revoke(node_id=node.pk, actor=None)
    # A reboot may number the devices differently: follow the UUIDs, through indices no GPU
    # has, because (node, index) is unique at every step.
    index_of = {g.uuid: g.index for g in gpus}
    moved = [gpu for gpu in listed if gpu.index != index_of[gpu.uuid]]
    if moved:
        Gpu.objects.filter(pk__in=[gpu.pk for gpu in moved]).update(index=F("index") + 1000)
        for gpu in moved:
            Gpu.objects.filter(pk=gpu.pk).update(index=index_of[gpu.uuid])
    # A host naming its cluster moves the node there; one naming none leaves it where it is.
    moved_to = {} if cluster is None else {"cluster": cluster}
    Node.objects.filter(pk=node.pk).update(
        **moved_to,
        cpu_cores=host.cpu_cores,
        ram_gb=host.ram_gb,
        disk_gb=host.disk_gb,
        driver_version=host.driver_version,
        cuda_version=host.cuda_version,
        runtime=host.runtime,
        ssh_capable=host.ssh_capable,
        internet_filtered=host.internet_filtered,
        internet_capable=node_internet_capable(
            internet_filtered=host.internet_filtered, simulated=node.simulated, runtime=host.runtime
        ),
        image_allow=_allow_list(host.image_allow),
        fabric_address=host.fabric_address,
    )
    log.info("node rejoined node=%s provider=%s", node.pk, token.provider_id)
    node.refresh_from_db()
    return node


def node_credential_revoke(*, node_id: int, actor: User | None) -> int:
    """Revoke the node's tokens: its agent gets 401 from now on."""
    return NodeCredential.objects.filter(node_id=node_id, revoked_at__isnull=True).update(
        revoked_at=timezone.now()
    )


def node_authenticate(raw_token: str) -> Node | None:
    """The node of a valid, unrevoked node token; None otherwise."""
    return queries.node_by_token(key_hash=token_hash(raw_token))
