"""Deliveries against real receivers: an HTTP server that checks signatures, an SMTP server."""

from __future__ import annotations

import threading

import pytest
from django.db import connections

from marketplace.models import RentalStatus
from notifications import tasks
from notifications.models import Delivery, DeliveryState, Notification
from notifications.services import delivery_attempt, notification_settings_update
from tests.factories import personal_team
from tests.notifications.conftest import move

S = RentalStatus
TO_RUNNING = (S.SCHEDULED, S.PROVISIONING, S.RUNNING)


@pytest.fixture(autouse=True)
def _setup(make_node, settings):
    make_node()
    # A failed attempt is due again at once, so the test makes the retry itself.
    settings.NOTIFICATIONS_RETRY_BASE_S = 0


@pytest.mark.django_db
def test_a_500_is_retried_with_the_same_event_id_and_success_is_never_repeated(
    rent, user, webhook_to
):
    # Given a receiver that answers 500 once, then 200, and a rental that starts
    receiver = webhook_to(user)
    receiver.answers.append(500)
    move(rent(), *TO_RUNNING)
    delivery = Delivery.objects.get()
    # When the delivery task runs: the receiver fails
    tasks.deliver(delivery.pk)
    delivery.refresh_from_db()
    assert (delivery.state, delivery.attempts, delivery.last_status_code) == ("pending", 1, 500)
    assert delivery.last_error == "the receiver answered 500"
    assert delivery.delivered_at is None
    # When it runs again: delivered
    tasks.deliver(delivery.pk)
    delivery.refresh_from_db()
    assert (delivery.state, delivery.attempts, delivery.last_status_code) == ("delivered", 2, 200)
    assert delivery.delivered_at is not None and delivery.last_error == ""
    # When the task runs twice more (a duplicate message, the sweep): nothing is sent
    tasks.deliver(delivery.pk)
    tasks.deliver(delivery.pk)
    # Then the receiver saw two correctly signed requests of the same event, with the same
    # body, and answered 200 exactly once
    assert len(receiver.requests) == 2 == len(receiver.valid)
    notification = Notification.objects.get()
    assert {r.event_id for r in receiver.requests} == {str(notification.pk)}
    assert receiver.requests[0].body == receiver.requests[1].body
    body = receiver.requests[1].payload
    assert (body["id"], body["type"]) == (str(notification.pk), "rental.started")
    assert body["data"]["rental"]["status"] == "running"
    delivery.refresh_from_db()
    assert delivery.attempts == 2


@pytest.mark.django_db
def test_a_wrong_secret_fails_the_receivers_check_and_rotation_changes_the_secret(
    rent, user, webhook_to
):
    # Given the receiver knows the first secret, and the owner rotates it without telling
    receiver = webhook_to(user)
    old = receiver.secret
    move(rent(), *TO_RUNNING)
    from notifications.services import webhook_secret_rotate

    new = webhook_secret_rotate(team=personal_team(user)).webhook_secret
    assert new.startswith("whsec_") and new != old
    # When the delivery runs
    tasks.deliver(Delivery.objects.get().pk)
    # Then the receiver refused the signature (400), and with the new secret it is accepted
    assert [r.valid for r in receiver.requests] == [False]
    assert Delivery.objects.get().last_status_code == 400
    receiver.secret = new
    tasks.deliver(Delivery.objects.get().pk)
    assert [r.valid for r in receiver.requests] == [False, True]
    assert Delivery.objects.get().state == DeliveryState.DELIVERED


@pytest.mark.django_db
def test_attempts_stop_at_the_maximum(rent, user, webhook_to, settings):
    # Given a receiver that always fails and at most 3 attempts
    settings.NOTIFICATIONS_MAX_ATTEMPTS = 3
    receiver = webhook_to(user)
    receiver.default = 503
    move(rent(), *TO_RUNNING)
    delivery = Delivery.objects.get()
    # When the task runs five times
    for _ in range(5):
        tasks.deliver(delivery.pk)
    # Then it tried three times and gave up
    delivery.refresh_from_db()
    assert (delivery.state, delivery.attempts, delivery.last_status_code) == ("failed", 3, 503)
    assert len(receiver.requests) == 3


