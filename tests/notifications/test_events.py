"""The lifecycle's transitions record the right notifications, in their own transaction."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import transaction
from django.utils import timezone

from marketplace import lifecycle
from marketplace.models import Rental, RentalStatus
from notifications.models import Channel, Delivery, DeliveryState, Notification
from notifications.services import budget_reached_notify, notification_settings_update
from tests.factories import UserFactory, personal_team
from tests.notifications.conftest import move

S = RentalStatus
pytestmark = pytest.mark.django_db

TO_RUNNING = (S.SCHEDULED, S.PROVISIONING, S.RUNNING)


@pytest.fixture(autouse=True)
def _a_node(make_node):
    """Somewhere the rentals could be placed, so rental_create accepts them."""
    make_node()


def _kinds(rental: Rental) -> list[str]:
    return list(
        Notification.objects.filter(rental=rental)
        .order_by("created_at", "source_key")
        .values_list("kind", flat=True)
    )


def test_running_then_completed_tells_started_then_completed_by_email(rent, user):
    # Given a rental of a customer who never changed their settings (every email on)
    rental = rent()
    # When it runs, then completes
    move(rental, *TO_RUNNING)
    move(rental, S.STOPPING, S.COMPLETED)
    # Then exactly "started" and "completed" are recorded (not scheduled, provisioning or
    # stopping), each with one pending email to the customer, due now
    assert _kinds(rental) == ["rental.started", "rental.completed"]
    deliveries = Delivery.objects.filter(notification__rental=rental)
    assert {(d.channel, d.recipient, d.state, d.attempts) for d in deliveries} == {
        (Channel.EMAIL, user.email, DeliveryState.PENDING, 0)
    }
    assert deliveries.count() == 2
    started = Notification.objects.get(rental=rental, kind="rental.started")
    assert started.team == personal_team(user)
    assert started.payload["rental"]["id"] == str(rental.pk)
    assert started.payload["rental"]["status"] == "running"
    assert started.payload["rental"]["previous_status"] == "provisioning"
    assert started.summary.endswith("started: test: running")


def test_failed_preempted_and_a_resume_after_a_requeue(rent, user):
    # Given three rentals
    failing, preempted, requeued = rent(), rent(), rent()
    # When one fails, one is preempted, one loses its node, is re-queued and runs again
    move(failing, *TO_RUNNING, S.FAILED)
    move(preempted, *TO_RUNNING, S.PREEMPTED)
    move(requeued, *TO_RUNNING, S.PENDING)
    move(requeued, *TO_RUNNING)
    # Then each tells what happened; the second start is a resume
    assert _kinds(failing) == ["rental.started", "rental.failed"]
    assert _kinds(preempted) == ["rental.started", "rental.preempted"]
    assert _kinds(requeued) == ["rental.started", "rental.resumed"]


def test_the_node_lost_path_of_the_lifecycle_notifies_too(rent):
    # Given a running rental
    rental = move(rent(), *TO_RUNNING)
    # When its node goes silent and it cannot be re-queued (the lifecycle's own function)
    with transaction.atomic():
        locked = Rental.objects.select_for_update().get(pk=rental.pk)
        lifecycle.rental_mark_node_lost(
            rental=locked, hostname="h1", at=timezone.now(), requeue=False
        )
    # Then the failure is told with the lifecycle's reason
    failed = Notification.objects.get(rental=rental, kind="rental.failed")
    assert failed.payload["rental"]["reason"] == "node h1 went silent"


def test_switched_off_kinds_and_channels_record_nothing(rent, user):
    # Given a customer who switched "started" off for email, and a second customer who switched
    # email off altogether (and has no webhook)
    notification_settings_update(
        team=personal_team(user), email_kinds=["rental.completed", "rental.failed"]
    )
    quiet = UserFactory()
    notification_settings_update(team=personal_team(quiet), email_enabled=False)
    # When a rental of each runs and completes
    rental = rent()
    move(rental, *TO_RUNNING, S.STOPPING, S.COMPLETED)
    other = rent(customer=quiet)
    move(other, *TO_RUNNING, S.STOPPING, S.COMPLETED)
    # Then the first is told only of the completion, the second of nothing
    assert _kinds(rental) == ["rental.completed"]
    assert _kinds(other) == []
    assert not Delivery.objects.filter(notification__team=personal_team(quiet)).exists()


def test_a_transition_rolled_back_leaves_no_notification(rent):
    # Given a provisioning rental
    rental = move(rent(), S.SCHEDULED, S.PROVISIONING)
    # When its move to RUNNING is rolled back (the caller's transaction fails after it)
    with pytest.raises(RuntimeError), transaction.atomic():
        locked = Rental.objects.select_for_update().get(pk=rental.pk)
        move(locked, S.RUNNING)
        raise RuntimeError("the report could not be stored")
    # Then neither the transition nor its notification exists: the outbox is in its transaction
    assert Rental.objects.get(pk=rental.pk).status == S.PROVISIONING
    assert not Notification.objects.exists()
    assert not Delivery.objects.exists()


def test_webhook_and_email_each_get_a_delivery_for_the_same_event(rent, user, webhook_to):
    # Given both channels on
    webhook_to(user, email=True)
    # When the rental starts
    move(rent(), *TO_RUNNING)
    # Then one notification (one event id) has an email and a webhook delivery
    notification = Notification.objects.get()
    assert sorted(notification.deliveries.values_list("channel", "recipient")) == [
        ("email", user.email),
        ("webhook", ""),
    ]


def test_a_budget_reached_is_recorded_once_per_crossing(user):
    # Given billing telling that a monthly budget was reached, twice for the same crossing
    # (a replayed pass) and once for the next month
    data = {"budget_id": 7, "period": "2026-12", "cap_micros": 50_000_000}
    first = budget_reached_notify(
        team=personal_team(user), budget_key="7:2026-12", summary="cap", data=data
    )
    again = budget_reached_notify(
        team=personal_team(user), budget_key="7:2026-12", summary="cap", data=data
    )
    later = budget_reached_notify(
        team=personal_team(user), budget_key="7:2027-01", summary="cap", data=data
    )
    # Then two notifications exist, the replay recorded nothing
    assert first is not None and later is not None and again is None
    assert Notification.objects.filter(kind="budget.reached").count() == 2
    assert first.payload == {"budget": data}
    assert Delivery.objects.filter(notification__kind="budget.reached").count() == 2


def test_deliveries_are_due_at_the_event_time(rent):
    # Given a rental that started
    move(rent(), *TO_RUNNING)
    # Then its delivery is due at once (the sweep will pick it up if the message is lost)
    delivery = Delivery.objects.get()
    assert delivery.next_attempt_at <= timezone.now()
    assert delivery.next_attempt_at > timezone.now() - timedelta(minutes=1)
