"""Billing's domain errors; the API exception handler maps every DomainError by its status."""

from __future__ import annotations

from core.errors import DomainError


class PaymentsUnavailable(DomainError):
    """Card payments are not configured, or Stripe cannot be reached right now."""

    status = 503
    code = "payments_unavailable"


class PaymentMismatch(DomainError):
    """Stripe reports a payment that is not the one this server asked for (another amount,
    currency, customer or account): nothing is credited."""

    status = 409
    code = "payment_mismatch"


class LimitExceeded(DomainError):
    """A new rental would take the account past one of its limits; `field` names the limit."""

    status = 409
    code = "limit_exceeded"


class RateLimited(LimitExceeded):
    """Too many rentals created in the last minute; `retry_after_s` says when one fits again."""

    status = 429
    code = "rate_limited"

    def __init__(self, message: str, *, field: str, retry_after_s: int) -> None:
        super().__init__(message, field=field)
        self.retry_after_s = retry_after_s


class BudgetExceeded(DomainError):
    """A new rental would take the month's charges plus what is held past the monthly budget."""

    status = 409
    code = "budget_exceeded"
