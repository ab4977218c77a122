"""Periodic sweeps over nodes and rentals: silent nodes go OFFLINE (their rentals follow the
node-lost policy), booked time that has ended asks its rentals to stop, and a stop the agent
has not completed within the stop grace frees the GPUs anyway."""

from __future__ import annotations

import logging
from datetime import datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from agentprotocol import DEFAULT_STOP_GRACE_S
from marketplace import lifecycle
from marketplace.models import (
    Allocation,
    Node,
    NodeEvent,
    NodeStatus,
    Rental,
    RentalKind,
    RentalStatus,
)
from provisioning.models import ContainerRun

log = logging.getLogger(__name__)


def nodes_mark_silent(*, now: datetime | None = None) -> list[int]:
    """Nodes whose agent has been silent too long go OFFLINE; their rentals follow the policy:
    not yet started, or interruptible -> back to PENDING (re-queued elsewhere); started
    on-demand -> FAILED (their state is on the lost host) unless NODE_LOST_POLICY is "requeue"."""
    now = now or timezone.now()
    timeout = timedelta(seconds=settings.GPUMARKET["NODE_SILENCE_TIMEOUT_S"])
    policy = settings.GPUMARKET.get("NODE_LOST_POLICY", "fail")
    silent = list(
        Node.objects.filter(status__in=[NodeStatus.ONLINE, NodeStatus.DRAINING])
        .filter(Q(last_seen_at__lt=now - timeout) | Q(last_seen_at__isnull=True))
        .values_list("pk", flat=True)
    )
    for node_id in silent:
        with transaction.atomic():
            node = Node.objects.select_for_update().get(pk=node_id)
            if node.status not in (NodeStatus.ONLINE, NodeStatus.DRAINING):
                continue
            NodeEvent.objects.create(
                node=node,
                from_status=node.status,
                to_status=NodeStatus.OFFLINE,
                reason=f"no heartbeat for {int(timeout.total_seconds())} s",
            )
            node.status = NodeStatus.OFFLINE
            node.save(update_fields=["status"])
            rental_ids = (
                Allocation.objects.filter(node=node, released_at__isnull=True)
                .values_list("rental_id", flat=True)
                .distinct()
            )
            for rental in Rental.objects.select_for_update().filter(pk__in=list(rental_ids)):
                _node_lost(rental, node, now, policy)
    return silent


def _node_lost(rental: Rental, node: Node, now: datetime, policy: str) -> None:
    # An interruptible rental accepted being stopped and resumed elsewhere: it goes back to the
    # queue whatever the policy for on-demand ones.
    requeue = policy == "requeue" or rental.kind == RentalKind.INTERRUPTIBLE
    if lifecycle.rental_mark_node_lost(
        rental=rental, hostname=node.hostname, at=now, requeue=requeue
    ):
        # A gang ends (or re-queues) as one: every member's run goes, not only the lost one's,
        # so a member still running is stopped by its next desired state, its late reports are
        # no longer taken for the rental's, and a new placement on the same node gets a new run.
        runs = ContainerRun.objects.filter(rental=rental)
        (runs if rental.node_count > 1 else runs.filter(node=node)).delete()


def rentals_end_booked_time(*, now: datetime | None = None) -> int:
    """Running rentals whose booked window has ended are asked to stop (checkpoint, exit)."""
    now = now or timezone.now()
    ended = 0
    ids = list(
        Rental.objects.filter(status__in=lifecycle.BURNING, scheduled_end__lte=now).values_list(
            "pk", flat=True
        )
    )
    for rental_id in ids:
        with transaction.atomic():
            rental = Rental.objects.select_for_update().get(pk=rental_id)
            if lifecycle.rental_mark_booked_time_ended(rental=rental):
                ended += 1
    return ended


def rentals_release_stopped(*, now: datetime | None = None) -> int:
    """STOPPING rentals past the stop grace are COMPLETED and their GPUs freed at the grace's
    end: an agent that keeps reporting a stopped rental as running holds nothing."""
    now = now or timezone.now()
    grace = timedelta(seconds=DEFAULT_STOP_GRACE_S)
    released = 0
    ids = list(
        Rental.objects.filter(status=RentalStatus.STOPPING)
        .order_by("pk")
        .values_list("pk", flat=True)
    )
    for rental_id in ids:
        with transaction.atomic():
            rental = Rental.objects.select_for_update().get(pk=rental_id)
            if lifecycle.rental_stop_grace_passed(rental=rental, grace=grace, now=now):
                released += 1
    return released
