"""Thin Celery tasks around the notification services; each is idempotent and safe to re-run."""

from __future__ import annotations

from celery import shared_task

from notifications import services


# The hard limit leaves room for one webhook (connect + read timeouts) or one SMTP exchange.
@shared_task(name="notifications.deliver", ignore_result=True, time_limit=90, soft_time_limit=75)
def deliver(delivery_id: int) -> None:
    """Attempt one delivery if it is due; a delivered one is never sent again."""
    services.delivery_attempt(delivery_id=delivery_id)


@shared_task(name="notifications.sweep", ignore_result=True, time_limit=60, soft_time_limit=50)
def sweep() -> None:
    """Beat: queue the deliveries that are due (retries, messages the broker lost)."""
    services.deliveries_due_queue()
