"""Budgets and limits: a rental stopped at its own cap by the billing pass, the monthly budget
refusing new rentals and stopping running ones after a warning, limits refused with a 4xx that
names them, and bad input refused naming the field, nothing changed."""

from __future__ import annotations

from decimal import Decimal

import pytest
from django.test import Client
from django.urls import reverse

from billing.models import Account, BalanceNotice, FundsHold, NoticeKind
from billing.selectors import cap_overrun_bound_micros
from billing.services import (
    account_budgets_set,
    account_ceilings_set,
    account_for_team,
    billing_pass_run,
)
from marketplace.lifecycle import BUDGET_REACHED
from marketplace.models import Rental, RentalEvent, RentalStatus
from notifications.models import Notification, NotificationKind
from tests.billing.conftest import usd
from tests.factories import UserFactory, personal_team

pytestmark = pytest.mark.django_db

BODY = {"gpus_per_node": 1, "duration_s": 3 * 3600, "runtime": {"image": "gpumarket/harness:dev"}}


def _stop_event(rental: Rental) -> RentalEvent:
    return RentalEvent.objects.get(rental=rental, to_status=RentalStatus.STOPPING)


@pytest.mark.parametrize(
    ("lag_s", "late_pass_s"),
    [
        (5, 0),  # the agent confirms every few seconds, every pass on time
        (55, 0),  # confirmations lag almost a whole pass: planned for
        (5, 60),  # one pass runs a whole interval late: the stated bound still holds
    ],
)
def test_a_capped_rental_is_stopped_by_the_billing_pass_within_the_stated_bound(
    make_node, book, user, settings, lag_s, late_pass_s
):
    # Given a 1-GPU rental at $3.60 per GPU-hour ($0.001 a second) capped at $1.00, running
    interval = settings.CELERY_BEAT_SCHEDULE["billing-pass"]["schedule"].total_seconds()
    assert interval == 60
    make_node(price="3.60")
    booked = book(gpus=1, hours=3, hours_ago=2, max_charge="1.00")
    rental = booked.rental
    cap = usd("1.00")
    bound = cap_overrun_bound_micros(price_per_gpu_hour=Decimal("3.60"), gpus=1)
    assert bound == 60_000  # one 60 s billing pass at $0.001 a second
    # The hold of a capped rental is its cap, not its 3 booked hours ($10.80)
    assert FundsHold.objects.get(rental=rental).amount_micros == cap

    # When the agent confirms usage `lag_s` behind each pass and the pass runs every minute
    # (one of them late by `late_pass_s`), until a pass stops the rental
    seq, t, stopped_at = 0, 0, None
    while stopped_at is None:
        t += 60
        if t == 960:
            t += late_pass_s
        seq += 1
        booked.report(seq=seq, confirmed_s=t - lag_s)
        result = billing_pass_run(now=booked.at(t))
        rental.refresh_from_db()
        if rental.status == RentalStatus.STOPPING:
            stopped_at = t
            assert result.budgets_reached == 1 and result.rentals_stopped == 1
        assert t < 1200, "the cap never stopped the rental"
    # The agent uses the whole stop grace to checkpoint, confirming usage until it exits
    booked.report(seq=seq + 1, confirmed_s=stopped_at + 30, final=True)
    billing_pass_run(now=booked.at(stopped_at + 60))

    # Then the rental was stopped by billing with the budget reason, and the final charge is
    # within the cap plus one billing pass's worth
    event = _stop_event(rental)
    assert event.actor_kind == RentalEvent.Actor.BILLING
    assert event.reason.startswith(f"{BUDGET_REACHED}: charged $")
    assert "$1.00 cap" in event.reason
    charge = sum(rental.usage_meters.values_list("charge_micros", flat=True))
    assert charge == (stopped_at + 30) * 1000
    assert charge <= cap + bound
    # On schedule, the planning stops it before the cap: at 960 s, when 960 + 90 s would pass it
    assert stopped_at == (960 + late_pass_s if late_pass_s else 960)
    if not late_pass_s:
        assert charge <= cap
    # One notice for this rental, for notifications to pick up; a later pass adds none
    notices = BalanceNotice.objects.filter(kind=NoticeKind.BUDGET_REACHED)
    assert list(notices.values_list("rental_id", flat=True)) == [rental.pk]
    billing_pass_run(now=booked.at(stopped_at + 120))
    assert notices.count() == 1
    # and the owner is told once
    told = Notification.objects.filter(
        team=personal_team(user), kind=NotificationKind.BUDGET_REACHED
    )
    assert list(told.values_list("source_key", flat=True)) == [f"budget:rental:{rental.pk}"]


