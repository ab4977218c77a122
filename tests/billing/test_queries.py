"""Each hand-written statement of billing/queries.py against the same question asked through the
ORM, on rows made by the real services."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
from django.db import connection, transaction
from django.db.models import Count, F, Max, Min, Sum
from django.db.models.functions import TruncMinute
from django.utils import timezone

from billing import queries
from billing.models import (
    Account,
    AccountKind,
    EntryKind,
    FundsHold,
    LedgerEntry,
    TelemetryMinute,
    TelemetrySample,
    UsageMeter,
    UsageSegment,
)
from billing.selectors import month_start
from billing.services import (
    account_for_team,
    billing_pass_run,
    telemetry_ingest,
    usage_reports_apply,
)
from billing.services.metering import COPY_THRESHOLD, UsageReport
from core.money import cost_micros
from core.rows import insert_values
from marketplace import lifecycle
from marketplace.models import Rental
from tests.factories import UserFactory, personal_team

pytestmark = pytest.mark.django_db

ACTIVE = [str(s) for s in lifecycle.ACTIVE]
BURNING = [str(s) for s in lifecycle.BURNING]


def _fields(obj) -> dict:
    return {f.attname: getattr(obj, f.attname) for f in obj._meta.concrete_fields}


@pytest.fixture
def usage(make_node, book, user):
    """Two rentals of the user's team at prices that never come out even, one capped, each
    with 40 minutes of GPU time confirmed and a billing pass run; then usage rated and not yet
    posted on the first."""
    make_node(price="1.2345", gpus=8)
    make_node(price="0.7777", gpus=8)
    first = book(gpus=2, hours=3, hours_ago=1)
    second = book(gpus=1, hours=2, hours_ago=1, max_charge="5.00")
    for booked in (first, second):
        booked.report(seq=1, confirmed_s=2400)
    billing_pass_run(now=timezone.now())
    UsageMeter.objects.filter(rental=first.rental).update(
        charge_micros=F("posted_charge_micros") + 1234
    )
    return first, second


def _orm_held(team_id: int) -> int:
    """The holds of the team's unfinished rentals, in Python over rows the ORM reads."""
    total = 0
    for rental in Rental.objects.filter(team_id=team_id, status__in=ACTIVE):
        hold = FundsHold.objects.filter(rental=rental).first()
        if hold is None:
            continue
        if rental.price_per_gpu_hour is None:
            whole = hold.amount_micros
        else:
            whole = cost_micros(
                price_per_gpu_hour=rental.price_per_gpu_hour,
                gpu_seconds=rental.gpus_per_node * rental.node_count * rental.duration_s,
                round_up=True,
            )
        if hold.max_charge_micros is not None:
            whole = min(whole, hold.max_charge_micros)
        charged = UsageMeter.objects.filter(rental=rental).aggregate(s=Sum("charge_micros"))["s"]
        total += max(whole - (charged or 0), 0)
    return total


def _orm_accrued(team_id: int) -> int:
    meters = UsageMeter.objects.filter(rental__team_id=team_id)
    return sum(m.charge_micros - m.posted_charge_micros for m in meters)


def test_team_owed_is_the_accrued_usage_and_the_holds_the_orm_adds_up(usage, user):
    team_id = personal_team(user).pk
    accrued, held = queries.team_owed(team_id=team_id, active=ACTIVE)
    assert accrued == _orm_accrued(team_id) == 1234
    assert held == _orm_held(team_id)
    assert held > 0


def test_team_account_locked_reads_the_row_the_orm_reads(usage, user):
    team = personal_team(user)
    with transaction.atomic():
        locked = queries.team_account_locked(team_id=team.pk)
    assert _fields(locked) == _fields(
        Account.objects.get(kind=AccountKind.CUSTOMER, team_id=team.pk)
    )
    assert queries.team_account_locked(team_id=personal_team(UserFactory()).pk) is None


def test_the_hold_insert_writes_the_row_the_orm_would(usage, user):
    first, _ = usage
    team = personal_team(user)
    FundsHold.objects.filter(rental=first.rental).delete()
    hold = FundsHold(rental=first.rental, price_per_gpu_hour=Decimal("1.2345"), amount_micros=777)
    fields, sql = queries.hold_insert_statement()
    with connection.cursor() as cursor:
        cursor.execute(sql, [*insert_values(hold, fields), team.pk])
    stored = FundsHold.objects.get(rental=first.rental)
    assert stored.account_id == account_for_team(team=team).pk
    assert (stored.price_per_gpu_hour, stored.amount_micros, stored.max_charge_micros) == (
        Decimal("1.2345"),
        777,
        None,
    )


