"""A forging or broken agent against metering: whatever it reports, through the service the
heartbeat calls or through the agent API itself, no billed GPU-second lies outside the
allocation held on its node and the rental's running interval.

The bound is computed here, independently of the rating SQL, from the rows: for each GPU
allocated to the rental on the node, |allocation range ∩ running|, where running is each
RUNNING episode of the rental's events up to the next move (a stop counts for the stop grace
at most) and never past the rental's ended_at."""

# The billing suite's fixtures are imported below, so test arguments "redefine" them.
# ruff: noqa: F811

from __future__ import annotations

import math
import uuid
from datetime import datetime, timedelta
from decimal import Decimal

import pytest
from django.db import transaction
from django.db.models import Sum
from django.utils import timezone
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rest_framework.test import APIClient

from agentprotocol import DEFAULT_STOP_GRACE_S
from billing.models import EntryKind, LedgerEntry, UsageMeter, UsageSegment
from billing.services import UsageReport, billing_pass_run, usage_reports_apply
from marketplace import lifecycle
from marketplace.models import Allocation, Node, Rental, RentalEvent, RentalStatus
from tests.billing.conftest import (  # noqa: F401 - the billing suite's fixtures
    _funds_check_on,
    book,
    book_many,
    fund,
)

pytestmark = pytest.mark.django_db

S = RentalStatus
GRACE = timedelta(seconds=DEFAULT_STOP_GRACE_S)


# --- the bound, from the rows -------------------------------------------------------------------


def _running(rental: Rental) -> list[tuple[datetime, datetime]]:
    events = list(RentalEvent.objects.filter(rental=rental).order_by("created_at", "id"))
    far = datetime.max.replace(tzinfo=timezone.now().tzinfo)
    episodes = []
    for i, event in enumerate(events):
        if event.to_status != S.RUNNING:
            continue
        start = event.created_at  # the server's RUNNING event, never the agent's start
        end = far
        if i + 1 < len(events):
            nxt = events[i + 1]
            end = nxt.created_at
            if nxt.to_status == S.STOPPING:
                end += GRACE
                if i + 2 < len(events):
                    end = min(end, events[i + 2].created_at)
        if rental.ended_at is not None:
            end = min(end, rental.ended_at)
        episodes.append((start, end))
    return episodes


def _bound(rental_id, node_id: int) -> int:
    """(allocation held ∩ running) x GPUs, in whole GPU-seconds."""
    rental = Rental.objects.get(pk=rental_id)
    episodes = _running(rental)
    total = 0
    for alloc in Allocation.objects.filter(rental=rental, node_id=node_id):
        seconds = 0.0
        for start, end in episodes:
            low, high = max(start, alloc.during.lower), min(end, alloc.during.upper)
            seconds += max(0.0, (high - low).total_seconds())
        total += math.floor(seconds)
    return total


def _billed(rental_id, node_id: int) -> int:
    billing_pass_run()
    meter = UsageMeter.objects.filter(rental_id=rental_id, node_id=node_id).first()
    return 0 if meter is None else meter.gpu_seconds


def _assert_bounded(booked, node_id: int | None = None) -> int:
    node_id = node_id or booked.node_ids[0]
    billed = _billed(booked.rental.pk, node_id)
    assert billed <= _bound(booked.rental.pk, node_id)
    return billed


# --- how the agent lies -------------------------------------------------------------------------


def _reports(booked, spans, *, run="run-1", first_seq=1, final_last=False, rental_id=None):
    """Reports of one run confirming each (started second, confirmed second) in turn."""
    return [
        UsageReport(
            rental_id=rental_id or booked.rental.pk,
            run_id=run,
            seq=first_seq + i,
            gpu_count=booked.rental.gpus_per_node,
            started_at=booked.at(started),
            confirmed_at=booked.at(confirmed),
            final=final_last and i == len(spans) - 1,
        )
        for i, (started, confirmed) in enumerate(spans)
    ]


def _every(step: int, until: int, started: int = 0) -> list[tuple[int, int]]:
    return [(started, s) for s in range(started + step, until + 1, step)]


