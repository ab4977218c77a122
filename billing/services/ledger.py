"""Accounts and postings: the primitives every money movement goes through."""

from __future__ import annotations

import uuid
from datetime import datetime
from decimal import ROUND_CEILING, Decimal

from django.db import connection, transaction
from django.utils import timezone

from billing import conf, selectors
from billing.models import Account, AccountKind, EntryKind, LedgerEntry
from marketplace.errors import PaymentRequired, ValidationFailed
from marketplace.models import Provider, User


def account_for_customer(*, user: User) -> Account:
    """The customer's account, created on first use."""
    account, _ = Account.objects.get_or_create(kind=AccountKind.CUSTOMER, user=user)
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
    with connection.cursor() as cursor:
        cursor.execute(
            """
            INSERT INTO billing_ledgerentry
                (account_id, kind, amount_micros, key, memo, actor_id, created_at)
            VALUES (%s, %s, %s, %s, %s, %s, %s)
            ON CONFLICT (key) WHERE key IS NOT NULL DO NOTHING
            RETURNING id
            """,
            [
                account_id,
                kind,
                amount_micros,
                key,
                memo[:500],
                actor.pk if actor else None,
                now or timezone.now(),
            ],
        )
        row = cursor.fetchone()
        if row is None:
            return None
        # One statement: concurrent postings to the account serialise on its row lock, so the
        # cached balance stays exactly the sum of its entries.
        cursor.execute(
            "UPDATE billing_account SET balance_micros = balance_micros + %s WHERE id = %s",
            [amount_micros, account_id],
        )
    return LedgerEntry.objects.get(pk=row[0])


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


def funds_check(*, customer: User, hourly_cost: Decimal, duration_s: int | None = None) -> None:
    """Refuse a new rental (402) unless the available balance is positive and covers its first
    hour (or its whole duration when shorter) at `hourly_cost` for all its GPUs."""
    if not conf.funds_check_enabled():
        return
    hours = Decimal(min(duration_s, 3600) if duration_s else 3600) / 3600
    needed = int((hourly_cost * conf.MICROS_PER_USD * hours).to_integral_value(ROUND_CEILING))
    available = selectors.customer_available_micros(customer_id=customer.pk)
    if available <= 0 or available < needed:
        raise PaymentRequired(
            f"available balance ${Decimal(available) / conf.MICROS_PER_USD:.2f} does not cover "
            f"${Decimal(needed) / conf.MICROS_PER_USD:.2f} (the first hour of this rental): "
            "top up first"
        )
