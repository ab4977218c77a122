"""GPU health from heartbeats: what a GPU's signals mean, and what the server does about it.

Each heartbeat's samples carry NVML's health signals (agentprotocol.GpuSample). The server, not
the agent, decides what they mean (`sample_verdict`):

- FAILED: a fatal Xid (agentprotocol.FATAL_XIDS), volatile uncorrectable ECC errors, a failed
  row remap, or a GPU fallen off the bus. The GPU leaves placement at once (the scheduler reads
  only GPUs not FAILED); the rentals holding it end as a node fault
  (lifecycle.rental_mark_node_fault: re-queued when interruptible or not yet started, else
  failed); the provider is told; a check (the platform's benchmark) is asked for. It comes back
  only after a passing check (`gpus_health_restore`), never by reporting well again.
- DEGRADED: hardware throttling, a PCIe link narrower or slower than the card's, memory repairs
  pending a reset, or an agent that calls the GPU unhealthy for a reason it does not name. The
  GPU still rents, shown as such; it is OK again when its signals clear.

Every change is a GpuHealthEvent row, the history behind the provider's page and reliability.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db.models import Exists, OuterRef, Q, Subquery
from django.utils import timezone

from agentprotocol import FATAL_XIDS, HARDWARE_THROTTLE_REASONS
from marketplace import lifecycle
from marketplace.models import (
    Allocation,
    Gpu,
    GpuHealth,
    GpuHealthEvent,
    Node,
    NodeStatus,
    Rental,
    RentalKind,
)
from notifications.services import gpu_failed_notify
from provisioning.models import ContainerRun, NodeBenchmark

log = logging.getLogger(__name__)

H = GpuHealth
_RANK = {H.OK: 0, H.DEGRADED: 1, H.FAILED: 2}


@dataclass(frozen=True, slots=True)
class Verdict:
    """What one sample says of its GPU."""

    health: str
    reason: str = ""


OK = Verdict(H.OK)


def sample_verdict(sample: Mapping[str, Any]) -> Verdict:
    """The health one validated sample (provisioning.api TelemetrySerializer) shows."""
    if sample.get("lost"):
        return Verdict(H.FAILED, "fell off the bus")
    xid = sample.get("fatal_xid", 0)
    if xid in FATAL_XIDS:
        return Verdict(H.FAILED, f"Xid {xid}")
    ecc = sample.get("ecc_errors", 0)
    if ecc:
        return Verdict(H.FAILED, f"{ecc} uncorrectable ECC errors")
    if sample.get("remap_failed"):
        return Verdict(H.FAILED, "row remapping failed")
    why = []
    throttle = sample.get("throttle_reasons", 0)
    why += [name for bit, name in HARDWARE_THROTTLE_REASONS.items() if throttle & bit]
    width, width_max = sample.get("pcie_width", 0), sample.get("pcie_width_max", 0)
    if 0 < width < width_max:
        why.append(f"PCIe link x{width} of x{width_max}")
    gen, gen_max = sample.get("pcie_gen", 0), sample.get("pcie_gen_max", 0)
    if 0 < gen < gen_max:
        why.append(f"PCIe gen {gen} of {gen_max}")
    if sample.get("retire_pending"):
        why.append("memory repair pending a reset")
    if not why and sample.get("healthy", True) is False:
        why.append("the agent reports it unhealthy")
    return Verdict(H.DEGRADED, ", ".join(why)[:200]) if why else OK


def samples_clean(samples: Iterable[Mapping[str, Any]]) -> bool:
    """Whether no sample shows anything wrong: an idle heartbeat then needs no health work,
    unless the node has DEGRADED GPUs that may have recovered."""
    return all(sample_verdict(s) is OK for s in samples)


def verdicts_by_index(samples: Iterable[Mapping[str, Any]]) -> dict[int, Verdict]:
    """GPU index -> the worst verdict among its samples in one heartbeat."""
    worst: dict[int, Verdict] = {}
    for sample in samples:
        index = sample.get("gpu_index")
        verdict = sample_verdict(sample)
        if index not in worst or _RANK[verdict.health] > _RANK[worst[index].health]:
            worst[index] = verdict
    return worst


def _change(gpu: Gpu, to: str, reason: str, now: datetime) -> GpuHealthEvent:
    event = GpuHealthEvent.objects.create(
        gpu=gpu,
        node_id=gpu.node_id,
        from_health=gpu.health,
        to_health=to,
        reason=reason,
    )
    gpu.health, gpu.health_reason, gpu.health_since = to, reason, now
    gpu.save(update_fields=["health", "health_reason", "health_since"])
    return event


def gpus_health_apply(*, node: Node, verdicts: Mapping[int, Verdict], now: datetime) -> list[Gpu]:
    """Fold one heartbeat's verdicts into the node's GPUs, in the caller's transaction; returns
    the GPUs that failed now (their rentals ended, the provider told, a check asked for)."""
    if not verdicts:
        return []
    # Most heartbeats change nothing: read the GPUs that are not OK without a lock, and lock
    # (and write) only when a verdict differs from what is stored.
    stored = {
        index: (health, reason)
        for index, health, reason in Gpu.objects.filter(node=node)
        .exclude(health=H.OK)
        .values_list("index", "health", "health_reason")
    }
    if all(
        stored.get(index, (H.OK, ""))[0] == H.FAILED
        or stored.get(index, (H.OK, "")) == (verdict.health, verdict.reason)
        for index, verdict in verdicts.items()
    ):
        return []
    gpus = list(
        Gpu.objects.select_for_update(of=("self",))
        .filter(node=node, index__in=list(verdicts))
        .order_by("index")
    )
    failed = []
    for gpu in gpus:
        verdict = verdicts[gpu.index]
        if gpu.health == H.FAILED:
            continue  # back only after a passing check
        if verdict.health == H.FAILED:
            event = _change(gpu, H.FAILED, verdict.reason, now)
            failed.append((gpu, event))
        elif verdict.health != gpu.health or verdict.reason != gpu.health_reason:
            _change(gpu, verdict.health, verdict.reason, now)
    for gpu, event in failed:
        log.warning("GPU failed node=%s gpu=%s: %s", node.pk, gpu.index, event.reason)
        _rentals_end(node=node, gpu=gpu, reason=event.reason, now=now)
        gpu_failed_notify(
            owner=node.provider.owner,
            event_id=event.pk,
            node_id=node.pk,
            hostname=node.hostname,
            gpu_index=gpu.index,
            reason=event.reason,
        )
    if failed:
        # The check that may bring the GPUs back (the platform's benchmark, on them).
        Node.objects.filter(pk=node.pk).update(benchmark_requested=True)
    return [gpu for gpu, _ in failed]


def _rentals_end(*, node: Node, gpu: Gpu, reason: str, now: datetime) -> None:
    """The rentals holding (or about to hold) the GPU end as a node fault: their other GPUs,
    on this node and others, are freed with it, and the node's other GPUs keep serving."""
    policy = settings.GPUMARKET.get("NODE_LOST_POLICY", "fail")
    holding = Allocation.objects.filter(
        gpu=gpu, released_at__isnull=True, during__endswith__gt=now
    ).values_list("rental_id", flat=True)
    for rental in (
        Rental.objects.select_for_update(of=("self",)).filter(pk__in=list(holding)).order_by("pk")
    ):
        requeue = policy == "requeue" or rental.kind == RentalKind.INTERRUPTIBLE
        if lifecycle.rental_mark_node_fault(
            rental=rental,
            hostname=node.hostname,
            fault=f"GPU {gpu.index} failed: {reason}",
            at=now,
            requeue=requeue,
        ):
            # Its runs are over, on every node of a multi-node rental (the others are stopped
            # by their desired state): a late report must not touch the next placement.
            ContainerRun.objects.filter(rental=rental).delete()


