"""Every read of billing, scoped to the asking team where a customer asks."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal

from django.db.models import F, Q, QuerySet, Sum
from django.utils import timezone

from accounts.models import Team
from billing import conf, queries, stripe_adapter
from billing.models import (
    Account,
    AccountKind,
    BalanceNotice,
    EntryKind,
    FundsHold,
    Invoice,
    LedgerEntry,
    Payout,
    TelemetryMinute,
    TelemetrySample,
    TopUp,
    UsageMeter,
    UsageSegment,
)
from core.money import cost_micros
from marketplace import lifecycle
from marketplace.models import Node, Provider, Rental, User


@dataclass(frozen=True, slots=True)
class AccountSummary:
    """A team's money right now, in micro-dollars."""

    account: Account | None
    balance_micros: int
    accrued_micros: int
    held_micros: int
    available_micros: int
    hourly_burn_micros: int


def team_account(*, team_id: int) -> Account | None:
    return Account.objects.filter(kind=AccountKind.CUSTOMER, team_id=team_id).first()


def team_accrued_micros(*, team_id: int) -> int:
    """Usage rated but not yet posted to the ledger (it still counts against the balance)."""
    return (
        UsageMeter.objects.filter(rental__team_id=team_id)
        .exclude(charge_micros=F("posted_charge_micros"))
        .aggregate(s=Sum(F("charge_micros") - F("posted_charge_micros")))["s"]
        or 0
    )


def team_hourly_burn_micros(*, team_id: int) -> int:
    """What the team's provisioning and running rentals cost per hour."""
    rate = Rental.objects.filter(
        team_id=team_id, status__in=lifecycle.BURNING, price_per_gpu_hour__isnull=False
    ).aggregate(s=Sum(F("price_per_gpu_hour") * F("gpus_per_node") * F("node_count")))["s"]
    return cost_micros(price_per_gpu_hour=rate, gpu_seconds=3600) if rate else 0


def team_held_micros(*, team_id: int) -> int:
    """What the team's unfinished rentals may still cost: each hold, at the price locked at
    placement once there is one (at the estimate of its creation before), never more than the
    rental's own cap (max_charge), less what the rental
    has been charged so far, never below zero; a rental that has ended holds nothing.

    Computed from the rows each time rather than kept as a counter, so it cannot drift: a
    charge lowers the hold as it lowers the balance (or is accrued), and an end releases it.
    """
    return queries.team_owed(team_id=team_id, active=_active())[1]


def team_available_micros(*, team_id: int, balance_micros: int | None = None) -> int:
    """What a new rental or a refund can use: the balance less accrued usage and holds.
    `balance_micros` is the balance the caller read under the account's row lock."""
    if balance_micros is None:
        account = team_account(team_id=team_id)
        balance_micros = account.balance_micros if account else 0
    accrued, held = queries.team_owed(team_id=team_id, active=_active())
    return balance_micros - accrued - held


def team_owed_statement(*, team_id: int) -> tuple[str, list]:
    """The one statement behind team_available_micros: the team's accrued usage and its holds
    (one row: accrued, held), for a caller that sends it together with its lock."""
    return queries.team_owed_statement(team_id=team_id, active=_active())


def _active() -> list[str]:
    return [str(s) for s in lifecycle.ACTIVE]


def account_summary(*, team: Team) -> AccountSummary:
    account = team_account(team_id=team.pk)
    balance = account.balance_micros if account else 0
    accrued = team_accrued_micros(team_id=team.pk)
    held = team_held_micros(team_id=team.pk)
    return AccountSummary(
        account=account,
        balance_micros=balance,
        accrued_micros=accrued,
        held_micros=held,
        available_micros=balance - accrued - held,
        hourly_burn_micros=team_hourly_burn_micros(team_id=team.pk),
    )


def notice_list(*, team: Team) -> QuerySet[BalanceNotice]:
    return BalanceNotice.objects.filter(
        account__kind=AccountKind.CUSTOMER, account__team=team
    ).order_by("-created_at", "-id")


