"""Budgets and limits: checked when a rental is created, enforced by the billing pass.

At creation (`rental_budgets_check`, called by the funds hold under the customer account's row
lock, so concurrent creates of one account take turns and each sees every rental and hold an
earlier one committed):
- rentals created in the last 60 s, this one included, at most the account's per-minute limit
  (429, Retry-After);
- GPUs of the account's unfinished rentals (pending, placed, starting, running, stopping), this
  one included, at most its concurrent-GPU limit (409);
- the month's usage charges + what unfinished rentals still hold + this rental's hold, at most
  the monthly budget (409).

Running (`budgets_enforce`, step 4 of every billing pass, after rating):
- a rental with its own cap (max_charge) is stopped, with the stop grace that lets the harness
  checkpoint, at the first pass where its charge plus what it can still accrue before the next
  pass would reach the cap:  charge + rate x (unconfirmed lag + pass interval + stop grace)
  >= cap. If that pass found it below, the next pass (at most one interval later) finds the
  charge + everything the agent may still confirm below the cap plus the interval's overrun: so
  the final charge is at most cap + rate x pass interval (`selectors.cap_overrun_bound_micros`),
  when passes run on schedule (a pass late by d adds rate x d);
- an account past `budget_warn_percent` of its monthly budget gets one BUDGET_WARNING notice a
  month; at the budget (same planning, with the account's hourly burn) its rentals are stopped
  and one BUDGET_REACHED notice is recorded.

Each stop goes through `lifecycle.rental_stop_for_budget` (reason "budget reached: ..."); each
notice is a BalanceNotice of kind BUDGET_WARNING or BUDGET_REACHED (with the rental for a
per-rental cap), and a BUDGET_REACHED one tells the owner (`budget_reached_notify`, once per
rental or per account and month) in the same transaction.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import Decimal, InvalidOperation

from django.db import transaction
from django.utils import timezone

from accounts.models import MONEY_ROLES, Membership
from agentprotocol import DEFAULT_STOP_GRACE_S
from billing import conf, queries, selectors
from billing.errors import BudgetExceeded, LimitExceeded, RateLimited
from billing.models import Account, BalanceNotice, NoticeKind
from core.errors import NotFound, ValidationFailed
from marketplace import lifecycle
from marketplace.models import Rental, User
from notifications.services import budget_reached_notify

# Dollar amounts a budget may be set to: a cent up to a million dollars.
MIN_BUDGET_USD = Decimal("0.01")
MAX_BUDGET_USD = Decimal(1_000_000)
# Limits a customer may set (never above the account's ceiling).
MAX_LIMIT = 100_000
RATE_WINDOW = timedelta(minutes=1)


def _usd(micros: int) -> str:
    return f"${Decimal(micros) / conf.MICROS_PER_USD:,.2f}"


def budget_micros(value, *, field: str) -> int:
    """A budget in dollars (a cent to a million, at most 2 decimals) as micro-dollars, or a 400
    naming `field`."""
    try:
        amount = Decimal(str(value).strip()) if not isinstance(value, Decimal) else value
    except (InvalidOperation, ValueError):
        raise ValidationFailed("a dollar amount such as 25.00", field=field) from None
    if not amount.is_finite():
        raise ValidationFailed("a dollar amount such as 25.00", field=field)
    if not MIN_BUDGET_USD <= amount <= MAX_BUDGET_USD:
        raise ValidationFailed(f"between ${MIN_BUDGET_USD} and ${MAX_BUDGET_USD:,}", field=field)
    if amount != amount.quantize(Decimal("0.01")):
        raise ValidationFailed("at most 2 decimals (whole cents)", field=field)
    return int(amount * conf.MICROS_PER_USD)


def rental_budgets_check(
    *,
    account: Account,
    rental: Rental,
    hold_micros: int,
    held_micros: int | None = None,
    now: datetime | None = None,
) -> None:
    """Refuse the new rental (already inserted in this transaction) when it takes the account
    past a limit or its monthly budget. The caller holds the account's row lock. `held_micros`:
    what the team's other unfinished rentals hold, when the caller read it under the lock."""
    now = now or timezone.now()
    limits = selectors.account_limits(account=account)
    if limits.max_rentals_per_minute:
        recent = selectors.account_rentals_created_since(account=account, since=now - RATE_WINDOW)
        excess = len(recent) - limits.max_rentals_per_minute
        if excess > 0:
            # The oldest rentals of the window age out first; this many must, for one to fit.
            frees_at = recent[excess - 1] + RATE_WINDOW
            retry = max(1, math.ceil((frees_at - now).total_seconds()))
            raise RateLimited(
                f"at most {limits.max_rentals_per_minute} rentals created per minute on this"
                f" account: try again in {retry} s",
                field="max_rentals_per_minute",
                retry_after_s=retry,
            )
    if limits.max_concurrent_gpus:
        active = selectors.account_active_gpus(account=account)
        if active > limits.max_concurrent_gpus:
            raise LimitExceeded(
                f"at most {limits.max_concurrent_gpus} GPUs at once (pending, placed or running)"
                f" on this account: {active - rental.gpu_count} in use and this rental asks for"
                f" {rental.gpu_count}",
                field="max_concurrent_gpus",
            )
    budget = account.monthly_budget_micros
    if budget is not None:
        spent = selectors.account_month_spent_micros(account=account, now=now)
        held = (
            selectors.team_held_micros(team_id=account.team_id)
            if held_micros is None
            else held_micros
        )
        if spent + held + hold_micros > budget:
            raise BudgetExceeded(
                f"this rental may cost {_usd(hold_micros)}; with {_usd(spent)} charged this month"
                f" and {_usd(held)} held for unfinished rentals that passes the monthly budget of"
                f" {_usd(budget)}",
                field="monthly_budget",
            )


