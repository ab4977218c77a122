"""Monthly statements and the owner-scoped billing API."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from accounts.services import api_token_create
from billing.models import Invoice, InvoiceLine
from billing.services import billing_pass_run, invoice_issue, invoices_issue_due
from core.errors import ValidationFailed
from marketplace.models import GpuModel
from tests.factories import UserFactory, personal_team

pytestmark = pytest.mark.django_db


def _month_start(now: datetime) -> datetime:
    return now.astimezone(UTC).replace(day=1, hour=0, minute=0, second=0, microsecond=0)


@pytest.fixture
def last_month_usage(make_node, book):
    """A 2-GPU rental at $1.50/h used for 3 h and posted before this month began."""
    make_node(price="1.50")
    boundary = _month_start(timezone.now())
    hours_ago = (timezone.now() - (boundary - timedelta(hours=5))).total_seconds() / 3600
    booked = book(gpus=2, hours=4, hours_ago=hours_ago)
    booked.report(seq=1, confirmed_s=3 * 3600)
    billing_pass_run(now=boundary - timedelta(minutes=1))
    return booked, boundary


def test_last_months_statement_has_a_line_per_rental(last_month_usage, user):
    booked, boundary = last_month_usage
    assert invoices_issue_due(today=boundary.date()) == 1
    assert invoices_issue_due(today=boundary.date()) == 0
    invoice = Invoice.objects.get()
    previous = (boundary - timedelta(days=1)).date().replace(day=1)
    assert (invoice.period_start, invoice.period_end) == (previous, boundary.date())
    assert invoice.number == f"GM-{previous:%Y%m}-{invoice.account_id:06d}"
    assert (invoice.opening_balance_micros, invoice.usage_micros, invoice.payments_micros) == (
        0,
        9_000_000,
        0,
    )
    assert invoice.closing_balance_micros == -9_000_000
    line = InvoiceLine.objects.get()
    assert (line.rental_id, line.gpus, line.gpu_seconds, line.rate_per_gpu_hour) == (
        booked.rental.pk,
        2,
        2 * 3 * 3600,
        Decimal("1.5000"),
    )
    assert line.amount_micros == 9_000_000
    assert line.gpu_model == GpuModel.objects.get(slug="a100-sxm4-80gb").name
    assert invoice_issue(account_id=invoice.account_id, period_start=previous) == invoice


def test_the_current_month_cannot_be_invoiced_yet(user):
    from billing.services import account_for_team

    account = account_for_team(team=personal_team(user))
    with pytest.raises(ValidationFailed, match="once it is over"):
        invoice_issue(account_id=account.pk, period_start=timezone.now().date())


def test_invoices_are_shown_to_their_owner_only(last_month_usage, auth_api):
    _, boundary = last_month_usage
    invoices_issue_due(today=boundary.date())
    invoice = Invoice.objects.get()
    listed = auth_api.get("/api/v1/billing/invoices/").json()["results"]
    assert [i["number"] for i in listed] == [invoice.number]
    detail = auth_api.get(f"/api/v1/billing/invoices/{invoice.pk}/").json()
    assert detail["usage_micros"] == 9_000_000
    assert [(ln["gpus"], ln["gpu_seconds"], ln["amount_micros"]) for ln in detail["lines"]] == [
        (2, 21600, 9_000_000)
    ]
    page = auth_api.get(f"/api/v1/billing/invoices/{invoice.pk}/print/")
    assert page.status_code == 200 and page["Content-Type"].startswith("text/html")
    html = page.content.decode()
    assert invoice.number in html and "$9.00" in html and "21600" in html
    # Another customer gets 404 for this id, on every view of it.
    other = APIClient()
    other.credentials(
        HTTP_AUTHORIZATION="Bearer "
        + api_token_create(user=(them := UserFactory()), team=personal_team(them), name="t")[1]
    )
    assert other.get("/api/v1/billing/invoices/").json()["results"] == []
    assert other.get(f"/api/v1/billing/invoices/{invoice.pk}/").status_code == 404
    assert other.get(f"/api/v1/billing/invoices/{invoice.pk}/print/").status_code == 404


def test_account_ledger_and_usage_endpoints(make_node, book, auth_api):
    make_node(price="1.00")
    booked = book(gpus=1, hours=2, hours_ago=3)
    booked.report(seq=7, confirmed_s=1800)
    billing_pass_run()
    account = auth_api.get("/api/v1/billing/account/").json()
    assert account == {
        "currency": "usd",
        "balance_micros": 1000_000_000 - 500_000,
        "accrued_micros": 0,
        # 2 h x $1.00 held, less the $0.50 already charged
        "held_micros": 1_500_000,
        "available_micros": 1000_000_000 - 500_000 - 1_500_000,
        "hourly_burn_micros": 1_000_000,
        "low_balance_since": None,
        "depleted_since": None,
    }
    ledger = auth_api.get("/api/v1/billing/ledger/").json()["results"]
    assert [(e["kind"], e["amount_micros"], e["gpu_seconds"]) for e in ledger] == [
        ("usage", -500_000, 1800),
        ("adjustment", 1000_000_000, None),
    ]
    usage = auth_api.get(f"/api/v1/billing/rentals/{booked.rental.pk}/usage/").json()
    assert usage["price_per_gpu_hour"] == "1.0000"
    assert [(m["gpu_seconds"], m["charge_micros"]) for m in usage["meters"]] == [(1800, 500_000)]
    assert [(s["run_id"], s["first_seq"], s["last_seq"]) for s in usage["segments"]] == [
        ("run-1", 7, 7)
    ]
    auth_api.force_authenticate(UserFactory())
    assert auth_api.get(f"/api/v1/billing/rentals/{booked.rental.pk}/usage/").status_code == 404
    assert auth_api.get("/api/v1/billing/ledger/").json()["results"] == []


def test_a_top_up_amount_out_of_range_is_400_naming_the_field(auth_api):
    r = auth_api.post("/api/v1/billing/topups/", {"amount_cents": 5}, format="json")
    assert r.status_code == 400
    assert "amount_cents" in r.json()


def test_a_provider_owner_sees_its_earnings_and_nobody_elses(make_node, book, provider):
    from rest_framework.test import APIClient

    from billing.models import EntryKind, LedgerEntry
    from billing.services import billing_pass_run
    from tests.factories import UserFactory

    # Given one hour of 2 GPUs at $1.00 billed on the provider's node
    make_node(price="1.00")
    booked = book(gpus=2, hours=2, hours_ago=3)
    booked.report(seq=1, confirmed_s=3600)
    billing_pass_run()
    earned = LedgerEntry.objects.get(kind=EntryKind.EARNING)
    fee = LedgerEntry.objects.get(kind=EntryKind.PLATFORM_FEE)
    assert earned.amount_micros + fee.amount_micros == 2_000_000  # the customer's charge

    owner = APIClient()
    owner.force_authenticate(user=provider.owner)
    (row,) = owner.get("/api/v1/billing/earnings/").json()
    assert row["provider_id"] == provider.pk
    assert row["earned_total_micros"] == row["earned_this_month_micros"] == earned.amount_micros
    assert row["balance_micros"] == earned.amount_micros and row["paid_out_micros"] == 0
    assert [(e["kind"], e["rental"]) for e in row["entries"]] == [
        ("earning", str(booked.rental.pk))
    ]

    stranger = APIClient()
    stranger.force_authenticate(user=UserFactory())
    assert stranger.get("/api/v1/billing/earnings/").json() == []
