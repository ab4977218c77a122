"""Concurrent webhooks and billing passes on real PostgreSQL, with real threads."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
from django.db import connection, transaction
from django.db.models import Sum
from django.test import Client

from billing.models import (
    Account,
    EntryKind,
    LedgerEntry,
    StripeEvent,
    TopUpStatus,
    UsageMeter,
)
from billing.services import account_for_team, billing_pass_run, topup_create
from tests.billing.conftest import signed, stripe_events
from tests.factories import personal_team

pytestmark = pytest.mark.django_db(transaction=True)


def _run_threads(targets) -> list[BaseException]:
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(targets))

    def wrap(fn):
        def run():
            try:
                barrier.wait(timeout=30)
                fn()
            except BaseException as exc:  # reported to the test below
                errors.append(exc)
            finally:
                connection.close()

        return run

    threads = [threading.Thread(target=wrap(fn)) for fn in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return errors


def test_concurrent_top_up_webhooks_and_charges_keep_the_balance_exact(
    stripe_on, settings, make_node, book, user
):
    # Given a running rental and 12 top-ups paid in the browser, their events waiting
    settings.BILLING_POSTING_INTERVAL_S = 0  # every pass posts: as much contention as possible
    make_node(price="3.60")  # $0.001 per GPU-second
    booked = book(gpus=1, hours=3, hours_ago=3)
    events = []
    for i in range(12):
        started = topup_create(team=personal_team(user), user=user, amount_cents=1000 + i)
        intent = started.topup.payment_intent_id
        stripe_on.v1.payment_intents.update(intent, params={"payment_method": "pm_card_visa"})
        stripe_on.v1.payment_intents.confirm(intent)
        (event,) = stripe_events(stripe_on, "payment_intent.succeeded", intent)
        events.append(event)
    start_balance = account_for_team(team=personal_team(user)).balance_micros

    # When four threads deliver the events (each event by two threads at once, twice each)
    # while a fifth confirms usage and runs billing passes
    def deliver(batch):
        def run():
            client = Client()
            for event in batch + batch:
                body, header = signed(event)
                r = client.post(
                    "/billing/stripe/webhook/",
                    data=body,
                    content_type="application/json",
                    HTTP_STRIPE_SIGNATURE=header,
                )
                assert r.status_code == 200, r.content

        return run

    def charge():
        for seq in range(1, 41):
            booked.report(seq=seq, confirmed_s=60 * seq)
            billing_pass_run(now=booked.at(3 * 3600) + timedelta(seconds=seq))

    errors = _run_threads([deliver(events[i % 2 :: 2]) for i in range(4)] + [charge])
    assert errors == []

    # Then each top-up is credited once, all usage is charged, and the balance is exact
    account = Account.objects.get(pk=account_for_team(team=personal_team(user)).pk)
    credits = sum(1000 + i for i in range(12)) * 10_000
    charged = 60 * 40 * 1000  # 2400 GPU-seconds at 1000 micros
    assert StripeEvent.objects.count() == 12
    assert LedgerEntry.objects.filter(kind=EntryKind.TOPUP).count() == 12
    assert account.topups.filter(status=TopUpStatus.SUCCEEDED).count() == 12
    usage = LedgerEntry.objects.filter(account=account, kind=EntryKind.USAGE)
    assert -usage.aggregate(s=Sum("amount_micros"))["s"] == charged
    assert account.balance_micros == start_balance + credits - charged
    assert (
        account.balance_micros
        == (LedgerEntry.objects.filter(account=account).aggregate(s=Sum("amount_micros"))["s"])
    )
    for other in Account.objects.all():
        assert other.balance_micros == (
            LedgerEntry.objects.filter(account=other).aggregate(s=Sum("amount_micros"))["s"] or 0
        )


def _lock_waiters() -> int:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity"
            " WHERE datname = current_database() AND wait_event_type = 'Lock'"
        )
        return cursor.fetchone()[0]


def test_a_report_racing_a_pass_is_rated_by_the_next_pass(make_node, book):
    # Given a meter with a report not yet rated
    make_node(price="3.60")
    booked = book(gpus=1, hours=3, hours_ago=3)
    booked.report(seq=1, confirmed_s=600)
    reported, go = threading.Event(), threading.Event()

    def agent():
        # A heartbeat's report whose transaction is still open when the pass reads the meters
        with transaction.atomic():
            booked.report(seq=2, confirmed_s=1200)
            reported.set()
            assert go.wait(30)

    def billing():
        assert reported.wait(30)
        billing_pass_run()

    def referee():
        assert reported.wait(30)
        deadline = time.monotonic() + 30
        while _lock_waiters() == 0:  # the pass waits for the report's row lock
            assert time.monotonic() < deadline
            time.sleep(0.05)
        go.set()

    # When the pass runs while the report commits
    assert _run_threads([agent, billing, referee]) == []
    # Then the pass rated what it saw, the report is not lost, and the next pass rates it
    meter = UsageMeter.objects.get(rental=booked.rental)
    assert (meter.gpu_seconds, meter.rated_version, meter.usage_version) == (600, 1, 2)
    billing_pass_run()
    meter.refresh_from_db()
    assert (meter.gpu_seconds, meter.rated_version) == (1200, 2)