def ledger_list(*, team: Team) -> QuerySet[LedgerEntry]:
    return (
        LedgerEntry.objects.filter(account__kind=AccountKind.CUSTOMER, account__team=team)
        .select_related("rental")
        .order_by("-created_at", "-id")
    )


def topup_list(*, team: Team) -> QuerySet[TopUp]:
    return TopUp.objects.filter(account__kind=AccountKind.CUSTOMER, account__team=team).order_by(
        "-created_at"
    )


def invoice_list(*, team: Team) -> QuerySet[Invoice]:
    return Invoice.objects.filter(account__kind=AccountKind.CUSTOMER, account__team=team).order_by(
        "-period_start", "-id"
    )


def invoice_get(*, team: Team, invoice_id: int) -> Invoice | None:
    """One of the team's statements with its lines; another team's id gives None."""
    return (
        invoice_list(team=team)
        .select_related("account__team")
        .prefetch_related("lines")
        .filter(pk=invoice_id)
        .first()
    )


def team_rental(*, team: Team, rental_id) -> Rental | None:
    return Rental.objects.filter(pk=rental_id, team=team).first()


def rental_telemetry(
    *, rental: Rental, since: datetime, until: datetime, gpu_index: int | None = None
) -> QuerySet[TelemetryMinute]:
    rows = TelemetryMinute.objects.filter(
        rental=rental, minute__gte=since, minute__lt=until
    ).select_related("node")
    if gpu_index is not None:
        rows = rows.filter(gpu_index=gpu_index)
    return rows.order_by("minute", "node_id", "gpu_index")


# Raw samples answer a window up to this long; a longer one is drawn from the minute rollups.
RAW_SERIES_MAX_S = 2 * 3600
SERIES_MAX_POINTS = 600


def rental_gpu_series(*, rental: Rental, since: datetime, until: datetime) -> dict:
    """Per-GPU time series of a rental for charts: `{"resolution", "series": [{node, gpu_index,
    points: [[unix_s, util_pct, mem_mb, power_w, temp_c], ...]}]}`, at most SERIES_MAX_POINTS
    points per GPU (evenly thinned). Raw samples for a short window, minute rollups (average
    utilisation and power, peak memory and temperature) for a long one."""
    raw = (until - since).total_seconds() <= RAW_SERIES_MAX_S
    series: dict[tuple[int, int], list[list[float]]] = {}
    if raw:
        rows = (
            TelemetrySample.objects.filter(rental_id=rental.pk, ts__gte=since, ts__lt=until)
            .order_by("ts")
            .values_list(
                "node_id", "gpu_index", "ts", "util_pct", "mem_used_mb", "power_w", "temp_c"
            )
        )
        for node_id, gpu, ts, util, mem, power, temp in rows:
            series.setdefault((node_id, gpu), []).append([ts.timestamp(), util, mem, power, temp])
    else:
        rows = (
            TelemetryMinute.objects.filter(rental=rental, minute__gte=since, minute__lt=until)
            .order_by("minute")
            .values_list(
                "node_id", "gpu_index", "minute", "samples", "util_sum", "mem_max_mb",
                "power_sum", "temp_max",
            )
        )  # fmt: skip
        for node_id, gpu, minute, n, util_sum, mem, power_sum, temp in rows:
            point = [minute.timestamp(), util_sum / n, mem, power_sum / n, temp]
            series.setdefault((node_id, gpu), []).append(point)
    hostnames = dict(
        Node.objects.filter(pk__in={node for node, _ in series}).values_list("pk", "hostname")
    )
    out = []
    for (node_id, gpu), points in sorted(series.items()):
        if len(points) > SERIES_MAX_POINTS:
            step = len(points) / SERIES_MAX_POINTS
            points = [points[int(i * step)] for i in range(SERIES_MAX_POINTS)] + [points[-1]]
        out.append({"node": hostnames.get(node_id, str(node_id)), "gpu_index": gpu,
                    "points": [[round(v, 3) for v in p] for p in points]})  # fmt: skip
    return {"resolution": "raw" if raw else "minute", "series": out}


def rental_segments(*, rental: Rental) -> QuerySet[UsageSegment]:
    return (
        UsageSegment.objects.filter(rental=rental)
        .select_related("node")
        .order_by("started_at", "id")
    )