def test_a_ledger_entry_insert_returns_the_stored_row_and_a_replay_nothing(user):
    account = account_for_team(team=personal_team(user))
    now = timezone.now()
    entry = queries.ledger_entry_insert(
        account_id=account.pk,
        kind=EntryKind.ADJUSTMENT,
        amount_micros=5_000_000_000,
        key="k-1",
        memo="m",
        actor_id=user.pk,
        now=now,
    )
    assert _fields(entry) == _fields(LedgerEntry.objects.get(key="k-1"))
    again = queries.ledger_entry_insert(
        account_id=account.pk,
        kind=EntryKind.ADJUSTMENT,
        amount_micros=1,
        key="k-1",
        memo="",
        actor_id=None,
        now=now,
    )
    assert again is None
    assert LedgerEntry.objects.filter(key="k-1").count() == 1


def test_month_spent_is_the_ledger_and_accrued_usage_the_orm_sums(usage, user):
    team = personal_team(user)
    account = account_for_team(team=team)
    unbudgeted = account_for_team(team=personal_team(UserFactory()))
    now = timezone.now()
    since = month_start(now)
    assert queries.accounts_month_spent(month_start=since, burning=BURNING) == []
    Account.objects.filter(pk=account.pk).update(monthly_budget_micros=10**12)
    posted = LedgerEntry.objects.filter(
        account=account, kind=EntryKind.USAGE, created_at__gte=since
    ).aggregate(s=Sum("amount_micros"))["s"]
    rate = Rental.objects.filter(
        team=team, status__in=BURNING, price_per_gpu_hour__isnull=False
    ).aggregate(s=Sum(F("price_per_gpu_hour") * F("gpus_per_node") * F("node_count")))["s"]
    expected = (
        account.pk,
        -posted + _orm_accrued(team.pk),
        cost_micros(price_per_gpu_hour=rate, gpu_seconds=3600),
    )
    assert queries.accounts_month_spent(month_start=since, burning=BURNING) == [expected]
    assert queries.accounts_month_spent(
        month_start=since, burning=BURNING, account_id=unbudgeted.pk, budgeted_only=False
    ) == [(unbudgeted.pk, 0, 0)]


def test_capped_rentals_are_the_orm_s_caps_charges_rates_and_confirmations(usage):
    _, capped = usage
    rental = Rental.objects.get(pk=capped.rental.pk)
    hold = FundsHold.objects.get(rental=rental)
    charged = UsageMeter.objects.filter(rental=rental).aggregate(s=Sum("charge_micros"))["s"]
    last_per_node = (
        UsageSegment.objects.filter(rental=rental)
        .values("node_id")
        .annotate(last=Max("confirmed_until"))
    )
    assert len(last_per_node) == rental.node_count
    confirmed = min(row["last"] for row in last_per_node)
    per_hour = cost_micros(
        price_per_gpu_hour=rental.price_per_gpu_hour,
        gpu_seconds=3600 * rental.gpus_per_node * rental.node_count,
    )
    assert queries.capped_rentals(burning=BURNING) == [
        (rental.pk, rental.team_id, hold.max_charge_micros, charged, per_hour, confirmed)
    ]


def test_usage_reports_apply_stores_what_the_orm_reads_back(make_node, book):
    make_node(gpus=8)
    booked = book(gpus=2, hours=2, hours_ago=1)
    node_id = booked.node_ids[0]
    reports = [
        UsageReport(
            rental_id=booked.rental.pk,
            run_id="run-1",
            seq=seq,
            gpu_count=2,
            started_at=booked.at(0),
            confirmed_at=booked.at(confirmed),
        )
        for seq, confirmed in ((1, 600), (2, 1200))
    ]
    stranger = uuid.uuid4()
    reports.append(
        UsageReport(
            rental_id=stranger,
            run_id="run-1",
            seq=3,
            gpu_count=1,
            started_at=booked.at(0),
            confirmed_at=booked.at(60),
        )
    )
    result = usage_reports_apply(node_id=node_id, reports=reports)
    segments = UsageSegment.objects.filter(node_id=node_id)
    meters = UsageMeter.objects.filter(node_id=node_id)
    assert result.applied == 2
    assert [i for i, *_ in result.rejected] == [2]
    assert list(segments.values_list("rental_id", flat=True)) == [booked.rental.pk]
    segment = segments.get(rental=booked.rental)
    assert (segment.started_at, segment.confirmed_until, segment.first_seq, segment.last_seq) == (
        booked.at(0),
        booked.at(1200),
        1,
        2,
    )
    assert segment.reports == 2
    assert set(meters.values_list("rental_id", flat=True)) == set(
        segments.values_list("rental_id", flat=True)
    )
    meter = meters.get(rental=booked.rental)
    assert meter.price_per_gpu_hour == Rental.objects.get(pk=booked.rental.pk).price_per_gpu_hour


