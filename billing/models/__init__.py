"""Billing models, one module per concern."""

from billing.models.accounts import Account, AccountKind, BalanceNotice, FundsHold, NoticeKind
from billing.models.invoices import Invoice, InvoiceLine
from billing.models.ledger import RATING_KINDS, EntryKind, LedgerEntry
from billing.models.metering import TelemetryMinute, TelemetrySample, UsageMeter, UsageSegment
from billing.models.payments import (
    MoneyOutStatus,
    Payout,
    PayoutMethod,
    Refund,
    StripeEvent,
    TopUp,
    TopUpStatus,
)

__all__ = [
    "RATING_KINDS",
    "Account",
    "AccountKind",
    "BalanceNotice",
    "EntryKind",
    "FundsHold",
    "Invoice",
    "InvoiceLine",
    "LedgerEntry",
    "MoneyOutStatus",
    "NoticeKind",
    "Payout",
    "PayoutMethod",
    "Refund",
    "StripeEvent",
    "TelemetryMinute",
    "TelemetrySample",
    "TopUp",
    "TopUpStatus",
    "UsageMeter",
    "UsageSegment",
]
