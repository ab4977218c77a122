"""Node reliability, measured from the last 30 days of history rather than declared.

Three observations per node:
- uptime = time ONLINE or DRAINING (heartbeating: a silent node is marked OFFLINE) over time
  listed (every status but MAINTENANCE, which the provider announced), from the node's status
  events; an ONLINE node whose last heartbeat is older than the silence timeout is down since;
- survival = 1 - failed / ran: of the rentals handed to the node in the window, those that
  ended by the node's fault (it went silent, it could not start the container for a reason of
  its own, the container disappeared from it, a GPU it held failed): never a customer's image or
  command that fails, so a customer cannot lower a provider's score;
- GPU health = 1 - the share of its GPU-time in the window its GPUs spent FAILED (out of
  placement), from their health history (GpuHealthEvent).

    observed = uptime x survival x GPU health
    w        = H / (H + H0)          H: listed hours in the window, H0 = PRIOR_HOURS
    score    = (1 - w) x declared + w x observed

A Bayesian blend: the declared figure is a prior worth H0 hours of record, so a new node shows
what its provider declared and a node with a month of history shows mostly what it did.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from decimal import Decimal

from django.db import transaction
from django.db.models import Count, Exists, OuterRef, Q
from django.utils import timezone

from marketplace.models import (
    Allocation,
    EndCause,
    Gpu,
    GpuHealth,
    GpuHealthEvent,
    Node,
    NodeEvent,
    NodeStatus,
    RentalEvent,
    RentalStatus,
)

WINDOW = timedelta(days=30)
PRIOR_HOURS = 72.0
_UP = frozenset({NodeStatus.ONLINE, NodeStatus.DRAINING})
_LISTED = frozenset(NodeStatus) - {NodeStatus.MAINTENANCE}


def _runs_by_node(*, since: datetime, now: datetime):
    """Per node: the rentals it held in [since, now] once handed over (provisioning), and of
    those the ones that ended (or were re-queued) by its fault since `since`: an event whose
    cause is NODE (marketplace.lifecycle.rental_end_for_node_fault), naming the node and
    recorded when the node's GPUs were freed. A customer's image or command that fails, or a
    stop, a preemption or an expiry, never counts."""
    minute = timedelta(minutes=1)
    by_the_node = RentalEvent.objects.filter(
        rental_id=OuterRef("rental_id"),
        created_at__gte=since,
        cause=EndCause.NODE,
        reason__contains=OuterRef("node__hostname"),
    ).filter(
        created_at__gte=OuterRef("released_at") - minute,
        created_at__lte=OuterRef("released_at") + minute,
    )
    handed_over = RentalEvent.objects.filter(
        rental_id=OuterRef("rental_id"), to_status=RentalStatus.PROVISIONING
    )
    return (
        Allocation.objects.filter(during__endswith__gt=since, during__startswith__lte=now)
        .filter(Exists(handed_over))
        .values("node_id")
        .annotate(
            ran=Count("rental_id", distinct=True),
            failed=Count("rental_id", distinct=True, filter=Q(Exists(by_the_node))),
        )
    )


def _uptime(
    node: Node, events: list[NodeEvent], since: datetime, now: datetime, silence: timedelta
) -> tuple[float, float]:
    """(seconds up, seconds listed) in [since, now], walking the status changes."""
    at = max(since, node.created_at)
    status = events[0].from_status if events else node.status
    up = listed = 0.0
    for event in [*events, None]:
        until = now if event is None else max(at, event.created_at)
        if event is None and node.last_seen_at is not None:
            heard_until = min(now, max(at, node.last_seen_at + silence))
        else:
            heard_until = until
        if status in _LISTED:
            listed += (until - at).total_seconds()
        if status in _UP:
            up += (min(until, heard_until) - at).total_seconds()
        if event is not None:
            at, status = until, event.to_status
    return up, listed


def _gpus_failed_s(*, since: datetime, now: datetime) -> dict[int, float]:
    """Per node: the GPU-seconds in [since, now] its GPUs spent FAILED, walking each GPU's
    health changes (a GPU failed before the window and still failed counts all of it)."""
    by_gpu: dict[int, list[GpuHealthEvent]] = {}
    for event in GpuHealthEvent.objects.filter(created_at__gt=since, created_at__lte=now).order_by(
        "gpu_id", "created_at", "id"
    ):
        by_gpu.setdefault(event.gpu_id, []).append(event)
    failed_s: dict[int, float] = {}
    for events in by_gpu.values():
        at, health = since, events[0].from_health
        for event in [*events, None]:
            until = now if event is None else event.created_at
            if health == GpuHealth.FAILED:
                node_id = events[0].node_id
                failed_s[node_id] = failed_s.get(node_id, 0.0) + (until - at).total_seconds()
            if event is not None:
                at, health = until, event.to_health
    # Failed since before the window, with no change in it.
    for node_id in (
        Gpu.objects.filter(health=GpuHealth.FAILED, health_since__lte=since)
        .exclude(pk__in=list(by_gpu))
        .values_list("node_id", flat=True)
    ):
        failed_s[node_id] = failed_s.get(node_id, 0.0) + (now - since).total_seconds()
    return failed_s


def reliability_score(
    *,
    declared: float,
    up_s: float,
    listed_s: float,
    ran: int,
    failed: int,
    gpu_failed_share: float = 0.0,
) -> float:
    """The blend of the module docstring, in [0, 1]. `gpu_failed_share`: the share of the
    node's GPU-time its GPUs spent FAILED."""
    hours = listed_s / 3600
    uptime = up_s / listed_s if listed_s > 0 else 1.0
    survival = 1 - failed / ran if ran else 1.0
    gpu_health = 1 - min(1.0, max(0.0, gpu_failed_share))
    weight = hours / (hours + PRIOR_HOURS)
    observed = uptime * survival * gpu_health
    return min(1.0, max(0.0, (1 - weight) * declared + weight * observed))


