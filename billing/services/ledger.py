"""Accounts and postings: the primitives every money movement goes through."""

from __future__ import annotations

import uuid
from datetime import datetime
from decimal import Decimal

from django.db import connection, transaction
from django.db.models import BigIntegerField, F, Value
from django.db.transaction import TransactionManagementError
from django.utils import timezone

from accounts.models import Team
from billing import conf, queries, selectors
from billing.models import Account, AccountKind, EntryKind, FundsHold, LedgerEntry
from billing.services import budgets
from core.errors import PaymentRequired, ValidationFailed
from core.money import cost_micros
from core.rows import insert_values, mark_saved, model_insert, pipelined
from marketplace.models import Provider, Rental, User


def account_for_team(*, team: Team) -> Account:
    """The team's customer account (its balance), created on first use."""
    account, _ = Account.objects.get_or_create(kind=AccountKind.CUSTOMER, team=team)
    return account


def account_for_provider(*, provider: Provider) -> Account:
    account, _ = Account.objects.get_or_create(kind=AccountKind.PROVIDER, provider=provider)
    return account


def account_platform() -> Account:
    account, _ = Account.objects.get_or_create(kind=AccountKind.PLATFORM)
    return account


def ledger_post(
    *,
    account_id: int,
    kind: str,
    amount_micros: int,
    key: str,
    memo: str = "",
    actor: User | None = None,
    now: datetime | None = None,
) -> LedgerEntry | None:
    """Append one entry and move the account's balance with it; call inside atomic().

    Returns None when an entry with this key exists already: a replay is a no-op.
    """
    if amount_micros == 0:
        raise ValidationFailed("a posting moves a non-zero amount", field="amount")
    entry = queries.ledger_entry_insert(
        account_id=account_id,
        kind=kind,
        amount_micros=amount_micros,
        key=key,
        memo=memo[:500],
        actor_id=actor.pk if actor else None,
        now=now or timezone.now(),
    )
    if entry is None:
        return None
    # One statement: concurrent postings to the account serialise on its row lock, so the
    # cached balance stays exactly the sum of its entries. The amount is typed bigint: with
    # server-side binding a bare int is sent as an integer and wraps past $2,147.
    Account.objects.filter(pk=account_id).update(
        balance_micros=F("balance_micros") + Value(amount_micros, output_field=BigIntegerField())
    )
    return entry


def account_adjust(
    *,
    account_id: int,
    amount_micros: int,
    reason: str,
    actor: User | None,
    key: str | None = None,
) -> LedgerEntry | None:
    """Ops credit (positive) or debit (negative) with a required reason.

    `key` makes a re-submitted form a no-op; without one every call is a new adjustment.
    """
    reason = (reason or "").strip()
    if not reason:
        raise ValidationFailed("a reason is required", field="reason")
    if amount_micros == 0:
        raise ValidationFailed("the amount must not be zero", field="amount")
    with transaction.atomic():
        account = Account.objects.select_for_update().get(pk=account_id)
        return ledger_post(
            account_id=account.pk,
            kind=EntryKind.ADJUSTMENT,
            amount_micros=amount_micros,
            key=f"adjust:{key or uuid.uuid4()}",
            memo=reason,
            actor=actor,
        )


def micros_from_usd(amount: Decimal) -> int:
    """Dollars (at most 6 decimals) to micros, exactly."""
    micros = amount * conf.MICROS_PER_USD
    if micros != micros.to_integral_value():
        raise ValidationFailed("at most 6 decimals", field="amount")
    return int(micros)


# Where a refused booking can add funds: the web page and its API (billing/urls.py, api/urls.py).
_TOPUP_PAGE = "/billing/topup/"
_TOPUP_API = "/api/v1/billing/topups/"


def hold_micros(*, price_per_gpu_hour: Decimal, gpus: int, duration_s: int) -> int:
    """The whole booked time of `gpus` GPUs at the rate, rounded up to a whole micro (the
    locked-price hold in selectors.team_held_micros is the same formula, core.money's)."""
    return cost_micros(
        price_per_gpu_hour=price_per_gpu_hour, gpu_seconds=gpus * duration_s, round_up=True
    )