def test_the_rental_usage_api_states_the_cap_and_its_bound(make_node, book, user, auth_api):
    make_node(price="3.60")
    booked = book(gpus=2, hours=1, hours_ago=0, max_charge="5.00")
    body = auth_api.get(f"/api/v1/billing/rentals/{booked.rental.pk}/usage/").json()
    assert body["max_charge_micros"] == usd("5.00")
    assert body["cap_overrun_bound_micros"] == 120_000  # 2 GPUs x 60 s x $0.001


def test_the_monthly_budget_warns_then_stops_running_rentals(make_node, book, user, settings):
    # Given a running 1-GPU rental at $3.60/h and a monthly budget of $2.00, warned at 50 %
    make_node(price="3.60")
    booked = book(gpus=1, hours=3, hours_ago=2)
    account = account_for_team(team=personal_team(user))
    account_budgets_set(
        account_id=account.pk, actor=user, monthly_budget=Decimal("2.00"), budget_warn_percent=50
    )
    notices = BalanceNotice.objects.filter(account=account)

    # When $1.20 is charged: one warning, nothing stopped
    booked.report(seq=1, confirmed_s=1200)
    billing_pass_run(now=booked.at(1205))
    booked.report(seq=2, confirmed_s=1260)
    billing_pass_run(now=booked.at(1265))
    assert list(notices.values_list("kind", flat=True)) == [NoticeKind.BUDGET_WARNING]
    booked.rental.refresh_from_db()
    assert booked.rental.status == RentalStatus.RUNNING

    # When the charge would reach $2.00 before the next pass and its stop grace end
    # ($1.95 + 90 s at $0.001)
    booked.report(seq=3, confirmed_s=1950)
    result = billing_pass_run(now=booked.at(1955))

    # Then the rental is stopped with the budget reason, and one notice says so
    booked.rental.refresh_from_db()
    assert booked.rental.status == RentalStatus.STOPPING
    assert booked.rental.status_reason.startswith(
        f"{BUDGET_REACHED}: the account's monthly budget of $2.00 is reached"
    )
    assert result.rentals_stopped == 1 and result.budgets_reached == 1
    assert list(notices.order_by("id").values_list("kind", flat=True)) == [
        NoticeKind.BUDGET_WARNING,
        NoticeKind.BUDGET_REACHED,
    ]
    billing_pass_run(now=booked.at(2015))
    assert notices.count() == 2
    told = Notification.objects.filter(
        team=personal_team(user), kind=NotificationKind.BUDGET_REACHED
    )
    assert told.count() == 1 and "monthly budget of $2.00 reached" in told.get().summary


