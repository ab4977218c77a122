"""Re-queued rentals: a preempted interruptible rental whose preemption policy is requeue (the
default for one that checkpoints), and one whose node was lost, wait for GPUs again with a fresh
start window and are placed again."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from marketplace.models import Rental, RentalEvent, RentalStatus
from provisioning.services import nodes_mark_silent
from scheduler.services import scheduler_cycle_run

pytestmark = pytest.mark.django_db


def _status(rental) -> str:
    rental.refresh_from_db()
    return rental.status


def test_a_preempted_interruptible_rental_is_requeued_and_placed_again(make_node, rent, settings):
    settings.GPUMARKET = {**settings.GPUMARKET, "PREEMPTION_POLICY": "requeue"}
    make_node(hostname="a", price="1.00", min_bid="0.20", gpus=4)
    spot = rent(4, kind="interruptible", bid_per_gpu_hour="0.30")
    scheduler_cycle_run()
    assert _status(spot) == RentalStatus.SCHEDULED
    # when an on-demand rental takes its GPUs
    demand = rent(4)
    scheduler_cycle_run()
    # then it waits again, unplaced, with a start window from now
    assert _status(demand) == RentalStatus.SCHEDULED
    assert _status(spot) == RentalStatus.PENDING
    assert (spot.scheduled_start, spot.price_per_gpu_hour) == (None, None)
    assert spot.start_deadline > timezone.now() + timedelta(minutes=50)
    event = spot.events.order_by("-id").first()
    assert (event.from_status, event.to_status) == ("scheduled", "pending")
    assert "re-queued" in event.reason and event.actor_kind == "scheduler"
    assert not RentalEvent.objects.filter(rental=spot, to_status=RentalStatus.PREEMPTED).exists()
    # and it is placed again when GPUs free up elsewhere
    make_node(hostname="b", price="1.00", min_bid="0.20", gpus=4)
    scheduler_cycle_run()
    assert _status(spot) == RentalStatus.SCHEDULED


@pytest.mark.parametrize("how", ["setting", "chosen at create"])
def test_under_the_end_policy_a_preempted_rental_ends(make_node, rent, settings, how):
    make_node(hostname="a", price="1.00", min_bid="0.20", gpus=4)
    if how == "setting":
        settings.GPUMARKET = {**settings.GPUMARKET, "PREEMPTION_POLICY": "end"}
        spot = rent(4, kind="interruptible", bid_per_gpu_hour="0.30")
    else:
        spot = rent(4, kind="interruptible", bid_per_gpu_hour="0.30", preemption_policy="end")
    scheduler_cycle_run()
    rent(4)
    scheduler_cycle_run()
    assert _status(spot) == RentalStatus.PREEMPTED
    assert spot.end_cause == "preemption"


def test_by_default_a_preempted_harness_rental_is_requeued(make_node, rent):
    # The harness checkpoints: by default its rental resumes instead of ending
    make_node(hostname="a", price="1.00", min_bid="0.20", gpus=4)
    spot = rent(4, kind="interruptible", bid_per_gpu_hour="0.30")
    assert spot.preemption_policy == "requeue"
    scheduler_cycle_run()
    rent(4)
    scheduler_cycle_run()
    assert _status(spot) == RentalStatus.PENDING


def test_a_rental_requeued_after_its_first_deadline_is_not_expired(make_node, rent):
    node = make_node(hostname="a", price="1.00", min_bid="0.20", gpus=4)
    spot = rent(4, kind="interruptible", bid_per_gpu_hour="0.30")
    scheduler_cycle_run()
    assert _status(spot) == RentalStatus.SCHEDULED
    # given a rental that started long ago: its first start window has passed
    past = timezone.now() - timedelta(hours=5)
    Rental.objects.filter(pk=spot.pk).update(start_at=past, start_deadline=past)
    # when its node is lost, it is re-queued, and another node is there
    type(node).objects.filter(pk=node.pk).update(last_seen_at=past)
    nodes_mark_silent()
    assert _status(spot) == RentalStatus.PENDING
    make_node(hostname="b", price="1.00", min_bid="0.20", gpus=4)
    scheduler_cycle_run()
    # then it is placed again, not expired
    assert _status(spot) == RentalStatus.SCHEDULED
