"""A rental ended by a node fault is made whole: the GPU time since its last synced checkpoint is
credited on the ledger with the reason, and the provider is not paid for it. A customer's own
ending is not credited."""

# The billing suite's fixtures are imported below, so test arguments "redefine" them.
# ruff: noqa: F811

from __future__ import annotations

import pytest
from django.db.models import Sum

from billing.models import Account, AccountKind, EntryKind, LedgerEntry, UsageMeter
from billing.services import billing_pass_run
from marketplace import lifecycle
from marketplace.models import Node, RentalCredit
from storage.models import Artifact
from tests.adversarial.test_metering import _apply, _container_ended, _every, _move, _reports
from tests.billing.conftest import (  # noqa: F401 - the billing suite's fixtures
    _funds_check_on,
    book,
    book_many,
    fund,
)

pytestmark = pytest.mark.django_db


def _lost(rental, at):
    lifecycle.rental_mark_node_lost(rental=rental, hostname="lost", at=at, requeue=False)


def _entries(rental, kind):
    return LedgerEntry.objects.filter(rental=rental, kind=kind)


def test_a_node_fault_credits_the_time_since_the_last_checkpoint(make_node, book):
    # Given a 1-GPU rental at $1/GPU-hour that ran 1200 s, its last checkpoint synced at 600 s
    make_node(price="1.00", gpus=1, hostname="lost")
    booked = book(gpus=1, hours=2, hours_ago=1)
    _apply(booked, _reports(booked, _every(60, 1200)))
    Artifact.objects.create(
        rental=booked.rental, path="checkpoints/step_100.pt", size_bytes=10, sha256="0" * 64,
        run_id="run-1", reason="checkpoint", synced_at=booked.at(600),
    )  # fmt: skip
    # When its node goes silent at 1200 s and the billing pass runs
    _move(booked, 1200, _lost)
    billing_pass_run()
    # Then the rental failed by the node's fault, with a credit from the checkpoint to the fault
    booked.rental.refresh_from_db()
    assert (booked.rental.status, booked.rental.end_cause) == ("failed", "node")
    credit = RentalCredit.objects.get(rental=booked.rental)
    assert (credit.during.lower, credit.during.upper) == (booked.at(600), booked.at(1200))
    assert credit.reason == "node lost went silent"
    # And the ledger charges the 1200 s and credits 600 s back with the reason
    meter = UsageMeter.objects.get(rental=booked.rental)
    assert (meter.gpu_seconds, meter.credited_gpu_seconds) == (600, 600)
    (usage,) = _entries(booked.rental, EntryKind.USAGE)
    (credited,) = _entries(booked.rental, EntryKind.FAULT_CREDIT)
    assert (usage.amount_micros, usage.gpu_seconds) == (-333_333, 1200)
    assert (credited.amount_micros, credited.gpu_seconds) == (166_667, 600)
    assert credited.memo == "node fault: node lost went silent"
    # And the provider is paid for the 600 s before the checkpoint only (80 % of $0.166666)
    provider = Account.objects.get(
        kind=AccountKind.PROVIDER, provider=Node.objects.get(hostname="lost").provider
    )
    earned = _entries(booked.rental, EntryKind.EARNING).aggregate(t=Sum("amount_micros"))["t"]
    assert earned == 133_332
    assert provider.balance_micros == 133_332
    # And every posting sums to zero
    total = LedgerEntry.objects.filter(rental=booked.rental).aggregate(t=Sum("amount_micros"))
    assert total["t"] == 0
    # And a second pass posts nothing more
    before = LedgerEntry.objects.count()
    billing_pass_run()
    assert LedgerEntry.objects.count() == before


def test_a_node_fault_without_a_checkpoint_credits_the_whole_run(make_node, book):
    # Given a rental that ran 900 s and never checkpointed
    make_node(price="1.00", gpus=1, hostname="lost")
    booked = book(gpus=1, hours=2, hours_ago=1)
    _apply(booked, _reports(booked, _every(60, 900)))
    # When its node goes silent
    _move(booked, 900, _lost)
    billing_pass_run()
    # Then nothing is billed net: the whole run is credited, and the provider earns nothing
    meter = UsageMeter.objects.get(rental=booked.rental)
    assert (meter.gpu_seconds, meter.credited_gpu_seconds) == (0, 900)
    assert not _entries(booked.rental, EntryKind.EARNING).exists()
    (credited,) = _entries(booked.rental, EntryKind.FAULT_CREDIT)
    assert credited.amount_micros == 250_000


def test_an_ending_of_the_customers_doing_is_not_credited(make_node, book):
    # Given a rental that ran 900 s and exited by itself
    make_node(price="1.00", gpus=1, hostname="fine")
    booked = book(gpus=1, hours=2, hours_ago=1)
    _apply(booked, _reports(booked, _every(60, 900)))
    _move(booked, 900, _container_ended)
    billing_pass_run()
    # Then it is billed whole and nothing is credited
    booked.rental.refresh_from_db()
    assert booked.rental.end_cause == "customer"
    assert not RentalCredit.objects.filter(rental=booked.rental).exists()
    assert not _entries(booked.rental, EntryKind.FAULT_CREDIT).exists()
    assert UsageMeter.objects.get(rental=booked.rental).gpu_seconds == 900


def test_the_rental_page_and_the_statement_show_the_credit(make_node, book, user, auth_api):
    # Given a rental credited for a node fault
    make_node(price="1.00", gpus=1, hostname="lost")
    booked = book(gpus=1, hours=2, hours_ago=1)
    _apply(booked, _reports(booked, _every(60, 600)))
    _move(booked, 600, _lost)
    billing_pass_run()
    # When its owner reads the rental and the ledger
    detail = auth_api.get(f"/api/v1/rentals/{booked.rental.pk}/").json()
    ledger = auth_api.get("/api/v1/billing/ledger/").json()
    # Then both show it
    assert detail["end_cause"] == "node"
    assert [(c["node"], c["reason"]) for c in detail["credits"]] == [
        ("lost", "node lost went silent")
    ]
    rows = ledger["results"] if isinstance(ledger, dict) else ledger
    credits = [row for row in rows if row["kind"] == "fault_credit"]
    assert len(credits) == 1
    assert "node lost went silent" in credits[0]["memo"]
