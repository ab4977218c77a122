"""Rating and the ledger: per-second charges at the locked price, deltas posted from totals,
the platform fee, low-balance warnings and the stop at zero."""

from __future__ import annotations

from datetime import timedelta
from decimal import ROUND_FLOOR, Decimal

import pytest
from django.db import IntegrityError, connection, transaction
from django.db.models import Sum
from django.utils import timezone

from billing.models import (
    Account,
    AccountKind,
    BalanceNotice,
    EntryKind,
    LedgerEntry,
    NoticeKind,
    UsageMeter,
)
from billing.selectors import account_summary
from billing.services import (
    UsageReport,
    account_adjust,
    account_for_team,
    billing_pass_run,
    usage_reports_apply,
)
from marketplace.lifecycle import rental_transition
from marketplace.models import Rental, RentalEvent, RentalStatus
from tests.billing.conftest import usd
from tests.factories import UserFactory, personal_team

pytestmark = pytest.mark.django_db


def _expected_charge(gpu_seconds: int, price: Decimal) -> int:
    """The charge computed independently: Decimal dollars, floored to the micro-dollar."""
    return int((gpu_seconds * price / 3600 * 1_000_000).to_integral_value(ROUND_FLOOR))


def _sum(**filters) -> int:
    return LedgerEntry.objects.filter(**filters).aggregate(s=Sum("amount_micros"))["s"] or 0


def _assert_balances_match_the_ledger():
    for account in Account.objects.all():
        assert account.balance_micros == _sum(account=account), account


def test_a_charge_is_posted_with_the_provider_earning_and_the_platform_fee(make_node, book):
    # Given a 2-GPU rental at $1.2345/GPU-hour with 1000 confirmed seconds
    make_node(price="1.2345")
    booked = book(gpus=2, hours=2, hours_ago=3)
    booked.report(seq=1, confirmed_s=1000)
    customer = account_for_team(team=personal_team(booked.rental.customer))
    before = customer.balance_micros
    # When the pass runs
    result = billing_pass_run()
    # Then floor(2000 GPU-s x $1.2345 / 3600) = $0.685833 is charged; 80 % goes to the provider
    assert (result.meters_rated, result.meters_posted, result.entries) == (1, 1, 3)
    entries = {
        e.kind: (e.amount_micros, e.gpu_seconds, e.posting_seq)
        for e in LedgerEntry.objects.filter(rental=booked.rental)
    }
    assert entries == {
        EntryKind.USAGE: (-685_833, 2000, 1),
        EntryKind.EARNING: (548_666, None, 1),
        EntryKind.PLATFORM_FEE: (137_167, None, 1),
    }
    customer.refresh_from_db()
    assert customer.balance_micros == before - 685_833
    provider = Account.objects.get(kind=AccountKind.PROVIDER)
    platform = Account.objects.get(kind=AccountKind.PLATFORM)
    assert (provider.balance_micros, platform.balance_micros) == (548_666, 137_167)
    _assert_balances_match_the_ledger()


def test_a_replayed_pass_posts_nothing_twice(make_node, book):
    make_node(price="1.00")
    booked = book(gpus=1, hours=2, hours_ago=3)
    booked.report(seq=1, confirmed_s=1234)
    now = timezone.now()
    first = billing_pass_run(now=now)
    count = LedgerEntry.objects.count()
    again = billing_pass_run(now=now)
    assert (first.entries, again.meters_rated, again.entries) == (3, 0, 0)
    assert LedgerEntry.objects.count() == count


