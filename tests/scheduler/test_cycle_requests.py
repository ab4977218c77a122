"""Cycle requests of a burst of creates: a create sends none while one is queued and not yet
begun, and the task that begins then covers every create that relied on it."""

import pytest
from celery.signals import before_task_publish
from django.core.cache import cache
from django.test import override_settings

from marketplace import lifecycle
from marketplace.models import Rental, RentalStatus
from scheduler import services
from scheduler.tasks import scheduler_cycle

pytestmark = pytest.mark.django_db(transaction=True)

QUEUED = lifecycle.CYCLE_QUEUED_KEY.format(pool="default")


@pytest.fixture
def requests_sent():
    """The (pool, requested_at) of every scheduler cycle message published."""
    sent: list[tuple] = []

    def record(sender=None, body=None, **_):
        if sender == lifecycle.SCHEDULER_CYCLE_TASK:
            sent.append(tuple(body[0]))

    cache.delete(QUEUED)
    before_task_publish.connect(record, weak=False)
    yield sent
    before_task_publish.disconnect(record)
    cache.delete(QUEUED)


def _pending(*rentals) -> int:
    return Rental.objects.filter(
        pk__in=[r.pk for r in rentals], status=RentalStatus.PENDING
    ).count()


def test_a_burst_sends_one_request_and_its_task_places_what_relied_on_it(
    make_node, rent, requests_sent
):
    make_node(gpus=8)
    first = rent(1)
    assert len(requests_sent) == 1
    (pool, requested_at) = requests_sent[0]
    # A cycle runs (beat's tick, another pool's worker) after that request and places the first.
    services.scheduler_cycle_run(pool=pool)
    assert _pending(first) == 0
    # Creates while the request is still queued send nothing of their own...
    later = [rent(1), rent(2)]
    assert len(requests_sent) == 1
    assert _pending(*later) == 2
    # ...and its task, although a snapshot newer than its request ran, is not dropped: it
    # places them.
    scheduler_cycle(pool, requested_at)
    assert _pending(*later) == 0
    # Once that task began, the next create sends a request again.
    rent(1)
    assert len(requests_sent) == 2


def test_a_request_no_create_relied_on_is_dropped_when_a_later_snapshot_covers_it(
    make_node, rent, requests_sent
):
    make_node(gpus=8)
    first = rent(1)
    (pool, requested_at) = requests_sent[0]
    lifecycle.cycle_request_begin(pool)  # another task of the pool began first
    services.scheduler_cycle_run(pool=pool)
    assert _pending(first) == 0
    snapshot_at = services.last_snapshot_at(pool)
    scheduler_cycle(pool, requested_at)
    # Dropped: no cycle read the pool again.
    assert services.last_snapshot_at(pool) == snapshot_at
    # Without a request behind it, a task still runs a cycle.
    scheduler_cycle(pool)
    assert services.last_snapshot_at(pool) > snapshot_at


# A Redis nobody listens on: every cache call fails at once.
CACHE_DOWN = {
    "default": {
        "BACKEND": "config.cache.RedisCache",
        "LOCATION": "redis://127.0.0.1:1/0",
        "OPTIONS": {"socket_timeout": 0.2, "socket_connect_timeout": 0.2},
    }
}


def test_with_the_cache_down_creates_still_send_requests_and_cycles_still_place(
    make_node, rent, requests_sent
):
    make_node(gpus=8)
    with override_settings(CACHES=CACHE_DOWN):
        rentals = [rent(1), rent(1)]
        # No flag to read: each create sends its own request.
        assert len(requests_sent) == 2
        (pool, requested_at) = requests_sent[0]
        scheduler_cycle(pool, requested_at)
        assert _pending(*rentals) == 0
