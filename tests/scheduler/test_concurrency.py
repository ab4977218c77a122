"""Double booking cannot happen: parallel creates, two scheduler workers, real PostgreSQL."""

import random
import threading
from datetime import timedelta

import pytest
from django.db import connection, connections
from django.utils import timezone

from marketplace.models import Allocation, Gpu, Rental, RentalStatus
from scheduler.engine import types as engine
from scheduler.services import allocation_bind, scheduler_cycle_run

pytestmark = pytest.mark.django_db(transaction=True)

OVERLAPS_SQL = """
    SELECT count(*) FROM marketplace_allocation a
    JOIN marketplace_allocation b
      ON a.gpu_id = b.gpu_id AND a.id < b.id AND a.during && b.during
    WHERE a.released_at IS NULL AND b.released_at IS NULL
"""


def _in_thread(fn, errors):
    def run():
        try:
            fn()
        except Exception as exc:  # surfaced by the test below
            errors.append(exc)
        finally:
            connections.close_all()

    return threading.Thread(target=run)


def test_parallel_creates_and_two_schedulers_never_double_book(make_node, rent):
    for i in range(8):
        make_node(hostname=f"n{i}", gpus=8)
    assert Gpu.objects.count() == 64
    rng = random.Random(3)
    sizes = [rng.choice([1, 1, 2]) for _ in range(200)]
    assert sum(sizes) > 64
    errors: list[Exception] = []
    creating = threading.Event()
    creating.set()

    def creator(chunk):
        def run():
            for size in chunk:
                rent(size, start_deadline=timezone.now() + timedelta(hours=1))

        return run

    def scheduler():
        while creating.is_set():
            scheduler_cycle_run()
        scheduler_cycle_run()

    creators = [_in_thread(creator(sizes[i::8]), errors) for i in range(8)]
    schedulers = [_in_thread(scheduler, errors) for _ in range(2)]
    for t in schedulers + creators:
        t.start()
    for t in creators:
        t.join()
    creating.clear()
    for t in schedulers:
        t.join()
    assert errors == []
    scheduler_cycle_run()

    with connection.cursor() as cursor:
        cursor.execute(OVERLAPS_SQL)
        assert cursor.fetchone()[0] == 0
        now = timezone.now()
        cursor.execute(
            "SELECT count(DISTINCT gpu_id) FROM marketplace_allocation"
            " WHERE released_at IS NULL AND during @> %s::timestamptz",
            [now],
        )
        assert cursor.fetchone()[0] == 64
    rentals = list(Rental.objects.all())
    assert len(rentals) == 200
    for rental in rentals:
        held = Allocation.objects.filter(rental=rental, released_at__isnull=True).count()
        if rental.status == RentalStatus.SCHEDULED:
            assert held == rental.gpus_per_node
        else:
            assert rental.status in (RentalStatus.PENDING, RentalStatus.EXPIRED)
            assert held == 0
            assert rental.status_reason not in ("", "waiting for the scheduler")


def test_two_concurrent_binds_of_the_same_gpus_one_wins(make_node, rent):
    node = make_node(hostname="n", gpus=4)
    gpu_ids = tuple(node.gpus.order_by("index").values_list("id", flat=True))
    a, b = rent(4), rent(4)
    now = timezone.now()
    barrier = threading.Barrier(2)
    results: dict[str, tuple] = {}
    errors: list[Exception] = []

    def bind(rental):
        def run():
            placement = engine.Placement(
                rental_id=rental.pk,
                start=now.timestamp(),
                end=now.timestamp() + 3600,
                price_per_gpu_hour=node.price_per_gpu_hour,
                nodes=((node.pk, gpu_ids),),
            )
            barrier.wait()
            results[str(rental.pk)] = allocation_bind(placements=[placement], now=now)

        return run

    threads = [_in_thread(bind(r), errors) for r in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    outcomes = sorted((len(bound), len(conflicts)) for bound, conflicts in results.values())
    assert outcomes == [(0, 1), (1, 0)]
    statuses = sorted(Rental.objects.values_list("status", flat=True))
    assert statuses == [RentalStatus.PENDING, RentalStatus.SCHEDULED]
    assert Allocation.objects.count() == 4
    with connection.cursor() as cursor:
        cursor.execute(OVERLAPS_SQL)
        assert cursor.fetchone()[0] == 0