def test_usage_is_posted_hourly_and_accrued_usage_counts_against_the_balance(make_node, book):
    make_node(price="3.60")  # $0.001 per GPU-second
    booked = book(gpus=1, hours=4, hours_ago=4)
    t0 = booked.at(3 * 3600)
    booked.report(seq=1, confirmed_s=600)
    billing_pass_run(now=t0)
    user = booked.rental.customer
    balance = account_summary(team=personal_team(user)).balance_micros
    # Ten minutes later: rated, not yet posted; it counts against the available balance.
    booked.report(seq=2, confirmed_s=1200)
    result = billing_pass_run(now=t0 + timedelta(minutes=10))
    assert (result.meters_rated, result.meters_posted) == (1, 0)
    summary = account_summary(team=personal_team(user))
    assert (summary.balance_micros, summary.accrued_micros) == (balance, 600_000)
    # (the rest of the 4 booked hours, $14.40 less the $1.20 rated, is held)
    assert summary.held_micros == 14_400_000 - 1_200_000
    assert summary.available_micros == balance - 600_000 - summary.held_micros
    # An hour after the last posting it is posted; nothing is accrued any more.
    result = billing_pass_run(now=t0 + timedelta(hours=1))
    assert result.meters_posted == 1
    summary = account_summary(team=personal_team(user))
    assert (summary.balance_micros, summary.accrued_micros) == (balance - 600_000, 0)


@pytest.mark.django_db(transaction=True)
def test_ten_thousand_hourly_postings_sum_exactly_to_the_rated_total(
    make_node, book_many, fund, user
):
    # Given 100 rentals of 1 to 3 GPUs at prices whose hourly charges never come out even
    prices = ["1.2345", "0.0123", "2.9999", "0.7777"]
    for i in range(32):
        make_node(price=prices[i % 4], gpus=8, hostname=f"n{i}")
    fund(user, "1000000.00")
    rentals = book_many([{"gpus": 1 + i % 3, "hours": 101, "hours_ago": 102} for i in range(100)])
    # When each agent confirms an uneven slice every hour and a pass runs every hour
    seq = 0
    confirmed = dict.fromkeys(range(100), 0)
    for hour in range(1, 101):
        by_node: dict[int, list[UsageReport]] = {}
        for i, booked in enumerate(rentals):
            seq += 1
            confirmed[i] = hour * 3600 - (hour * 7 + i) % 61
            by_node.setdefault(booked.node_ids[0], []).append(
                UsageReport(
                    rental_id=booked.rental.pk,
                    run_id="run",
                    seq=seq,
                    gpu_count=booked.rental.gpus_per_node,
                    started_at=booked.at(0),
                    confirmed_at=booked.at(confirmed[i]),
                )
            )
        for node_id, reports in by_node.items():
            assert usage_reports_apply(node_id=node_id, reports=reports).rejected == []
        # Small chunks: every pass is several transactions, as at full scale.
        billing_pass_run(now=rentals[0].at(hour * 3600 + 60), chunk=17)
    # Then there are 10,000 usage postings and each rental's sum is its rated total, exactly
    usage = LedgerEntry.objects.filter(kind=EntryKind.USAGE)
    assert usage.count() == 10_000
    grand_total = 0
    for i, booked in enumerate(rentals):
        rental = booked.rental
        gpu_seconds = rental.gpus_per_node * confirmed[i]
        expected = _expected_charge(gpu_seconds, rental.price_per_gpu_hour)
        assert -_sum(kind=EntryKind.USAGE, rental=rental) == expected
        assert usage.filter(rental=rental).aggregate(s=Sum("gpu_seconds"))["s"] == gpu_seconds
        assert _sum(kind__in=[EntryKind.EARNING, EntryKind.PLATFORM_FEE], rental=rental) == (
            expected
        )
        grand_total += expected
    assert -_sum(kind=EntryKind.USAGE) == grand_total
    # Every posting balances: usage + earning + fee = 0.
    assert _sum(meter__isnull=False) == 0
    _assert_balances_match_the_ledger()


def test_a_finished_rental_is_posted_at_once_and_the_ledger_equals_rated_usage(make_node, book):
    make_node(price="0.9999")
    booked = book(gpus=3, hours=2, hours_ago=3)
    now = timezone.now()
    booked.report(seq=1, confirmed_s=100)
    billing_pass_run(now=now)
    booked.report(seq=2, confirmed_s=4321, final=True)
    rental_transition(
        rental=booked.rental,
        to_status=RentalStatus.COMPLETED,
        actor_kind=RentalEvent.Actor.AGENT,
        reason="exited",
    )
    # Not an hour later, but the rental is over: everything is posted.
    result = billing_pass_run(now=now + timedelta(minutes=1))
    assert result.meters_posted == 1
    meter = UsageMeter.objects.get(rental=booked.rental)
    expected = _expected_charge(3 * 4321, Decimal("0.9999"))
    assert meter.charge_micros == meter.posted_charge_micros == expected
    assert -_sum(kind=EntryKind.USAGE, rental=booked.rental) == expected
    assert [
        e.posting_seq for e in LedgerEntry.objects.filter(kind=EntryKind.USAGE).order_by("id")
    ] == [1, 2]


