"""Metering: agent usage reports become segments; what is billed is what agents confirmed."""

from __future__ import annotations

import random
import uuid
from datetime import UTC, datetime, timedelta

import pytest
from django.utils import timezone

from billing.models import UsageMeter, UsageSegment
from billing.services import (
    UsageReport,
    billing_pass_run,
    usage_report_apply,
    usage_reports_apply,
)
from core.errors import ValidationFailed

pytestmark = pytest.mark.django_db

RUN1 = [(seq, 10 + 300 * seq) for seq in range(1, 21)]  # (seq, confirmed second)


def _meter(booked, node_id=None) -> UsageMeter:
    return UsageMeter.objects.get(rental=booked.rental, node_id=node_id or booked.node_ids[0])


def _rated(booked) -> tuple[int, int]:
    billing_pass_run()
    meter = _meter(booked)
    return meter.gpu_seconds, meter.charge_micros


def test_reports_in_order_bill_gpus_times_confirmed_seconds(make_node, book):
    # Given a 2-GPU rental booked 3 h ago for 2 h at $1.00/GPU-hour
    make_node(price="1.00")
    booked = book(gpus=2, hours=2, hours_ago=3)
    # When the agent confirms its run from second 10 to second 6010
    for seq, confirmed in RUN1:
        booked.report(seq=seq, started_s=10, confirmed_s=confirmed)
    # Then 2 GPUs x 6000 s are billed: 12,000 GPU-s at $1/h = $3.333333 (floored micros)
    assert _rated(booked) == (12_000, 3_333_333)
    segment = UsageSegment.objects.get(rental=booked.rental)
    assert (segment.first_seq, segment.last_seq, segment.reports) == (1, 20, 20)


def test_duplicated_reordered_and_replayed_reports_give_the_same_bill(make_node, book):
    make_node(price="1.00", gpus=8)
    reference = book(gpus=1, hours=2, hours_ago=3)
    reports = [*RUN1, (21, 6300)]
    for seq, confirmed in reports:
        reference.report(seq=seq, started_s=10, confirmed_s=confirmed, final=seq == 21)
    expected = _rated(reference)
    assert expected == (6290, 1_747_222)
    rng = random.Random(42)
    for trial in range(5):
        # The same stream, shuffled, with duplicates and a replay of the whole spool.
        stream = reports + rng.sample(reports, 8)
        rng.shuffle(stream)
        stream += reports
        other = book(gpus=1, hours=2, hours_ago=3)
        for seq, confirmed in stream:
            other.report(
                seq=1000 * (trial + 1) + seq, started_s=10, confirmed_s=confirmed, final=seq == 21
            )
        assert _rated(other) == expected
        segment = UsageSegment.objects.get(rental=other.rental)
        assert (segment.confirmed_until, segment.final) == (other.at(6300), True)


def test_a_batch_applies_like_the_same_reports_one_by_one(make_node, book):
    make_node(price="1.00", gpus=8)
    one_by_one = book(gpus=1, hours=2, hours_ago=3)
    batched = book(gpus=1, hours=2, hours_ago=3)
    for seq, confirmed in RUN1:
        one_by_one.report(seq=seq, started_s=0, confirmed_s=confirmed)
    stream = RUN1 + RUN1[:5]
    random.Random(1).shuffle(stream)
    result = usage_reports_apply(
        node_id=batched.node_ids[0],
        reports=[
            UsageReport(
                rental_id=batched.rental.pk,
                run_id="run-1",
                seq=seq,
                gpu_count=1,
                started_at=batched.at(0),
                confirmed_at=batched.at(confirmed),
            )
            for seq, confirmed in stream
        ],
    )
    assert (result.applied, result.rejected) == (25, [])
    billing_pass_run()
    assert _meter(batched).gpu_seconds == _meter(one_by_one).gpu_seconds == 6010


def test_a_replayed_spool_counts_each_report_once(make_node, book):
    # Given reports 1-3 applied, and the answer to report 3 lost in a cut connection
    make_node(price="1.00")
    booked = book(gpus=1, hours=2, hours_ago=3)

    def batch(seqs):
        return usage_reports_apply(
            node_id=booked.node_ids[0],
            reports=[
                UsageReport(
                    rental_id=booked.rental.pk,
                    run_id="run-1",
                    seq=seq,
                    gpu_count=1,
                    started_at=booked.at(0),
                    confirmed_at=booked.at(100 * seq),
                )
                for seq in seqs
            ],
        )

    batch([1, 2, 3])
    # When the agent replays its spool from report 3, with 4 and 5 written during the outage
    batch([3, 4, 5, 5])
    # Then every report counted once, and the segment reaches the last confirmation
    segment = UsageSegment.objects.get(rental=booked.rental)
    assert (segment.first_seq, segment.last_seq, segment.reports) == (1, 5, 5)
    assert segment.confirmed_until == booked.at(500)
    # And a replay of reports already applied changes nothing
    batch([4, 5])
    segment.refresh_from_db()
    assert (segment.last_seq, segment.reports) == (5, 5)


