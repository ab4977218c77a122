"""Scheduler cycles on real PostgreSQL: each policy with hand-computed placements."""

from datetime import timedelta

import pytest
from django.utils import timezone

from marketplace.models import Allocation, Rental, RentalEvent, RentalStatus
from scheduler.services import scheduler_cycle_run
from tests.scheduler.conftest import soon

pytestmark = pytest.mark.django_db


def _gpus(rental):
    """(hostname, [gpu indices]) per node of the rental's active allocations."""
    rows = (
        Allocation.objects.filter(rental=rental, released_at__isnull=True)
        .order_by("node_id", "gpu__index")
        .values_list("node__hostname", "gpu__index")
    )
    out: dict[str, list[int]] = {}
    for host, index in rows:
        out.setdefault(host, []).append(index)
    return out


def _status(rental):
    rental.refresh_from_db()
    return rental.status


def test_packing_fills_the_partly_used_node_and_keeps_the_empty_one_whole(make_node, rent):
    make_node(hostname="busy", price="1.00")
    make_node(hostname="empty", price="1.00")
    first = rent(6, gpu_models=("a100-sxm4-80gb",))
    scheduler_cycle_run()
    host = next(iter(_gpus(first)))
    assert _gpus(first) == {host: [0, 1, 2, 3, 4, 5]}
    second = rent(2)
    scheduler_cycle_run()
    # Best fit: the node with 2 free GPUs, not the empty 8-GPU node.
    assert _gpus(second) == {host: [6, 7]}
    assert _status(second) == RentalStatus.SCHEDULED
    second.refresh_from_db()
    assert second.price_per_gpu_hour == 1
    assert list(second.events.values_list("from_status", "to_status", "actor_kind")) == [
        ("", "pending", "customer"),
        ("pending", "scheduled", "scheduler"),
    ]


def test_topology_keeps_a_same_group_request_inside_one_nvlink_island(make_node, rent):
    make_node(hostname="nvl", nvlink=True, group_size=4)
    rent(2)  # takes GPUs 0 and 1 of group g0
    scheduler_cycle_run()
    island = rent(4, same_group=True)
    scheduler_cycle_run()
    assert _gpus(island) == {"nvl": [4, 5, 6, 7]}


def test_price_and_reliability_order_between_equal_fits(make_node, rent):
    # Score points (lower wins): 1 per cent of price, 2 per 0.1 % of unreliability.
    # dear: 200 + 2 * 10 = 220; cheap: 100 + 2 * 20 = 140; flaky: 90 + 2 * 100 = 290.
    make_node(hostname="dear", price="2.00", reliability="0.99")
    make_node(hostname="cheap", price="1.00", reliability="0.98")
    make_node(hostname="flaky", price="0.90", reliability="0.90")
    r = rent(8)
    scheduler_cycle_run()
    assert _gpus(r) == {"cheap": list(range(8))}
    r.refresh_from_db()
    assert r.price_per_gpu_hour == 1
    second = rent(8)
    scheduler_cycle_run()
    assert _gpus(second) == {"dear": list(range(8))}


def test_future_start_is_booked_as_a_reservation(make_node, rent):
    make_node(hostname="n")
    start = soon(hours=2)
    r = rent(8, start_at=start, duration_s=1800)
    scheduler_cycle_run()
    assert _status(r) == RentalStatus.SCHEDULED
    alloc = Allocation.objects.filter(rental=r).first()
    assert abs((alloc.during.lower - start).total_seconds()) < 0.001
    assert (alloc.during.upper - alloc.during.lower) == timedelta(seconds=1800)


def test_backfill_uses_reserved_gpus_only_when_it_ends_before_the_reservation(make_node, rent):
    make_node(hostname="n")
    reserved = rent(8, start_at=soon(hours=1), duration_s=3600)
    scheduler_cycle_run()
    assert _status(reserved) == RentalStatus.SCHEDULED
    short = rent(8, duration_s=1800)  # ends 30 min before the reservation starts
    long = rent(8, duration_s=7200)
    scheduler_cycle_run()
    assert _status(short) == RentalStatus.SCHEDULED
    assert _gpus(short) == {"n": list(range(8))}
    assert _status(long) == RentalStatus.PENDING
    long.refresh_from_db()
    assert long.status_reason and "placed" not in long.status_reason


