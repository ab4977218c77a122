"""Notifications through the real chain: a transition commits, a real Celery worker delivers to
a real HTTP receiver (which fails once) and a real SMTP server, the sweep re-queues the retry."""

from __future__ import annotations

import pytest
from celery import current_app

from marketplace.models import Rental, RentalStatus
from notifications.models import Delivery, DeliveryState
from tests.e2e.conftest import wait_for

# The receiver's fixtures, shared with the notification tests.
from tests.notifications.conftest import move, receiver, webhook_to  # noqa: F401

S = RentalStatus
pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def stack_env(stack_env, smtp_server, settings):
    """The worker sends mail to the test's SMTP server and retries a failed attempt at once. It
    shares this process's SECRET_KEY, as every process of a deployment must: webhook secrets
    are derived from it."""
    return {
        **stack_env,
        "SECRET_KEY": settings.SECRET_KEY,
        "EMAIL_BACKEND": "django.core.mail.backends.smtp.EmailBackend",
        "EMAIL_HOST": "127.0.0.1",
        "EMAIL_PORT": str(settings.EMAIL_PORT),
        "NOTIFICATIONS_RETRY_BASE_S": "0",
    }


def _sweep() -> None:
    current_app.send_task("notifications.sweep")


def test_a_worker_delivers_retries_after_a_500_and_never_repeats_a_success(
    celery_worker,
    user,
    webhook_to,  # noqa: F811
    smtp_server,
    make_node,
    rent,
):
    # Given both channels on, a receiver that answers 500 once, and a rental the worker's
    # scheduler placed
    hook = webhook_to(user, email=True)
    hook.answers.append(500)
    make_node()
    rental = rent()
    wait_for(lambda: Rental.objects.get(pk=rental.pk).status == S.SCHEDULED, 60, "the placement")
    # When the rental starts (the deliveries are queued when the transition commits)
    move(rental, S.PROVISIONING, S.RUNNING)
    webhook = Delivery.objects.get(channel="webhook")
    # Then the email arrives, and the webhook's first attempt gets the 500
    wait_for(lambda: smtp_server, 60, "the email")
    try:
        wait_for(
            lambda: Delivery.objects.filter(
                pk=webhook.pk, attempts=1, last_status_code=500
            ).exists(),
            60,
            "the webhook's first attempt",
        )
    except AssertionError as exc:
        # Once in a whole-suite run the first attempt was recorded without the 500: say how.
        seen = Delivery.objects.values("attempts", "last_status_code", "last_error", "state")
        raise AssertionError(f"{exc}: {seen.get(pk=webhook.pk)}, got {hook.requests}") from exc
    assert len(hook.requests) == 1
    # When the periodic sweep runs: it re-queues the due retry, which succeeds

    def delivered():
        _sweep()
        webhook.refresh_from_db()
        return webhook.state == DeliveryState.DELIVERED

    wait_for(delivered, 60, "the retried webhook", every=1)
    # When the sweep and the task run again, then the rental completes (its deliveries are
    # queued behind them, on the same single-process worker)
    _sweep()
    current_app.send_task("notifications.deliver", args=(webhook.pk,))
    move(rental, S.STOPPING, S.COMPLETED)
    wait_for(lambda: len(hook.requests) >= 3, 60, "the completion's webhook")
    wait_for(lambda: len(smtp_server) >= 2, 60, "the completion's email")
    # Then the start reached the receiver twice (500, then 200) with one event id and correct
    # signatures, never after its success; the completion once; one email each
    started = [r for r in hook.requests if r.payload["type"] == "rental.started"]
    completed = [r for r in hook.requests if r.payload["type"] == "rental.completed"]
    assert len(started) == 2 and len(completed) == 1
    assert all(r.valid for r in hook.requests)
    assert started[0].event_id == started[1].event_id == str(webhook.notification_id)
    webhook.refresh_from_db()
    assert (webhook.state, webhook.attempts, webhook.last_status_code) == ("delivered", 2, 200)
    subjects = sorted(m["Subject"] for m in smtp_server)
    assert len(subjects) == 2
    assert "completed" in subjects[0] and "started" in subjects[1]