def failed_gpu_indices(*, node_id: int) -> tuple[int, ...]:
    """The node's FAILED GPUs, by index: where its next check runs."""
    return tuple(
        Gpu.objects.filter(node_id=node_id, health=H.FAILED)
        .order_by("index")
        .values_list("index", flat=True)
    )


def gpus_health_restore(
    *, node: Node, clean: Iterable[int], now: datetime, reason: str
) -> list[int]:
    """A check passed: the node's FAILED GPUs that reported clean in the same heartbeat are OK
    again (one still showing a fault stays out). Returns their indices."""
    restored = []
    for gpu in (
        Gpu.objects.select_for_update(of=("self",))
        .filter(node=node, health=H.FAILED, index__in=list(clean))
        .order_by("index")
    ):
        _change(gpu, H.OK, reason, now)
        restored.append(gpu.index)
    return restored


def nodes_benchmark_schedule(*, now: datetime | None = None) -> int:
    """Ask for the platform's benchmark where it is due; returns how many nodes were asked.

    - an online node with nothing allocated whose last benchmark is older than
      BENCHMARK_EVERY_S (a benchmark never contends with a rental's work);
    - a node with FAILED GPUs whose last benchmark is older than BENCHMARK_RECHECK_S: the check
      that brings them back once the host is repaired (it runs on those GPUs only)."""
    now = now or timezone.now()
    last = (
        NodeBenchmark.objects.filter(node=OuterRef("pk")).order_by("-measured_at")
        .values("measured_at")[:1]
    )  # fmt: skip
    busy = Allocation.objects.filter(
        node=OuterRef("pk"), released_at__isnull=True, during__endswith__gt=now
    )
    failed = Gpu.objects.filter(node=OuterRef("pk"), health=H.FAILED)
    every = timedelta(seconds=settings.GPUMARKET["BENCHMARK_EVERY_S"])
    recheck = timedelta(seconds=settings.GPUMARKET["BENCHMARK_RECHECK_S"])
    due = (
        Node.objects.filter(status=NodeStatus.ONLINE, benchmark_requested=False)
        .annotate(last=Subquery(last))
        .filter(
            (Q(last__isnull=True) | Q(last__lt=now - every)) & ~Exists(busy)
            | (Q(last__isnull=True) | Q(last__lt=now - recheck)) & Exists(failed)
        )
    )
    return Node.objects.filter(pk__in=due.values("pk"), benchmark_requested=False).update(
        benchmark_requested=True
    )