def test_an_interruptible_rental_is_billed_at_its_locked_bid(make_node, book):
    make_node(price="2.00", min_bid="0.50")
    booked = book(gpus=1, hours=2, hours_ago=3, kind="interruptible", bid="0.75")
    assert booked.rental.price_per_gpu_hour == Decimal("0.75")
    booked.report(seq=1, confirmed_s=3600)
    billing_pass_run()
    assert -_sum(kind=EntryKind.USAGE, rental=booked.rental) == 750_000


def test_low_balance_warns_then_zero_stops_the_rentals_then_a_top_up_restores(
    make_node, book, fund, user
):
    # Given an 8 h rental at $1.00/h, booked with $8 (its hold), then $3 taken back by ops
    # (a chargeback, say); another customer's rental is not concerned
    make_node(price="1.00")
    fund(user, "8.00")
    booked = book(gpus=1, hours=8, hours_ago=7)
    account_adjust(
        account_id=account_for_team(team=personal_team(user)).pk,
        amount_micros=-usd("3.00"),
        reason="chargeback",
        actor=None,
    )
    bystander = book(gpus=1, hours=8, hours_ago=7, customer=UserFactory())
    bystander.report(seq=1, confirmed_s=60)
    account = account_for_team(team=personal_team(user))
    # When usage leaves less than an hour: a low-balance notice, once
    booked.report(seq=2, confirmed_s=int(4.2 * 3600))
    result = billing_pass_run()
    billing_pass_run()
    assert (result.low_balance, result.depleted, result.rentals_stopped) == (1, 0, 0)
    account.refresh_from_db()
    assert account.low_balance_since is not None and account.depleted_since is None
    # When usage exceeds the balance: the rental is stopped, by billing, with the reason
    booked.report(seq=3, confirmed_s=int(5.5 * 3600))
    result = billing_pass_run()
    assert (result.depleted, result.rentals_stopped) == (1, 1)
    rental = Rental.objects.get(pk=booked.rental.pk)
    assert rental.status == RentalStatus.STOPPING
    event = rental.events.order_by("id").last()
    assert (event.actor_kind, event.to_status) == (RentalEvent.Actor.BILLING, "stopping")
    assert event.reason == "balance exhausted (available $-0.50): top up to rent again"
    assert Rental.objects.get(pk=bystander.rental.pk).status == RentalStatus.RUNNING
    again = billing_pass_run()
    assert (again.depleted, again.rentals_stopped) == (0, 0)
    assert list(
        BalanceNotice.objects.filter(account=account).order_by("id").values_list("kind", flat=True)
    ) == [NoticeKind.LOW_BALANCE, NoticeKind.DEPLETED]
    # When ops credit the account: restored, flags cleared
    account_adjust(account_id=account.pk, amount_micros=usd("10.00"), reason="goodwill", actor=None)
    rental_transition(
        rental=rental,
        to_status=RentalStatus.COMPLETED,
        actor_kind=RentalEvent.Actor.AGENT,
        reason="checkpointed",
    )
    result = billing_pass_run()
    assert result.restored == 1
    account.refresh_from_db()
    assert (account.low_balance_since, account.depleted_since) == (None, None)
    _assert_balances_match_the_ledger()


def test_the_ledger_refuses_updates_and_deletes(make_node, book):
    make_node(price="1.00")
    booked = book(gpus=1, hours=2, hours_ago=3)
    entry = LedgerEntry.objects.filter(account__team__personal_of=booked.rental.customer).first()
    for attempt in (
        lambda: LedgerEntry.objects.filter(pk=entry.pk).update(memo="rewritten"),
        lambda: LedgerEntry.objects.filter(pk=entry.pk).delete(),
    ):
        with pytest.raises(IntegrityError, match="append-only"), transaction.atomic():
            attempt()
    entry.refresh_from_db()
    assert entry.memo == "test funds"