def _move(booked, at_s: float, act) -> None:
    """Run a lifecycle move on the locked rental as if it happened at second `at_s`: the rows
    it writes carry that time."""
    before = set(RentalEvent.objects.filter(rental=booked.rental).values_list("pk", flat=True))
    with transaction.atomic():
        rental = Rental.objects.select_for_update().get(pk=booked.rental.pk)
        act(rental, booked.at(at_s))
    RentalEvent.objects.filter(rental=booked.rental).exclude(pk__in=before).update(
        created_at=booked.at(at_s)
    )
    booked.rental.refresh_from_db()


def _stop(rental, at):
    lifecycle.rental_transition(
        rental=rental, to_status=S.STOPPING, actor_kind=RentalEvent.Actor.CUSTOMER, reason="stop"
    )


def _container_ended(rental, at):
    lifecycle.rental_mark_container_ended(
        rental=rental, hostname="h", exit_code=0, error="", ended_at=at, log_tail="", at=at
    )


def _apply(booked, reports, node_id=None):
    return usage_reports_apply(node_id=node_id or booked.node_ids[0], reports=reports)


# --- the cases found ----------------------------------------------------------------------------


def test_a_45_second_run_confirmed_for_221_seconds_bills_45(make_node, book):
    # Given a 1-GPU rental that ran 45 s: stopped at second 45, its container gone, its GPU
    # released then
    make_node(price="1.00")
    booked = book(gpus=1, hours=2, hours_ago=1)
    _apply(booked, _reports(booked, _every(5, 45)))
    _move(booked, 45, _stop)
    _move(booked, 45, _container_ended)
    assert booked.rental.status == S.COMPLETED
    # When the node keeps confirming to second 221, then replays it all
    forged = _reports(booked, _every(5, 221), first_seq=100)
    result = _apply(booked, forged)
    _apply(booked, forged)
    # Then the confirmations past the release are refused and counted, and 45 s are billed,
    # as the ledger says
    assert result.refused["allocation_released"] == len(_every(5, 221)) - len(_every(5, 45))
    assert _assert_bounded(booked) == 45 == _bound(booked.rental.pk, booked.node_ids[0])
    usage = LedgerEntry.objects.filter(rental=booked.rental, kind=EntryKind.USAGE)
    assert usage.aggregate(s=Sum("gpu_seconds"))["s"] == 45


def test_a_stop_that_never_reaches_the_agent_bills_the_stop_grace_at_most(make_node, book):
    # Given a 2-GPU rental stopped at second 100 whose agent never hears of it
    make_node(price="1.00")
    booked = book(gpus=2, hours=2, hours_ago=1)
    _move(booked, 100, _stop)
    # When the agent confirms on for an hour
    _apply(booked, _reports(booked, _every(10, 3600)))
    # Then billing ended at the stop + its grace
    assert _assert_bounded(booked) == 2 * (100 + int(DEFAULT_STOP_GRACE_S))


def test_confirmations_past_the_booked_end_bill_the_booking_at_most(make_node, book):
    make_node(price="1.00")
    booked = book(gpus=1, hours=1, hours_ago=3)
    result = _apply(booked, _reports(booked, [(-900, 1800), (-900, 3600 + 5400)]))
    assert result.applied == 2
    assert _assert_bounded(booked) == 3600
    # And a later confirmation past the end adds nothing and is counted
    late = _apply(booked, _reports(booked, [(-900, 3600 + 7000)], first_seq=9))
    assert late.refused == {"allocation_released": 1}


def test_a_clock_ahead_of_the_server_is_clamped_to_now(make_node, book):
    # Given a rental running since 10 minutes ago
    make_node(price="1.00")
    booked = book(gpus=1, hours=2, hours_ago=0)
    start = timezone.now() - timedelta(minutes=10)
    Rental.objects.filter(pk=booked.rental.pk).update(scheduled_start=start)
    Allocation.objects.filter(rental=booked.rental).update(
        during=(start, booked.rental.scheduled_end)
    )
    RentalEvent.objects.filter(rental=booked.rental).update(created_at=start)
    # When the agent's clock runs 100 s ahead, within the tolerated skew
    before = timezone.now()
    ahead = before + timedelta(seconds=100)
    result = usage_reports_apply(
        node_id=booked.node_ids[0],
        reports=[
            UsageReport(
                rental_id=booked.rental.pk,
                run_id="r",
                seq=1,
                gpu_count=1,
                started_at=start,
                confirmed_at=ahead,
            )
        ],
    )
    # Then the segment ends at the server's now, not in the future
    assert result.applied == 1
    segment = UsageSegment.objects.get(rental=booked.rental)
    assert before <= segment.confirmed_until <= timezone.now()
    assert _billed(booked.rental.pk, booked.node_ids[0]) <= (timezone.now() - start).seconds