def nodes_reliability_update(*, now: datetime | None = None) -> int:
    """Recompute every node's reliability from its history; returns the nodes whose score
    changed. Reads first, then one short transaction of updates."""
    now = now or timezone.now()
    since = now - WINDOW
    nodes = list(
        Node.objects.only(
            "id", "status", "created_at", "last_seen_at", "heartbeat_interval_s", "reliability",
            "reliability_declared", "reliability_observed_hours", "gpu_count",
        )
    )  # fmt: skip
    gpus_failed_s = _gpus_failed_s(since=since, now=now)
    events: dict[int, list[NodeEvent]] = {}
    for event in NodeEvent.objects.filter(created_at__gt=since, created_at__lte=now).order_by(
        "node_id", "created_at", "id"
    ):
        events.setdefault(event.node_id, []).append(event)
    runs = {
        row["node_id"]: (row["ran"], row["failed"]) for row in _runs_by_node(since=since, now=now)
    }
    changed = []
    for node in nodes:
        silence = timedelta(seconds=node.silence_timeout_s())
        up, listed = _uptime(node, events.get(node.pk, []), since, now, silence)
        ran, failed = runs.get(node.pk, (0, 0))
        span_s = (now - max(since, node.created_at)).total_seconds()
        gpu_s = node.gpu_count * span_s
        score = reliability_score(
            declared=float(node.reliability_declared),
            up_s=up,
            listed_s=listed,
            ran=ran,
            failed=failed,
            gpu_failed_share=gpus_failed_s.get(node.pk, 0.0) / gpu_s if gpu_s > 0 else 0.0,
        )
        measured = Decimal(f"{score:.4f}")
        hours = round(listed / 3600, 2)
        if (measured, hours) != (node.reliability, node.reliability_observed_hours):
            node.reliability, node.reliability_observed_hours = measured, hours
            changed.append(node)
    with transaction.atomic():
        Node.objects.bulk_update(
            changed, ["reliability", "reliability_observed_hours"], batch_size=1000
        )
    return len(changed)
