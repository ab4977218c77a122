"""Periodic sweeps over nodes and rentals: silent nodes go OFFLINE (their rentals follow the
node-lost policy), booked time that has ended asks its rentals to stop, and a stop the agent
has not completed within the stop grace frees the GPUs anyway."""

from __future__ import annotations

import logging
from datetime import datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import DateTimeField, DurationField, ExpressionWrapper, F, Q, Value
from django.db.models.functions import Greatest
from django.utils import timezone

from agentprotocol import DEFAULT_STOP_GRACE_S
from core.locks import advisory_lock
from marketplace import lifecycle
from marketplace.models import (
    Allocation,
    Node,
    NodeEvent,
    NodeStatus,
    Rental,
    RentalKind,
    RentalStatus,
    silence_timeout_s,
)
from provisioning.models import ContainerRun
from provisioning.services.refusals import refused_silence_floor_s

log = logging.getLogger(__name__)


def nodes_mark_silent(*, now: datetime | None = None) -> list[int]:
    """Nodes whose agent has been silent too long go OFFLINE; their rentals follow the policy:
    not yet started, or interruptible -> back to PENDING (re-queued elsewhere); started
    on-demand -> FAILED (their state is on the lost host) unless NODE_LOST_POLICY is "requeue".

    Too long is the node's own silence timeout: three of the intervals it was last asked to
    heartbeat at, at least NODE_SILENCE_TIMEOUT_S, and, while the web tier refuses heartbeats,
    at least three of the intervals the refused were told (provisioning.services.refusals): a
    refused heartbeat writes nothing, and the server's own overload is no node's silence. One
    sweep runs at a time (a second one returns at once), the nodes that hold nothing go together
    in one transaction, and a node whose row a heartbeat holds is skipped: it is not silent."""
    now = now or timezone.now()
    policy = settings.GPUMARKET.get("NODE_LOST_POLICY", "fail")
    with advisory_lock("provisioning:nodes_mark_silent") as mine:
        if not mine:
            return []
        floor = refused_silence_floor_s(now=now.timestamp())
        silent = list(_silent(now, floor).values_list("pk", flat=True))
        if not silent:
            return []
        holding = set(
            Allocation.objects.filter(node_id__in=silent, released_at__isnull=True).values_list(
                "node_id", flat=True
            )
        )
        marked = _mark_offline(now, [pk for pk in silent if pk not in holding], floor)
        for node_id in sorted(holding):
            with transaction.atomic():
                node = (
                    _silent(now, floor)
                    .select_for_update(skip_locked=True)
                    .filter(pk=node_id)
                    .first()
                )
                if node is None:
                    continue
                _mark_offline(now, [node.pk], floor)
                rental_ids = (
                    Allocation.objects.filter(node=node, released_at__isnull=True)
                    .values_list("rental_id", flat=True)
                    .distinct()
                )
                for rental in Rental.objects.select_for_update().filter(pk__in=list(rental_ids)):
                    _node_lost(rental, node, now, policy)
                marked.append(node.pk)
    return sorted(marked)


def _silent(now: datetime, floor_s: int = 0):
    """The listed nodes (ONLINE, DRAINING) not heard from within their silence timeout, or
    within `floor_s` if that is longer."""
    timeout = max(settings.GPUMARKET["NODE_SILENCE_TIMEOUT_S"], floor_s)
    silence = Greatest(Value(timeout), F("heartbeat_interval_s") * 3) * Value(
        timedelta(seconds=1), output_field=DurationField()
    )
    return (
        Node.objects.filter(status__in=[NodeStatus.ONLINE, NodeStatus.DRAINING])
        .alias(heard_until=ExpressionWrapper(F("last_seen_at") + silence, DateTimeField()))
        .filter(Q(heard_until__lt=now) | Q(last_seen_at__isnull=True))
    )


def _mark_offline(now: datetime, node_ids: list[int], floor_s: int = 0) -> list[int]:
    """Take the nodes among `node_ids` still silent OFFLINE, with their events, in one
    transaction (the caller's, if it holds one); returns those taken."""
    if not node_ids:
        return []
    with transaction.atomic():
        rows = list(
            _silent(now, floor_s)
            .select_for_update(skip_locked=True)
            .filter(pk__in=node_ids)
            .values_list("pk", "status", "heartbeat_interval_s")
        )
        NodeEvent.objects.bulk_create(
            NodeEvent(
                node_id=pk,
                from_status=status,
                to_status=NodeStatus.OFFLINE,
                reason=f"no heartbeat for {max(silence_timeout_s(interval), floor_s)} s",
            )
            for pk, status, interval in rows
        )
        Node.objects.filter(pk__in=[pk for pk, _, _ in rows]).update(status=NodeStatus.OFFLINE)
    return [pk for pk, _, _ in rows]


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
