"""Notification fixtures: a real HTTP receiver that checks signatures, rentals moved through the
real lifecycle, a team's webhook set through the real service."""

from __future__ import annotations

import hashlib
import hmac
import json
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from django.db import transaction

from marketplace.lifecycle import rental_transition
from marketplace.models import Rental, RentalEvent
from notifications.services import notification_settings_update
from tests.factories import personal_team

# The receiver refuses a timestamp older than this, as a receiver protecting against replays.
TOLERANCE_S = 300


@dataclass
class Received:
    event_id: str
    timestamp: str
    signature: str
    body: bytes
    valid: bool

    @property
    def payload(self) -> dict:
        return json.loads(self.body)


@dataclass
class Receiver:
    """A webhook endpoint: checks each request's signature the way the docs tell receivers to
    (HMAC-SHA256 of "<timestamp>.<body>" under the secret, timestamp recent), records it and
    answers the next scripted status (then `default`)."""

    url: str = ""
    secret: str = ""
    answers: deque = field(default_factory=deque)
    default: int = 200
    requests: list[Received] = field(default_factory=list)
    # Set while a request is being answered; a test can hold the answer until `release` is set.
    arrived: threading.Event = field(default_factory=threading.Event)
    release: threading.Event | None = None

    def check(self, timestamp: str, body: bytes, signature: str) -> bool:
        if not timestamp.isdigit() or abs(time.time() - int(timestamp)) > TOLERANCE_S:
            return False
        mac = hmac.new(self.secret.encode(), f"{timestamp}.".encode() + body, hashlib.sha256)
        return hmac.compare_digest(f"v1={mac.hexdigest()}", signature)

    @property
    def valid(self) -> list[Received]:
        return [r for r in self.requests if r.valid]


@pytest.fixture
def receiver():
    state = Receiver()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            timestamp = self.headers.get("X-Gpumarket-Timestamp", "")
            signature = self.headers.get("X-Gpumarket-Signature", "")
            received = Received(
                event_id=self.headers.get("X-Gpumarket-Event-Id", ""),
                timestamp=timestamp,
                signature=signature,
                body=body,
                valid=state.check(timestamp, body, signature),
            )
            state.requests.append(received)
            state.arrived.set()
            if state.release is not None:
                state.release.wait(30)
            status = state.answers.popleft() if state.answers else state.default
            self.send_response(status if received.valid else 400)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    state.url = f"http://127.0.0.1:{server.server_address[1]}/hooks/gpumarket"
    try:
        yield state
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def webhook_to(receiver):
    """Send the notifications of `person`'s personal team to the receiver (emails off unless
    asked), which learns the secret the one time it is shown."""

    def point(person, *, email: bool = False):
        change = notification_settings_update(
            team=personal_team(person), webhook_url=receiver.url, email_enabled=email
        )
        receiver.secret = change.webhook_secret
        return receiver

    return point


def move(rental: Rental, *statuses: str, **fields) -> Rental:
    """Move the rental through `statuses` with the lifecycle, each edge its own transaction as
    the agent's reports make them."""
    for to_status in statuses:
        with transaction.atomic():
            locked = Rental.objects.select_for_update().get(pk=rental.pk)
            rental = rental_transition(
                rental=locked,
                to_status=to_status,
                actor_kind=RentalEvent.Actor.AGENT,
                reason=f"test: {to_status}",
                **fields,
            )
    return rental