def _limit(value, *, field: str, ceiling: int | None) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValidationFailed("a whole number", field=field)
    if not 1 <= value <= MAX_LIMIT:
        raise ValidationFailed(f"between 1 and {MAX_LIMIT}", field=field)
    if ceiling and value > ceiling:
        raise ValidationFailed(
            f"at most {ceiling} on this account (ask support to raise the ceiling)", field=field
        )
    return value


_UNSET = object()


def _may_manage_money(*, account: Account, actor: User) -> bool:
    """Who may change an account's budgets and limits: its team's owners and billing members."""
    return Membership.objects.filter(
        team_id=account.team_id, user=actor, role__in=MONEY_ROLES
    ).exists()


@transaction.atomic
def account_budgets_set(
    *,
    account_id: int,
    actor: User,
    monthly_budget=_UNSET,
    budget_warn_percent=_UNSET,
    max_concurrent_gpus=_UNSET,
    max_rentals_per_minute=_UNSET,
) -> Account:
    """Set the account's own budgets and limits (each argument left out is kept; None clears
    it). Limits stay at most the account's ceiling. A new monthly budget re-arms its notices."""
    account = Account.objects.select_for_update().get(pk=account_id)
    if not _may_manage_money(account=account, actor=actor):
        raise NotFound("no such account")
    limits = selectors.account_limits(account=account)
    fields = []
    if monthly_budget is not _UNSET:
        value = (
            None
            if monthly_budget is None
            else budget_micros(monthly_budget, field="monthly_budget")
        )
        if value != account.monthly_budget_micros:
            account.monthly_budget_micros = value
            account.budget_warned_at = account.budget_reached_at = None
            fields += ["monthly_budget_micros", "budget_warned_at", "budget_reached_at"]
    if budget_warn_percent is not _UNSET:
        if (
            isinstance(budget_warn_percent, bool)
            or not isinstance(budget_warn_percent, int)
            or not 1 <= budget_warn_percent <= 100
        ):
            raise ValidationFailed("a whole percentage from 1 to 100", field="budget_warn_percent")
        account.budget_warn_percent = budget_warn_percent
        account.budget_warned_at = None
        fields += ["budget_warn_percent", "budget_warned_at"]
    if max_concurrent_gpus is not _UNSET:
        account.max_concurrent_gpus = _limit(
            max_concurrent_gpus, field="max_concurrent_gpus", ceiling=limits.ceiling_concurrent_gpus
        )
        fields.append("max_concurrent_gpus")
    if max_rentals_per_minute is not _UNSET:
        account.max_rentals_per_minute = _limit(
            max_rentals_per_minute,
            field="max_rentals_per_minute",
            ceiling=limits.ceiling_rentals_per_minute,
        )
        fields.append("max_rentals_per_minute")
    if fields:
        account.save(update_fields=sorted(set(fields)))
    return account


@transaction.atomic
def account_ceilings_set(
    *, account_id: int, max_concurrent_gpus: int | None, max_rentals_per_minute: int | None
) -> Account:
    """Ops: the account's ceilings (None: the settings' default). A customer's own limit above
    a lowered ceiling stays stored and the ceiling applies."""
    account = Account.objects.select_for_update().get(pk=account_id)
    account.ops_max_concurrent_gpus = _limit(
        max_concurrent_gpus, field="ops_max_concurrent_gpus", ceiling=None
    )
    account.ops_max_rentals_per_minute = _limit(
        max_rentals_per_minute, field="ops_max_rentals_per_minute", ceiling=None
    )
    account.save(update_fields=["ops_max_concurrent_gpus", "ops_max_rentals_per_minute"])
    return account


@dataclass
class BudgetPassResult:
    warned: int = 0
    reached: int = 0
    rentals_stopped: int = 0


def _ahead_s(lag_s: float = 0.0) -> float:
    """What a rental may still accrue, in seconds, if the pass leaves it running: the usage not
    yet confirmed, the time to the next pass, and the stop grace after that pass's stop."""
    return max(0.0, lag_s) + conf.billing_pass_interval_s() + DEFAULT_STOP_GRACE_S


