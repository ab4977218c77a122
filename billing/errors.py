"""Billing's domain errors; the API exception handler maps every DomainError by its status."""

from __future__ import annotations

from marketplace.errors import DomainError


class PaymentsUnavailable(DomainError):
    """Card payments are not configured, or Stripe cannot be reached right now."""

    status = 503
    code = "payments_unavailable"


class PaymentMismatch(DomainError):
    """Stripe reports a payment that is not the one this server asked for (another amount,
    currency, customer or account): nothing is credited."""

    status = 409
    code = "payment_mismatch"