def test_on_demand_preempts_the_lowest_bid_interruptible_rental(make_node, rent):
    make_node(hostname="a", price="1.00", min_bid="0.20", gpus=4)
    make_node(hostname="b", price="1.00", min_bid="0.20", gpus=4)
    low = rent(4, kind="interruptible", bid_per_gpu_hour="0.30", preemption_policy="end")
    high = rent(4, kind="interruptible", bid_per_gpu_hour="0.60")
    scheduler_cycle_run()
    low_host = next(iter(_gpus(low)))
    assert _status(high) == RentalStatus.SCHEDULED
    demand = rent(4)
    scheduler_cycle_run()
    assert _status(low) == RentalStatus.PREEMPTED
    assert _status(high) == RentalStatus.SCHEDULED
    assert _gpus(demand) == {low_host: [0, 1, 2, 3]}
    assert _gpus(low) == {}
    event = RentalEvent.objects.filter(rental=low, to_status=RentalStatus.PREEMPTED).get()
    assert event.actor_kind == "scheduler" and event.reason


def test_no_preemption_when_the_request_still_would_not_fit(make_node, rent):
    make_node(hostname="a", gpus=4, min_bid="0.20")
    make_node(hostname="b", gpus=4, min_bid="0.20")
    spot = rent(4, kind="interruptible", bid_per_gpu_hour="0.30")
    fixed = rent(4)
    scheduler_cycle_run()
    assert {_status(spot), _status(fixed)} == {RentalStatus.SCHEDULED}
    big = rent(4, node_count=2)  # would need both nodes; the on-demand one never moves
    scheduler_cycle_run()
    assert _status(spot) == RentalStatus.SCHEDULED
    assert _status(big) == RentalStatus.PENDING
    assert _gpus(big) == {}


def test_gang_is_all_nodes_or_none(make_node, rent):
    make_node(hostname="a", gpus=4)
    make_node(hostname="b", gpus=4)
    make_node(hostname="c", gpus=4)
    blocker = rent(4)
    scheduler_cycle_run()
    gang = rent(4, node_count=2)
    scheduler_cycle_run()
    placed = _gpus(gang)
    assert len(placed) == 2 and all(v == [0, 1, 2, 3] for v in placed.values())
    assert next(iter(_gpus(blocker))) not in placed
    second = rent(4, node_count=2)
    scheduler_cycle_run()
    assert _status(second) == RentalStatus.PENDING
    assert _gpus(second) == {}


def test_pending_rental_expires_at_its_deadline_with_the_reason(make_node, rent):
    make_node(hostname="a", gpus=4)
    hog = rent(4)
    scheduler_cycle_run()
    waiting = rent(4, start_deadline=soon(minutes=10))
    scheduler_cycle_run()
    assert _status(waiting) == RentalStatus.PENDING
    past = timezone.now() - timedelta(seconds=1)
    Rental.objects.filter(pk=waiting.pk).update(start_at=past, start_deadline=past)
    scheduler_cycle_run()
    waiting.refresh_from_db()
    assert waiting.status == RentalStatus.EXPIRED
    assert waiting.status_reason
    assert _status(hog) == RentalStatus.SCHEDULED
    assert not Allocation.objects.filter(rental=waiting).exists()


def test_a_cycle_skips_when_another_holds_the_pool_lock(make_node, rent):
    from scheduler.services import pool_lock

    make_node()
    r = rent(1)
    with pool_lock("default") as got:
        assert got
        # Same connection would re-enter a session lock, so take it from another thread.
        import threading

        out = {}

        def other():
            from django.db import connection

            out["result"] = scheduler_cycle_run()
            connection.close()

        t = threading.Thread(target=other)
        t.start()
        t.join()
    assert out["result"].ran is False
    assert _status(r) == RentalStatus.PENDING