def _orm_rollups(node_id: int) -> dict:
    """The per-minute rollups the ORM computes from the raw samples."""
    rows = (
        TelemetrySample.objects.filter(node_id=node_id)
        .annotate(minute=TruncMinute("ts"))
        .values("gpu_index", "minute")
        .annotate(
            n=Count("id"),
            util_sum=Sum("util_pct"),
            util_max=Max("util_pct"),
            mem_max=Max("mem_used_mb"),
            power_sum=Sum("power_w"),
            temp_max=Max("temp_c"),
        )
    )
    return {
        (r["gpu_index"], r["minute"]): (
            r["n"],
            r["util_sum"],
            r["util_max"],
            r["mem_max"],
            r["power_sum"],
            r["temp_max"],
        )
        for r in rows
    }


def _stored_rollups(node_id: int) -> dict:
    return {
        (r.gpu_index, r.minute): (
            r.samples,
            r.util_sum,
            r.util_max,
            r.mem_max_mb,
            r.power_sum,
            r.temp_max,
        )
        for r in TelemetryMinute.objects.filter(node_id=node_id)
    }


@pytest.mark.parametrize("count", [7, COPY_THRESHOLD + 10], ids=["one-statement", "copy"])
def test_telemetry_rollups_equal_the_orm_s_per_minute_aggregates(make_node, count):
    node = make_node()
    t0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
    samples = [
        {
            "gpu_index": i % 4,
            "ts": t0 + timedelta(seconds=7 * i),
            "util_pct": float(i % 97),
            "mem_used_mb": 100 + i % 13,
            "power_w": float(i % 5) / 4,
            "temp_c": float(30 + i % 11),
        }
        for i in range(count)
    ]
    assert telemetry_ingest(node_id=node.pk, samples=samples) == count
    assert _stored_rollups(node.pk) == _orm_rollups(node.pk)


def test_the_pass_rates_each_meter_at_the_one_formula_and_balances_follow_the_ledger(usage):
    for meter in UsageMeter.objects.all():
        assert meter.posted_charge_micros == cost_micros(
            price_per_gpu_hour=meter.price_per_gpu_hour, gpu_seconds=meter.gpu_seconds
        )
        assert meter.gpu_seconds == 2400 * meter.rental.gpus_per_node
    for account in Account.objects.all():
        entries = LedgerEntry.objects.filter(account=account).aggregate(s=Sum("amount_micros"))
        assert account.balance_micros == (entries["s"] or 0)
    usage_debits = LedgerEntry.objects.filter(kind=EntryKind.USAGE).aggregate(
        s=Sum("amount_micros")
    )["s"]
    assert -usage_debits == UsageMeter.objects.aggregate(s=Sum("posted_charge_micros"))["s"]


def test_billing_accounts_ensure_makes_the_accounts_the_orm_finds_missing(make_node, book):
    make_node(gpus=8)
    booked = book(gpus=1, hours=2, hours_ago=1)
    booked.report(seq=1, confirmed_s=600)
    bounds = UsageMeter.objects.aggregate(low=Min("id"), high=Max("id"))
    queries.billing_pass_tables_create()
    with transaction.atomic():
        rated = queries.meters_rate(
            params={
                "first_id": bounds["low"],
                "end_id": bounds["high"] + 1,
                "grace": timedelta(seconds=30),
                "moves": ["running", "stopping", "completed", "failed", "preempted", "pending"],
            }
        )
    assert rated == UsageMeter.objects.count()
    queries.billing_accounts_ensure(params={"now": timezone.now()})
    queries.billing_pass_tables_drop()
    meters = UsageMeter.objects.all()
    assert set(meters.values_list("node__provider_id", flat=True)) == set(
        Account.objects.filter(kind=AccountKind.PROVIDER).values_list("provider_id", flat=True)
    )
    assert set(meters.values_list("rental__team_id", flat=True)) == set(
        Account.objects.filter(kind=AccountKind.CUSTOMER).values_list("team_id", flat=True)
    )


def test_team_positions_are_the_orm_s_balances_accrued_usage_and_burn(usage, user):
    team = personal_team(user)
    account = Account.objects.get(kind=AccountKind.CUSTOMER, team=team)
    rate = Rental.objects.filter(
        team=team, status__in=BURNING, price_per_gpu_hour__isnull=False
    ).aggregate(s=Sum(F("price_per_gpu_hour") * F("gpus_per_node") * F("node_count")))["s"]
    assert queries.team_positions(burning=BURNING) == [
        (
            team.pk,
            account.pk,
            account.balance_micros - _orm_accrued(team.pk),
            cost_micros(price_per_gpu_hour=rate, gpu_seconds=3600),
            account.low_balance_since is not None,
            account.depleted_since is not None,
        )
    ]