def rental_meters(*, rental: Rental) -> QuerySet[UsageMeter]:
    return UsageMeter.objects.filter(rental=rental).select_related("node").order_by("node_id")


def month_start(now: datetime) -> datetime:
    """The first instant of `now`'s calendar month in UTC: monthly budgets count from it."""
    return now.astimezone(UTC).replace(day=1, hour=0, minute=0, second=0, microsecond=0)


@dataclass(frozen=True, slots=True)
class AccountLimits:
    """An account's limits in force: the customer's own, never above the ceiling (ops' value
    for the account, else the setting); 0 means no limit."""

    max_concurrent_gpus: int
    max_rentals_per_minute: int
    ceiling_concurrent_gpus: int
    ceiling_rentals_per_minute: int


def _in_force(own: int | None, ceiling: int) -> int:
    if own is None:
        return ceiling
    return own if ceiling == 0 else min(own, ceiling)


def account_limits(*, account: Account) -> AccountLimits:
    gpus = account.ops_max_concurrent_gpus
    per_minute = account.ops_max_rentals_per_minute
    gpu_ceiling = conf.max_concurrent_gpus() if gpus is None else gpus
    rate_ceiling = conf.max_rentals_per_minute() if per_minute is None else per_minute
    return AccountLimits(
        max_concurrent_gpus=_in_force(account.max_concurrent_gpus, gpu_ceiling),
        max_rentals_per_minute=_in_force(account.max_rentals_per_minute, rate_ceiling),
        ceiling_concurrent_gpus=gpu_ceiling,
        ceiling_rentals_per_minute=rate_ceiling,
    )


def account_active_gpus(*, account: Account) -> int:
    """GPUs of the account's rentals that are not over: waiting, placed, starting, running or
    stopping (each holds, or will hold, its GPUs)."""
    return (
        Rental.objects.filter(team_id=account.team_id, status__in=lifecycle.ACTIVE).aggregate(
            n=Sum(F("gpus_per_node") * F("node_count"))
        )["n"]
        or 0
    )


def account_rentals_created_since(*, account: Account, since: datetime) -> list[datetime]:
    """When each of the account's rentals created since `since` was created, oldest first."""
    return list(
        Rental.objects.filter(team_id=account.team_id, created_at__gte=since)
        .order_by("created_at")
        .values_list("created_at", flat=True)
    )


@dataclass(frozen=True, slots=True)
class MonthSpent:
    """A budgeted account's month so far, in micro-dollars."""

    spent_micros: int
    hourly_burn_micros: int


def accounts_month_spent(*, now: datetime, account_id: int | None = None) -> dict[int, MonthSpent]:
    """Account id -> this month's usage charges and hourly burn, for every account with a
    monthly budget (or only `account_id`): one statement for all of them."""
    rows = queries.accounts_month_spent(
        month_start=month_start(now), burning=_burning(), account_id=account_id
    )
    return {account: MonthSpent(spent, burn) for account, spent, burn in rows}


def account_month_spent_micros(*, account: Account, now: datetime | None = None) -> int:
    if account.pk is None:
        return 0
    rows = queries.accounts_month_spent(
        month_start=month_start(now or timezone.now()),
        burning=_burning(),
        account_id=account.pk,
        budgeted_only=False,
    )
    return rows[0][1] if rows else 0


def _burning() -> list[str]:
    return [str(s) for s in lifecycle.BURNING]


@dataclass(frozen=True, slots=True)
class BudgetSummary:
    """An account's budgets and limits with where it stands against each, for the billing page,
    the API and the CLI."""

    account: Account
    limits: AccountLimits
    monthly_budget_micros: int | None
    budget_warn_percent: int
    month_spent_micros: int
    held_micros: int
    active_gpus: int
    rentals_last_minute: int
    billing_pass_interval_s: int