def test_the_same_posting_key_cannot_be_written_twice(user):
    account = account_for_team(team=personal_team(user))
    first = account_adjust(
        account_id=account.pk, amount_micros=5, reason="once", actor=None, key="k1"
    )
    second = account_adjust(
        account_id=account.pk, amount_micros=5, reason="once", actor=None, key="k1"
    )
    assert first is not None and second is None
    account.refresh_from_db()
    assert account.balance_micros == 5


def test_a_rental_without_funds_is_refused_with_402_and_nothing_is_stored(
    make_node, auth_api, user, fund
):
    make_node(price="1.00")
    body = {"gpus_per_node": 2, "duration_s": 7200, "runtime": {"image": "gpumarket/harness:dev"}}
    r = auth_api.post("/api/v1/rentals/", body, format="json")
    assert r.status_code == 402
    assert r.json()["code"] == "payment_required"
    # The refusal says where to add funds, and the pages it names exist.
    assert r.json()["links"] == {"topup": "/billing/topup/", "topup_api": "/api/v1/billing/topups/"}
    assert "/billing/topup/" in r.json()["detail"]
    assert auth_api.get(r.json()["links"]["topup_api"]).status_code == 200
    assert not Rental.objects.exists()
    # 2 GPUs x 2 h at a $1.50 cap hold $6.00: neither $1.00 nor $3.00 covers it; $6.00 does.
    fund(user, "1.00")
    body["max_price_per_gpu_hour"] = "1.50"
    assert auth_api.post("/api/v1/rentals/", body, format="json").status_code == 402
    fund(user, "2.00")
    refused = auth_api.post("/api/v1/rentals/", body, format="json")
    assert refused.status_code == 402
    assert "holds $6.00" in refused.json()["detail"] and "$3.00" in refused.json()["detail"]
    assert not Rental.objects.exists()
    fund(user, "3.00")
    assert auth_api.post("/api/v1/rentals/", body, format="json").status_code == 201


def test_a_pass_over_more_meters_than_one_statement_can_rate_in_time_still_bills_them_all(
    make_node, book_many, settings, caplog
):
    # Given 64 running rentals whose meters each take 20 ms to write (a trigger that sleeps, so
    # one statement over all of them needs 1.3 s), and a chunk timeout of 1 s
    for i in range(8):
        make_node(price="1.2345", gpus=8, hostname=f"slow{i}")
    rentals = book_many([{"gpus": 1, "hours": 2, "hours_ago": 3} for _ in range(64)])
    for seq, booked in enumerate(rentals, start=1):
        booked.report(seq=seq, confirmed_s=600)
    with connection.cursor() as cursor:
        cursor.execute(
            "CREATE FUNCTION slow_meter() RETURNS trigger LANGUAGE plpgsql AS"
            " $$ BEGIN PERFORM pg_sleep(0.02); RETURN NEW; END $$"
        )
        cursor.execute(
            "CREATE TRIGGER slow_meter BEFORE UPDATE ON billing_usagemeter"
            " FOR EACH ROW EXECUTE FUNCTION slow_meter()"
        )
    settings.BILLING_CHUNK_TIMEOUT_MS = 1000
    # When one pass runs with every meter in one chunk
    with caplog.at_level("WARNING", logger="billing.services.rating"):
        result = billing_pass_run(now=rentals[0].at(3 * 3600))
    # Then the chunk ran out of time and was rated again in halves, and every meter is billed
    assert "doing them in halves" in caplog.text
    assert result.meters_rated == 64 and result.meters_posted == 64
    for booked in rentals:
        expected = _expected_charge(600, booked.rental.price_per_gpu_hour)
        assert -_sum(kind=EntryKind.USAGE, rental=booked.rental) == expected
    assert _sum(meter__isnull=False) == 0
    _assert_balances_match_the_ledger()