def test_the_monthly_budget_refuses_the_next_create_and_creates_nothing(
    make_node, book, user, auth_api
):
    # Given $1.80 charged this month (30 min at $3.60 per GPU-hour) on a 1-hour rental that
    # still holds the other $1.80, and a monthly budget of $10.00
    make_node(price="3.60")
    booked = book(gpus=1, hours=1, hours_ago=1)
    booked.report(seq=1, confirmed_s=1800)
    billing_pass_run(now=booked.at(3600))
    account = account_for_team(team=personal_team(user))
    account_budgets_set(account_id=account.pk, actor=user, monthly_budget=Decimal("10.00"))
    hour = {**BODY, "duration_s": 3600}
    # A rental holding $3.60 fits ($1.80 + $1.80 + $3.60 <= $10.00)
    r = auth_api.post("/api/v1/rentals/", hour, "json")
    assert r.status_code == 201, r.content
    rentals, holds = Rental.objects.count(), FundsHold.objects.count()

    # When the next one would hold $3.60 more
    r = auth_api.post("/api/v1/rentals/", hour, "json")

    # Then it is refused with a 409 naming the monthly budget and the amounts; nothing created
    assert r.status_code == 409, r.content
    body = r.json()
    assert body["code"] == "budget_exceeded"
    assert body["monthly_budget"] == [
        "this rental may cost $3.60; with $1.80 charged this month and $5.40 held for unfinished"
        " rentals that passes the monthly budget of $10.00"
    ]
    assert (Rental.objects.count(), FundsHold.objects.count()) == (rentals, holds)
    # A cap that keeps it within the budget lets it through: its hold is the cap
    r = auth_api.post("/api/v1/rentals/", {**hour, "max_charge": "2.80"}, "json")
    assert r.status_code == 201, r.content
    assert FundsHold.objects.get(rental_id=r.json()["id"]).amount_micros == usd("2.80")


def test_limits_are_refused_naming_them(make_node, user, auth_api, fund):
    make_node(price="1.00")
    fund(user, "100.00")
    account = account_for_team(team=personal_team(user))
    account_ceilings_set(account_id=account.pk, max_concurrent_gpus=4, max_rentals_per_minute=3)
    # GPUs: 3 + 2 > 4
    assert (
        auth_api.post("/api/v1/rentals/", {**BODY, "gpus_per_node": 3}, "json").status_code == 201
    )
    r = auth_api.post("/api/v1/rentals/", {**BODY, "gpus_per_node": 2}, "json")
    assert r.status_code == 409, r.content
    assert r.json()["code"] == "limit_exceeded"
    assert r.json()["max_concurrent_gpus"] == [
        "at most 4 GPUs at once (pending, placed or running) on this account: 3 in use and this"
        " rental asks for 2"
    ]
    # Per minute: the refused create did not count; the 4th within the minute is a 429
    assert auth_api.post("/api/v1/rentals/", BODY, "json").status_code == 201
    assert auth_api.post("/api/v1/rentals/", BODY, "json").status_code == 409  # 5 GPUs
    r = auth_api.post("/api/v1/rentals/", {**BODY, "gpus_per_node": 0}, "json")
    assert r.status_code == 400
    account_ceilings_set(account_id=account.pk, max_concurrent_gpus=None, max_rentals_per_minute=3)
    assert auth_api.post("/api/v1/rentals/", BODY, "json").status_code == 201
    before = Rental.objects.count()
    r = auth_api.post("/api/v1/rentals/", BODY, "json")
    assert r.status_code == 429, r.content
    assert r.json()["code"] == "rate_limited"
    assert r.json()["max_rentals_per_minute"][0].startswith(
        "at most 3 rentals created per minute on this account: try again in"
    )
    assert 1 <= int(r["Retry-After"]) <= 60
    assert Rental.objects.count() == before


def test_budgets_are_shown_and_set_through_the_api(user, auth_api):
    body = auth_api.get("/api/v1/billing/budgets/").json()
    assert body["monthly_budget_micros"] is None
    assert (body["max_concurrent_gpus"], body["ceiling_concurrent_gpus"]) == (0, 0)
    assert Account.objects.count() == 0  # reading creates nothing
    r = auth_api.patch(
        "/api/v1/billing/budgets/",
        {"monthly_budget": "250.50", "budget_warn_percent": 90, "max_concurrent_gpus": 8},
        "json",
    )
    assert r.status_code == 200, r.content
    body = r.json()
    assert (body["monthly_budget_micros"], body["budget_warn_percent"]) == (usd("250.50"), 90)
    assert body["max_concurrent_gpus"] == 8
    # A ceiling set by ops caps the customer's own limit, and refuses a higher one
    account = Account.objects.get(team__personal_of=user)
    account_ceilings_set(account_id=account.pk, max_concurrent_gpus=6, max_rentals_per_minute=None)
    body = auth_api.get("/api/v1/billing/budgets/").json()
    assert (body["max_concurrent_gpus"], body["ceiling_concurrent_gpus"]) == (6, 6)
    r = auth_api.patch("/api/v1/billing/budgets/", {"max_concurrent_gpus": 7}, "json")
    assert r.status_code == 400
    assert r.json()["max_concurrent_gpus"] == [
        "at most 6 on this account (ask support to raise the ceiling)"
    ]
    # null clears the budget
    r = auth_api.patch("/api/v1/billing/budgets/", {"monthly_budget": None}, "json")
    assert r.status_code == 200 and r.json()["monthly_budget_micros"] is None