def budget_summary(*, team: Team, now: datetime | None = None) -> BudgetSummary:
    """The team's budgets and limits; before the account exists, its defaults."""
    now = now or timezone.now()
    account = team_account(team_id=team.pk) or Account(kind=AccountKind.CUSTOMER, team=team)
    return BudgetSummary(
        account=account,
        limits=account_limits(account=account),
        monthly_budget_micros=account.monthly_budget_micros,
        budget_warn_percent=account.budget_warn_percent,
        month_spent_micros=account_month_spent_micros(account=account, now=now),
        held_micros=team_held_micros(team_id=team.pk),
        active_gpus=account_active_gpus(account=account),
        rentals_last_minute=len(
            account_rentals_created_since(account=account, since=now - timedelta(minutes=1))
        ),
        billing_pass_interval_s=conf.billing_pass_interval_s(),
    )


def rental_cap(*, rental: Rental) -> tuple[int | None, int | None]:
    """The rental's own cap on its charge (max_charge) and how far past it the charge can go
    (at the locked price, or the most it can be placed at before), in micro-dollars."""
    hold = FundsHold.objects.filter(rental=rental).only("max_charge_micros", "price_per_gpu_hour")
    hold = hold.first()
    if hold is None or hold.max_charge_micros is None:
        return None, None
    price = rental.price_per_gpu_hour or hold.price_per_gpu_hour
    return hold.max_charge_micros, cap_overrun_bound_micros(
        price_per_gpu_hour=price, gpus=rental.gpu_count
    )


def cap_overrun_bound_micros(*, price_per_gpu_hour: Decimal, gpus: int) -> int:
    """How far past its cap a capped rental's charge can go: what it costs during one billing
    pass interval (see billing.services.rating for why), rounded up to a whole micro."""
    return cost_micros(
        price_per_gpu_hour=price_per_gpu_hour,
        gpu_seconds=gpus * conf.billing_pass_interval_s(),
        round_up=True,
    )


@dataclass(frozen=True, slots=True)
class ProviderEarnings:
    """What a provider has earned and been paid, in micro-dollars (its share, after the fee)."""

    provider: Provider
    balance_micros: int  # earned and not yet paid out
    earned_this_month_micros: int
    earned_total_micros: int
    paid_out_micros: int
    entries: list[LedgerEntry]
    payouts: list[Payout]


def provider_earnings(*, owner: User, entries: int = 50) -> list[ProviderEarnings]:
    """Earnings of each provider the user owns, with the latest entries and payouts."""
    month = timezone.now().replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    out = []
    for provider in Provider.objects.filter(owner=owner).order_by("name"):
        account = Account.objects.filter(kind=AccountKind.PROVIDER, provider=provider).first()
        if account is None:
            out.append(ProviderEarnings(provider, 0, 0, 0, 0, [], []))
            continue
        ledger = LedgerEntry.objects.filter(account=account)
        sums = ledger.aggregate(
            total=Sum("amount_micros", filter=Q(kind=EntryKind.EARNING)),
            month=Sum("amount_micros", filter=Q(kind=EntryKind.EARNING, created_at__gte=month)),
            paid=Sum(
                "amount_micros", filter=Q(kind__in=[EntryKind.PAYOUT, EntryKind.PAYOUT_REVERSAL])
            ),
        )
        out.append(
            ProviderEarnings(
                provider=provider,
                balance_micros=account.balance_micros,
                earned_this_month_micros=sums["month"] or 0,
                earned_total_micros=sums["total"] or 0,
                paid_out_micros=-(sums["paid"] or 0),
                entries=list(
                    ledger.select_related("rental").order_by("-created_at", "-id")[:entries]
                ),
                payouts=list(Payout.objects.filter(account=account).order_by("-created_at")[:20]),
            )
        )
    return out


@dataclass(frozen=True, slots=True)
class PayoutSetup:
    """How a provider is paid: through Stripe Connect (where the server has Connect enabled),
    else by hand by ops."""

    by_stripe: bool
    connect_account_id: str


def provider_payout_setup(*, provider: Provider) -> PayoutSetup:
    account = Account.objects.filter(kind=AccountKind.PROVIDER, provider=provider).first()
    return PayoutSetup(
        by_stripe=stripe_adapter.connect_enabled(),
        connect_account_id=account.stripe_connect_account_id if account else "",
    )
