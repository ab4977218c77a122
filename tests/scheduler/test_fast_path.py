"""The fast round (a small queue placed from its candidate nodes only): it never double books
or loses a rental, even run twice at once without the pool lock, and it hands anything it
cannot place to a full round that says why."""

import threading
from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone

from marketplace.models import Allocation, Rental, RentalStatus
from scheduler import services
from scheduler.engine import planner
from tests.scheduler.test_concurrency import OVERLAPS_SQL, _in_thread

pytestmark = pytest.mark.django_db(transaction=True)


def test_two_fast_rounds_at_once_on_one_node_never_overlap_and_lose_nothing(make_node, rent):
    node = make_node(hostname="only", gpus=4)
    rentals = [rent(1) for _ in range(6)]
    barrier = threading.Barrier(2)
    errors: list[Exception] = []

    def fast_round():
        barrier.wait()
        # Without the pool lock on purpose: only the exclusion constraint stands between them.
        services._fast_round(
            pool="default",
            now=timezone.now(),
            policy=planner.DEFAULT_POLICY,
            result=services.CycleResult(),
        )

    threads = [_in_thread(fast_round, errors) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    services.scheduler_cycle_run()

    with connection.cursor() as cursor:
        cursor.execute(OVERLAPS_SQL)
        assert cursor.fetchone()[0] == 0
    placed = Rental.objects.filter(status=RentalStatus.SCHEDULED)
    assert placed.count() == 4
    assert Allocation.objects.filter(node=node, released_at__isnull=True).count() == 4
    for rental in Rental.objects.filter(pk__in=[r.pk for r in rentals]):
        held = Allocation.objects.filter(rental=rental, released_at__isnull=True).count()
        if rental.status == RentalStatus.SCHEDULED:
            assert held == 1
        else:
            assert rental.status == RentalStatus.PENDING
            assert held == 0
            assert "no capacity" in rental.status_reason


def test_a_small_queue_is_placed_by_a_fast_round_best_fit(make_node, rent):
    make_node(hostname="big", gpus=8)
    small = make_node(hostname="small", gpus=2)
    rental = rent(2)
    result = services.scheduler_cycle_run()
    assert (result.fast_rounds, result.placed) == (1, 1)
    assert set(Allocation.objects.filter(rental=rental).values_list("node", flat=True)) == {
        small.pk
    }


def test_what_the_candidates_cannot_take_goes_to_a_full_round_with_its_reason(make_node, rent):
    make_node(hostname="n", gpus=4)
    first = rent(4)
    services.scheduler_cycle_run()
    second = rent(4, start_deadline=timezone.now() + timedelta(hours=3))
    result = services.scheduler_cycle_run()
    assert result.fast_rounds == 0
    assert result.rounds == 1
    second.refresh_from_db()
    assert second.status == RentalStatus.PENDING
    assert "no capacity" in second.status_reason
    assert Allocation.objects.filter(rental=second).count() == 0
    assert Rental.objects.get(pk=first.pk).status == RentalStatus.SCHEDULED


def test_a_request_that_finds_the_pool_locked_is_left_for_the_holder(make_node, rent):
    make_node(hostname="n", gpus=4)
    held, release = threading.Event(), threading.Event()
    errors: list[Exception] = []

    def holder():
        with services.pool_lock("default") as got:
            assert got
            held.set()
            release.wait(30)

    thread = _in_thread(holder, errors)
    thread.start()
    assert held.wait(30)
    rental = rent(1)
    result = services.scheduler_cycle_run()
    release.set()
    thread.join()
    assert errors == []
    assert not result.ran
    assert Rental.objects.get(pk=rental.pk).status == RentalStatus.PENDING
    # The request left its mark: the holder, letting the lock go, runs again for it.
    assert services._wanted_take("default")
