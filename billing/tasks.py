"""Thin Celery tasks around the billing services; each is idempotent and safe to re-run."""

from __future__ import annotations

from celery import shared_task

from billing import services


@shared_task(name="billing.pass", ignore_result=True, time_limit=240, soft_time_limit=200)
def billing_pass() -> None:
    """Beat: rate new usage, post what is due, warn and stop at zero (one pass at a time)."""
    services.billing_pass_run()


@shared_task(
    name="billing.telemetry_prune", ignore_result=True, time_limit=1800, soft_time_limit=1700
)
def telemetry_prune() -> None:
    """Beat: delete raw telemetry past its retention; per-minute rollups stay."""
    services.telemetry_prune()


@shared_task(
    name="billing.invoices_issue", ignore_result=True, time_limit=1800, soft_time_limit=1700
)
def invoices_issue() -> None:
    """Beat: issue last month's statements that do not exist yet."""
    services.invoices_issue_due()


@shared_task(name="billing.payments_retry", ignore_result=True, time_limit=600, soft_time_limit=540)
def payments_retry() -> None:
    """Beat: re-send refunds and payouts that a retryable Stripe error left pending."""
    services.payments_retry_pending()