@pytest.mark.django_db
def test_backoff_doubles_and_a_delivery_not_yet_due_is_left_alone(rent, user, webhook_to, settings):
    # Given retries after 30 s, doubling, and a receiver that fails
    settings.NOTIFICATIONS_RETRY_BASE_S = 30
    receiver = webhook_to(user)
    receiver.default = 500
    move(rent(), *TO_RUNNING)
    delivery = Delivery.objects.get()
    # When the first attempt fails
    tasks.deliver(delivery.pk)
    delivery.refresh_from_db()
    first = delivery.next_attempt_at - delivery.last_attempt_at
    # Then the next is due 30 s later, and a run before that sends nothing
    assert first.total_seconds() == 30
    assert delivery_attempt(delivery_id=delivery.pk) is None
    assert len(receiver.requests) == 1
    # When it is due and fails again: 60 s
    delivery_attempt(delivery_id=delivery.pk, now=delivery.next_attempt_at)
    delivery.refresh_from_db()
    assert (delivery.next_attempt_at - delivery.last_attempt_at).total_seconds() == 60
    assert delivery.attempts == 2


@pytest.mark.django_db
def test_a_webhook_turned_off_before_delivery_is_skipped(rent, user, webhook_to):
    # Given a start recorded for the webhook, then the owner removes the URL
    receiver = webhook_to(user)
    move(rent(), *TO_RUNNING)
    notification_settings_update(team=personal_team(user), webhook_url="")
    # When the delivery runs
    tasks.deliver(Delivery.objects.get().pk)
    # Then nothing is sent and the delivery says why
    delivery = Delivery.objects.get()
    assert (delivery.state, delivery.attempts) == ("skipped", 0)
    assert delivery.last_error == "the webhook was turned off"
    assert receiver.requests == []


@pytest.mark.django_db(transaction=True)
def test_two_runs_at_once_send_once(rent, user, webhook_to):
    # Given a delivery whose receiver holds its answer until told
    receiver = webhook_to(user)
    receiver.release = threading.Event()
    move(rent(), *TO_RUNNING)
    delivery = Delivery.objects.get()
    outcomes = {}

    def run(name):
        try:
            outcomes[name] = delivery_attempt(delivery_id=delivery.pk)
        finally:
            connections.close_all()

    # When one run is inside its attempt (the request reached the receiver) and a second
    # starts meanwhile
    first = threading.Thread(target=run, args=("first",))
    first.start()
    assert receiver.arrived.wait(30)
    second = threading.Thread(target=run, args=("second",))
    second.start()
    second.join(30)
    receiver.release.set()
    first.join(30)
    # Then the second found the row locked and did nothing; one request, delivered once
    assert outcomes == {"first": "delivered", "second": None}
    assert len(receiver.requests) == 1
    assert Delivery.objects.get().attempts == 1


@pytest.mark.django_db
def test_an_email_reaches_a_real_smtp_server_once(rent, user, smtp_server):
    # Given a rental of a customer with the default settings (emails on)
    rental = move(rent(), *TO_RUNNING)
    delivery = Delivery.objects.get()
    # When the delivery task runs twice
    tasks.deliver(delivery.pk)
    tasks.deliver(delivery.pk)
    # Then the SMTP server received one message to the customer, naming the rental and event
    assert len(smtp_server) == 1
    message = smtp_server[0]
    notification = Notification.objects.get()
    assert message["To"] == user.email
    assert message["Subject"].startswith("[gpumarket] rental ")
    assert "started" in message["Subject"]
    assert message["X-Gpumarket-Event-Id"] == str(notification.pk)
    assert f"Rental: {rental.pk}" in message.get_payload()
    delivery.refresh_from_db()
    assert (delivery.state, delivery.attempts) == ("delivered", 1)


@pytest.mark.django_db
def test_an_unreachable_smtp_server_is_retried(rent, settings):
    # Given Django's SMTP backend pointed at a port nobody listens on
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    settings.EMAIL_BACKEND = "django.core.mail.backends.smtp.EmailBackend"
    settings.EMAIL_HOST, settings.EMAIL_PORT = "127.0.0.1", port
    move(rent(), *TO_RUNNING)
    delivery = Delivery.objects.get()
    # When the delivery runs
    tasks.deliver(delivery.pk)
    # Then it stays pending with the error, to be tried again
    delivery.refresh_from_db()
    assert (delivery.state, delivery.attempts) == ("pending", 1)
    assert delivery.last_error.startswith("ConnectionRefusedError")


@pytest.mark.django_db
def test_an_address_refused_at_delivery_time_fails_without_a_request(
    rent, user, webhook_to, settings
):
    # Given a webhook accepted under development rules (a loopback receiver), then the rules of
    # production (as if the name now resolved to a private address)
    receiver = webhook_to(user)
    move(rent(), *TO_RUNNING)
    settings.NOTIFICATIONS_WEBHOOK_ALLOW_LOOPBACK = False
    # When the delivery runs
    tasks.deliver(Delivery.objects.get().pk)
    # Then nothing is sent, and the delivery failed for good with the reason
    delivery = Delivery.objects.get()
    assert (delivery.state, delivery.attempts) == ("failed", 1)
    assert delivery.last_error == "webhooks are sent over https only"
    assert receiver.requests == []