def test_reports_for_another_nodes_rental_are_refused_and_store_nothing(make_node, book):
    mine = make_node(price="1.00", gpus=1, hostname="mine")
    theirs = make_node(price="1.00", gpus=1, hostname="theirs")
    first = book(gpus=1, hours=2, hours_ago=1)
    second = book(gpus=1, hours=2, hours_ago=1)
    assert {first.node_ids[0], second.node_ids[0]} == {mine.pk, theirs.pk}
    # The first rental's node reports the second's rental, and a rental that does not exist
    forged = _reports(second, _every(60, 600)) + _reports(
        second, [(0, 60)], rental_id=uuid.uuid4(), first_seq=50
    )
    result = _apply(first, forged)
    assert (result.applied, result.refused) == (0, {"not_allocated": 11})
    assert not UsageSegment.objects.exists()
    assert not UsageMeter.objects.exists()
    assert _billed(second.rental.pk, second.node_ids[0]) == 0


def test_after_final_nothing_moves_the_segment(make_node, book):
    make_node(price="1.00")
    booked = book(gpus=1, hours=2, hours_ago=3)
    # A batch where the final report comes before later confirmations, and a later batch
    result = _apply(
        booked,
        [
            *_reports(booked, [(0, 100), (0, 300)], final_last=True),
            *_reports(booked, [(0, 500)], first_seq=3),
        ],
    )
    assert (result.applied, result.refused) == (2, {"after_final": 1})
    later = _apply(booked, _reports(booked, [(0, 900), (0, 300)], first_seq=4))
    assert later.refused == {"after_final": 1}
    segment = UsageSegment.objects.get(rental=booked.rental)
    assert (segment.confirmed_until, segment.final) == (booked.at(300), True)
    assert _assert_bounded(booked) == 300


def test_replays_and_out_of_order_seqs_bill_what_was_confirmed(make_node, book):
    make_node(price="1.00")
    booked = book(gpus=4, hours=2, hours_ago=3)
    reports = _reports(booked, _every(60, 1200))
    _apply(booked, list(reversed(reports)))
    _apply(booked, reports[::2] + reports[::3])
    assert _assert_bounded(booked) == 4 * 1200


def test_after_a_requeue_the_old_nodes_meter_is_capped_at_the_release(make_node, book):
    # Given a rental that ran 600 s on a node, re-queued when the node went silent
    make_node(price="1.00", gpus=1, hostname="old")
    booked = book(gpus=1, hours=2, hours_ago=1)
    old = booked.node_ids[0]
    _apply(booked, _reports(booked, _every(60, 600)))
    assert _assert_bounded(booked) == 600
    _move(
        booked,
        600,
        lambda rental, at: lifecycle.rental_mark_node_lost(
            rental=rental, hostname="old", at=at, requeue=True
        ),
    )
    assert booked.rental.status == S.PENDING
    # When it is booked again elsewhere at another price and the old node keeps confirming
    make_node(price="3.00", gpus=1, hostname="new")
    Node.objects.filter(pk=old).update(status="offline")
    from scheduler.services import scheduler_cycle_run

    scheduler_cycle_run(pool=booked.rental.pool)
    booked.rental.refresh_from_db()
    assert booked.rental.price_per_gpu_hour == Decimal("3.0000")
    result = _apply(booked, _reports(booked, _every(60, 3000), first_seq=100), node_id=old)
    # Then the old node's meter stays at 600 s at the old price, and never grows
    assert result.refused["allocation_released"] == 40
    billing_pass_run()
    meter = UsageMeter.objects.get(rental=booked.rental, node_id=old)
    # (all of it credited: the node went silent and the run never checkpointed)
    assert (meter.gpu_seconds, meter.charge_micros) == (0, 0)
    assert (meter.credited_gpu_seconds, meter.credit_micros) == (600, 166_666)
    assert meter.gpu_seconds <= _bound(booked.rental.pk, old)