def test_an_agent_that_goes_silent_stops_billing_at_its_last_confirmation(make_node, book):
    make_node(price="2.00")
    booked = book(gpus=4, hours=6, hours_ago=5)
    for seq in range(1, 7):
        booked.report(seq=seq, confirmed_s=300 * seq)
    # Hours pass without a report: the pass bills up to second 1800, not up to now.
    assert _rated(booked) == (4 * 1800, 4_000_000)
    assert _rated(booked) == (4 * 1800, 4_000_000)


def test_billing_is_clipped_to_the_booked_window(make_node, book):
    make_node(price="1.00")
    booked = book(gpus=1, hours=1, hours_ago=2)
    # A run that the agent says started before the booking and outlived it.
    booked.report(seq=1, started_s=-600, confirmed_s=3600 + 900)
    assert _rated(booked) == (3600, 1_000_000)


def test_overlapping_runs_on_one_node_bill_each_second_once(make_node, book):
    make_node(price="1.00")
    booked = book(gpus=2, hours=2, hours_ago=3)
    booked.report(seq=1, run="a", started_s=0, confirmed_s=3000)
    booked.report(seq=2, run="b", started_s=2000, confirmed_s=5000)
    # The union [0, 5000] of two runs, not 3000 + 3000.
    assert _rated(booked)[0] == 2 * 5000


def test_reported_gpus_never_exceed_the_allocation(make_node, book):
    make_node(price="1.00")
    booked = book(gpus=2, hours=2, hours_ago=3)
    usage_report_apply(
        node_id=booked.node_ids[0],
        rental_id=booked.rental.pk,
        run_id="r",
        seq=1,
        gpu_count=8,
        started_at=booked.at(0),
        confirmed_at=booked.at(100),
    )
    assert _rated(booked)[0] == 2 * 100


def test_a_multi_node_rental_meters_each_node_on_its_own(make_node, book):
    # A gang's nodes are one provider's cluster (make_node's "fabric"): each is metered for
    # what its own agent confirmed.
    make_node(price="1.00", gpus=8, hostname="a")
    make_node(price="1.00", gpus=8, hostname="b")
    booked = book(gpus=8, nodes=2, hours=2, hours_ago=3)
    assert len(booked.node_ids) == 2
    first, second = booked.node_ids
    booked.report(seq=1, node=first, confirmed_s=1800)
    booked.report(seq=1, node=second, confirmed_s=900)
    billing_pass_run()
    assert _meter(booked, first).gpu_seconds == 8 * 1800
    assert _meter(booked, second).gpu_seconds == 8 * 900


def test_a_report_for_a_rental_not_on_this_node_is_refused_and_stores_nothing(make_node, book):
    make_node(price="1.00", hostname="mine")
    stranger = make_node(price="1.00", hostname="stranger", gpus=1)
    booked = book(gpus=2, hours=2, hours_ago=3)
    assert stranger.pk not in booked.node_ids
    with pytest.raises(ValidationFailed) as err:
        booked.report(seq=1, node=stranger.pk, confirmed_s=100)
    assert err.value.field == "rental_id"
    with pytest.raises(ValidationFailed) as err:
        usage_report_apply(
            node_id=booked.node_ids[0],
            rental_id=uuid.uuid4(),
            run_id="r",
            seq=1,
            gpu_count=1,
            started_at=booked.at(0),
            confirmed_at=booked.at(1),
        )
    assert err.value.field == "rental_id"
    assert not UsageSegment.objects.exists()
    assert not UsageMeter.objects.exists()


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"confirmed_at": datetime(2020, 1, 1, tzinfo=UTC)}, "confirmed_at"),
        ({"confirmed_at": timezone.now() + timedelta(hours=1)}, "confirmed_at"),
        ({"started_at": datetime(2020, 1, 1)}, "started_at"),
        ({"gpu_count": 0}, "gpu_count"),
        ({"seq": -1}, "seq"),
        ({"run_id": ""}, "run_id"),
    ],
)
def test_a_malformed_report_is_refused_naming_the_field(make_node, book, change, field):
    make_node(price="1.00")
    booked = book(gpus=1, hours=2, hours_ago=3)
    report = {
        "node_id": booked.node_ids[0],
        "rental_id": booked.rental.pk,
        "run_id": "r",
        "seq": 1,
        "gpu_count": 1,
        "started_at": booked.at(0),
        "confirmed_at": booked.at(10),
    } | change
    with pytest.raises(ValidationFailed) as err:
        usage_report_apply(**report)
    assert err.value.field == field
    assert not UsageSegment.objects.exists()


def test_an_older_or_duplicate_report_after_final_changes_nothing(make_node, book):
    make_node(price="1.00")
    booked = book(gpus=1, hours=2, hours_ago=3)
    booked.report(seq=5, confirmed_s=500, final=True)
    before = UsageSegment.objects.values().get()
    booked.report(seq=5, confirmed_s=500, final=True)
    booked.report(seq=3, confirmed_s=300)
    assert UsageSegment.objects.values().get() == before
    assert _meter(booked).usage_version == 1