@pytest.mark.parametrize("value", [-1, "-0.01", 0, "abc", 2**31, "1e400", "NaN", "1\x00", "0.001"])
def test_a_bad_max_charge_is_a_400_naming_it_and_creates_nothing(make_node, auth_api, value):
    make_node(price="1.00")
    r = auth_api.post("/api/v1/rentals/", {**BODY, "max_charge": value}, "json")
    assert r.status_code == 400, r.content
    assert "max_charge" in r.json()
    assert (Rental.objects.count(), FundsHold.objects.count()) == (0, 0)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("monthly_budget", -5),
        ("monthly_budget", "abc"),
        ("monthly_budget", 2**31),
        ("monthly_budget", "5\x00"),
        ("monthly_budget", "Infinity"),
        ("budget_warn_percent", 0),
        ("budget_warn_percent", 101),
        ("budget_warn_percent", "x"),
        ("max_concurrent_gpus", -1),
        ("max_concurrent_gpus", 2**31),
        ("max_concurrent_gpus", "\x00"),
        ("max_rentals_per_minute", 0),
        ("max_rentals_per_minute", "ten"),
        ("max_rentals_per_minute", 1.5),
        ("monthly_budgett", 5),
    ],
)
def test_bad_budget_input_is_a_400_naming_the_field_and_changes_nothing(
    user, auth_api, field, value
):
    account = account_for_team(team=personal_team(user))
    account_budgets_set(account_id=account.pk, actor=user, monthly_budget=Decimal("50.00"))
    before = Account.objects.filter(pk=account.pk).values().get()
    r = auth_api.patch("/api/v1/billing/budgets/", {field: value}, "json")
    assert r.status_code == 400, r.content
    assert field in r.json()
    assert Account.objects.filter(pk=account.pk).values().get() == before


def test_only_the_accounts_customer_may_change_its_budgets(user):
    from core.errors import NotFound

    other = UserFactory()
    account = account_for_team(team=personal_team(user))
    with pytest.raises(NotFound):
        account_budgets_set(account_id=account.pk, actor=other, monthly_budget=Decimal("1.00"))
    account.refresh_from_db()
    assert account.monthly_budget_micros is None


def test_the_billing_page_shows_and_the_admin_sets_the_limits(user, settings):
    settings.BILLING_MAX_CONCURRENT_GPUS = 64
    account = account_for_team(team=personal_team(user))
    account_budgets_set(account_id=account.pk, actor=user, monthly_budget=Decimal("300.00"))
    client = Client()
    client.force_login(user)
    page = client.get(reverse("billing-web-account")).content.decode()
    assert "Budgets and limits" in page
    assert 'id="monthly-budget">$300.00 · warned at 80 %' in page
    assert 'value="300.00"' in page
    assert "0 of 64 (ceiling 64)" in page
    # Ops lower the ceiling from the account's admin page
    ops = UserFactory(is_staff=True, is_superuser=True)
    client.force_login(ops)
    url = reverse("admin:billing_account_ceilings", args=[account.pk])
    assert client.get(url).status_code == 200
    r = client.post(url, {"max_concurrent_gpus": "16", "max_rentals_per_minute": ""})
    assert r.status_code == 302
    account.refresh_from_db()
    assert (account.ops_max_concurrent_gpus, account.ops_max_rentals_per_minute) == (16, None)
    staff = UserFactory(is_staff=True)
    client.force_login(staff)
    assert client.post(url, {"max_concurrent_gpus": "99"}).status_code == 403
    account.refresh_from_db()
    assert account.ops_max_concurrent_gpus == 16