# --- through the agent API ----------------------------------------------------------------------


def test_a_forging_agent_through_the_api_bills_only_what_ran(api, make_join_token, book):
    # Given a node joined through the agent API, running a rental stopped at second 45
    raw = make_join_token(price="1.00")
    gpus = [
        {"index": i, "uuid": f"GPU-adv-{i}", "name": "NVIDIA A100-SXM4-80GB",
         "memory_mb": 81920, "topology_group": "nvl0"}
        for i in range(2)
    ]  # fmt: skip
    host = {"cpu_cores": 32, "ram_gb": 256, "disk_gb": 2000}
    joined = api.post(
        "/api/agent/v1/join/",
        {
            "join_token": raw,
            "hostname": "forger",
            "host": host,
            "internet_filtered": True,
            "gpus": gpus,
        },
        format="json",
    )
    assert joined.status_code == 201, joined.content
    agent = APIClient()
    agent.credentials(HTTP_AUTHORIZATION=f"Bearer {joined.json()['node_token']}")
    booked = book(gpus=2, hours=2, hours_ago=1)
    _move(booked, 45, _stop)
    _move(booked, 45, _container_ended)

    def usage(seq, confirmed_s, **extra):
        return {
            "seq": seq,
            "rental_id": str(booked.rental.pk),
            "run_id": "run-1",
            "gpu_count": 8,
            "started_at": booked.at(-600).timestamp(),
            "confirmed_at": booked.at(confirmed_s).timestamp(),
            "final": False,
        } | extra

    # When it reports 45 s honestly, then forges 221 s, a future clock and a final replay
    body = [usage(1, 45), usage(2, 221), usage(3, 10**6), usage(4, 300, final=True)]
    for _ in range(2):
        r = agent.post(
            "/api/agent/v1/heartbeat/",
            {"containers": [], "usage": body, "telemetry": [], "metrics": []},
            format="json",
        )
        assert r.status_code == 200, r.content
    # Then 2 GPUs x 45 s are billed
    assert _assert_bounded(booked) == 2 * 45


# --- any sequence of reports --------------------------------------------------------------------

_report = st.tuples(
    st.sampled_from(["a", "b"]),  # run
    st.integers(0, 40),  # seq
    st.integers(-2000, 9000),  # started second
    st.integers(0, 12_000),  # confirmed, seconds after started
    st.booleans(),  # final
    st.booleans(),  # for the other node's rental
)


@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    history=st.sampled_from(["running", "stop unheard", "stopped", "lost"]),
    event_s=st.integers(30, 7000),
    batches=st.lists(st.lists(_report, min_size=1, max_size=8), min_size=1, max_size=5),
)
def test_any_report_sequence_bills_within_the_bound(make_node, book, history, event_s, batches):
    if not Node.objects.exists():
        make_node(price="1.00", gpus=8)
    booked = book(gpus=2, hours=2, hours_ago=2.5)
    if history in ("stop unheard", "stopped"):
        _move(booked, event_s, _stop)
    if history == "stopped":
        _move(booked, event_s + 5, _container_ended)
    if history == "lost":
        _move(
            booked,
            event_s,
            lambda rental, at: lifecycle.rental_mark_node_lost(
                rental=rental, hostname="h", at=at, requeue=False
            ),
        )
    stranger = uuid.uuid4()
    for batch in batches:
        usage_reports_apply(
            node_id=booked.node_ids[0],
            reports=[
                UsageReport(
                    rental_id=stranger if other else booked.rental.pk,
                    run_id=run,
                    seq=seq,
                    gpu_count=8,
                    started_at=booked.at(started),
                    confirmed_at=booked.at(started + length),
                    final=final,
                )
                for run, seq, started, length, final, other in batch
            ],
        )
    _assert_bounded(booked)