def funds_hold_create(
    *, rental: Rental, price_per_gpu_hour: Decimal, max_charge: Decimal | None = None
) -> FundsHold | None:
    """Hold a new rental's whole booked cost (never more than its own cap, `max_charge` in
    dollars) against its team's available balance, or refuse it: 402 naming the amount,
    or the account's limits and monthly budget (billing.services.budgets). Runs in the
    transaction that creates the rental.

    The team's account row is locked first: concurrent creates (and postings) of every member
    of the team take turns, and each reads the rentals and holds every earlier one committed,
    so together they can never hold more than the balance nor pass a limit or budget.
    """
    if not connection.in_atomic_block:
        raise TransactionManagementError("a hold is taken in the transaction creating the rental")
    cap = None if max_charge is None else budgets.budget_micros(max_charge, field="max_charge")
    amount = hold_micros(
        price_per_gpu_hour=price_per_gpu_hour,
        gpus=rental.gpus_per_node * rental.node_count,
        duration_s=rental.duration_s,
    )
    if cap is not None:
        amount = min(amount, cap)
    hold = FundsHold(
        rental=rental,
        price_per_gpu_hour=price_per_gpu_hour,
        amount_micros=amount,
        max_charge_micros=cap,
    )
    if not conf.funds_check_enabled():
        hold.account = account = _team_account_locked(team_id=rental.team_id)
        budgets.rental_budgets_check(account=account, rental=rental, hold_micros=amount)
        if cap is None and account.monthly_budget_micros is None:
            return None  # no balance check and no budget to count it against: nothing to hold
        return model_insert(hold)
    account, accrued, held = _team_account_locked_holding(hold=hold, team_id=rental.team_id)
    # A refusal from here on rolls the hold back with the rental.
    budgets.rental_budgets_check(
        account=account, rental=rental, hold_micros=amount, held_micros=held
    )
    available = account.balance_micros - accrued - held
    if available <= 0 or amount > available:
        raise PaymentRequired(
            f"this rental holds {_usd(amount)} ({rental.gpus_per_node * rental.node_count}"
            f" GPU(s) x {Decimal(rental.duration_s) / 3600:.2f} h at"
            f" ${price_per_gpu_hour}/GPU-hour{' up to its cap' if cap else ''}) and the"
            f" available balance is {_usd(available)}: add funds on {_TOPUP_PAGE} (by card, or"
            " ask ops for a credit), or book less",
            links={"topup": _TOPUP_PAGE, "topup_api": _TOPUP_API},
        )
    return hold


def _team_account_locked_holding(*, hold: FundsHold, team_id: int) -> tuple[Account, int, int]:
    """Lock the team's account row, read the team's accrued usage and the holds of every
    rental committed before the lock was granted, and write `hold`; returns the account, the
    accrued usage and the holds (`hold` left out).

    The three statements go in one round trip, so the server runs the read and the insert the
    moment the lock is granted and the lock is held for one round trip to this process (its
    COMMIT or ROLLBACK), not four: concurrent creates of one team take turns on this lock, so
    its hold time bounds the team's create rate.
    """
    fields, insert_sql = queries.hold_insert_statement()
    values = insert_values(hold, fields)
    if values is None:
        raise TypeError("a hold is written from plain values")
    locked, owed, _ = pipelined(
        [
            queries.team_account_locked_statement(team_id=team_id),
            selectors.team_owed_statement(team_id=team_id),
            (insert_sql, [*values, team_id]),
        ]
    )
    if not locked:  # no account yet (the insert found none to hold against): make it, again
        Account.objects.get_or_create(kind=AccountKind.CUSTOMER, team_id=team_id)
        return _team_account_locked_holding(hold=hold, team_id=team_id)
    account = queries.team_account_from_row(locked[0])
    hold.account = account
    mark_saved(hold)
    accrued, held = owed[0]
    return account, int(accrued), int(held)


def _team_account_locked(*, team_id: int) -> Account:
    """The team's account row, locked: one query when it exists (every team that can pay has
    one), created first otherwise. Every member's creates take turns on this one row."""
    account = queries.team_account_locked(team_id=team_id)
    if account is None:
        Account.objects.get_or_create(kind=AccountKind.CUSTOMER, team_id=team_id)
        account = queries.team_account_locked(team_id=team_id)
    return account


def _usd(micros: int) -> str:
    return f"${Decimal(micros) / conf.MICROS_PER_USD:.2f}"