def _rental_caps_enforce(*, now: datetime, result: BudgetPassResult) -> None:
    rows = queries.capped_rentals(burning=[str(s) for s in lifecycle.BURNING])
    for rental_id, team_id, cap, charged, per_hour, confirmed in rows:
        lag = (now - confirmed).total_seconds() if confirmed is not None else 0.0
        projected = charged + math.ceil(per_hour * _ahead_s(lag) / 3600)
        if projected < cap:
            continue
        stopped = lifecycle.rental_stop_for_budget(
            rental_id=rental_id,
            reason=f"charged {_usd(charged)} of its {_usd(cap)} cap (max_charge); stopped"
            " before the next billing pass could pass it",
        )
        if stopped is None:
            continue
        result.rentals_stopped += 1
        result.reached += 1
        account = selectors.team_account(team_id=team_id)
        if account is None:
            continue
        detail = (
            f"rental {rental_id} reached its cap: charged {_usd(charged)} of {_usd(cap)};"
            " it checkpoints and stops"
        )
        with transaction.atomic():
            BalanceNotice.objects.create(
                account=account,
                rental_id=rental_id,
                kind=NoticeKind.BUDGET_REACHED,
                available_micros=cap - charged,
                hourly_burn_micros=per_hour,
                detail=detail,
                created_at=now,
            )
            budget_reached_notify(
                team=account.team,
                budget_key=f"rental:{rental_id}",
                summary=f"Budget reached: {detail}",
                data={
                    "scope": "rental",
                    "rental": str(rental_id),
                    "cap_micros": cap,
                    "charged_micros": charged,
                },
            )


def _monthly_budgets_enforce(*, now: datetime, result: BudgetPassResult) -> None:
    month = selectors.month_start(now)

    def noticed(at: datetime | None) -> bool:
        return at is not None and at >= month

    budgeted = selectors.accounts_month_spent(now=now)
    # Only the accounts with something to do are read again: a pass over many budgeted
    # accounts far from their budgets is the one statement above.
    for account in Account.objects.filter(
        pk__in=[pk for pk, m in budgeted.items() if m.spent_micros > 0 or m.hourly_burn_micros]
    ).order_by("pk"):
        budget = account.monthly_budget_micros
        spent = budgeted[account.pk].spent_micros
        burn = budgeted[account.pk].hourly_burn_micros
        reached = spent + math.ceil(burn * _ahead_s() / 3600) >= budget
        warn = reached or spent * 100 >= budget * account.budget_warn_percent
        if reached:
            for rental_id in (
                Rental.objects.filter(team_id=account.team_id, status__in=lifecycle.STOPPABLE)
                .order_by("created_at")
                .values_list("pk", flat=True)
            ):
                if lifecycle.rental_stop_for_budget(
                    rental_id=rental_id,
                    reason=f"the account's monthly budget of {_usd(budget)} is reached"
                    f" ({_usd(spent)} charged this month)",
                ):
                    result.rentals_stopped += 1
        if (warn and not noticed(account.budget_warned_at)) or (
            reached and not noticed(account.budget_reached_at)
        ):
            _monthly_notices(
                account_id=account.pk,
                now=now,
                month=month,
                spent=spent,
                burn=burn,
                warn=warn,
                reached=reached,
                result=result,
            )


def _monthly_notices(
    *,
    account_id: int,
    now: datetime,
    month: datetime,
    spent: int,
    burn: int,
    warn: bool,
    reached: bool,
    result: BudgetPassResult,
) -> None:
    """One BUDGET_WARNING and one BUDGET_REACHED notice per account and month at most."""
    with transaction.atomic():
        account = Account.objects.select_for_update().get(pk=account_id)
        budget = account.monthly_budget_micros
        notices = []
        if warn and (account.budget_warned_at is None or account.budget_warned_at < month):
            account.budget_warned_at = now
            result.warned += 1
            notices.append(
                (
                    NoticeKind.BUDGET_WARNING,
                    f"{_usd(spent)} charged this month: {spent * 100 // budget} % of the"
                    f" {_usd(budget)} monthly budget",
                )
            )
        if reached and (account.budget_reached_at is None or account.budget_reached_at < month):
            account.budget_reached_at = now
            result.reached += 1
            notices.append(
                (
                    NoticeKind.BUDGET_REACHED,
                    f"monthly budget of {_usd(budget)} reached ({_usd(spent)} charged):"
                    " rentals are being stopped and new ones refused",
                )
            )
        if not notices:
            return
        account.save(update_fields=["budget_warned_at", "budget_reached_at"])
        BalanceNotice.objects.bulk_create(
            BalanceNotice(
                account=account,
                kind=kind,
                available_micros=budget - spent,
                hourly_burn_micros=burn,
                detail=detail,
                created_at=now,
            )
            for kind, detail in notices
        )
        if reached and account.budget_reached_at == now:
            budget_reached_notify(
                team=account.team,
                budget_key=f"account:{account.pk}:{month:%Y-%m}",
                summary=f"Budget reached: {notices[-1][1]}",
                data={
                    "scope": "monthly",
                    "budget_micros": budget,
                    "spent_micros": spent,
                    "month": f"{month:%Y-%m}",
                },
            )


def budgets_enforce(*, now: datetime) -> BudgetPassResult:
    """The billing pass's budget step: per-rental caps, then monthly budgets."""
    result = BudgetPassResult()
    _rental_caps_enforce(now=now, result=result)
    _monthly_budgets_enforce(now=now, result=result)
    return result
