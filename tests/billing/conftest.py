"""Billing fixtures: funded customers, booked rentals with a window in the past (so reports can
confirm hours of use), and localstripe driven through the real Stripe SDK."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import Decimal
from pathlib import Path

import pytest
import stripe
from django.db import transaction
from django.db.backends.postgresql.psycopg_any import DateTimeTZRange
from django.utils import timezone

from billing.conf import MICROS_PER_USD
from billing.services import account_adjust, account_for_team, usage_report_apply
from marketplace.lifecycle import rental_transition
from marketplace.models import Allocation, Rental, RentalEvent, RentalStatus
from marketplace.services.rentals import RentalRequest, RuntimeSpec, rental_create
from scheduler.services import scheduler_cycle_run
from tests.factories import personal_team

WEBHOOK_SECRET = "whsec_test_localstripe"


@pytest.fixture(autouse=True)
def _funds_check_on(settings):
    """Billing tests exercise the funds check whatever the suite-wide default is."""
    settings.BILLING_FUNDS_CHECK = True


@pytest.fixture(scope="session")
def localstripe_base():
    """The localstripe the test command started, or one started here for a bare pytest run."""
    base = os.environ.get("STRIPE_API_BASE")
    if base:
        yield base
        return
    from devstack.embedded import free_port

    port = free_port()
    binary = Path(sys.executable).parent / "localstripe"
    proc = subprocess.Popen(
        [str(binary), "--port", str(port), "--from-scratch"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), 0.5).close()
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("localstripe did not start") from None
            time.sleep(0.2)
    yield f"http://127.0.0.1:{port}"
    proc.terminate()
    proc.wait(10)


@pytest.fixture
def stripe_on(settings, localstripe_base):
    """Stripe keys pointing at localstripe; returns a client playing the customer's browser
    and Stripe's dashboard (confirming cards, listing events)."""
    settings.STRIPE_API_BASE = localstripe_base
    settings.STRIPE_SECRET_KEY = "sk_test_localstripe"
    settings.STRIPE_PUBLISHABLE_KEY = "pk_test_localstripe"
    settings.STRIPE_WEBHOOK_SECRET = WEBHOOK_SECRET
    return stripe.StripeClient(
        "sk_test_localstripe",
        base_addresses={"api": localstripe_base},
        http_client=stripe.RequestsClient(timeout=10),
    )


@pytest.fixture
def stripe_off(settings):
    settings.STRIPE_SECRET_KEY = ""
    settings.STRIPE_PUBLISHABLE_KEY = ""
    settings.STRIPE_API_BASE = ""


def signed(payload: dict | bytes, *, secret: str = WEBHOOK_SECRET, timestamp=None):
    """(body, Stripe-Signature header) signed with the SDK's own v1 scheme."""
    body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    header = stripe.WebhookSignature.generate_signature_header(
        body.decode(), secret, timestamp=timestamp
    )
    return body, header


def stripe_events(client: stripe.StripeClient, kind: str, object_id: str) -> list[dict]:
    """Events localstripe emitted for one object, as the JSON Stripe would send."""
    recent = {"type": kind, "limit": 100, "created": {"gte": int(time.time()) - 300}}
    found = client.v1.events.list(params=recent).auto_paging_iter()
    return [e.to_dict() for e in found if e.data.object["id"] == object_id]


def usd(amount: str) -> int:
    return int(Decimal(amount) * MICROS_PER_USD)


@pytest.fixture
def fund():
    def give(user, amount: str = "1000.00"):
        account = account_for_team(team=personal_team(user))
        account_adjust(
            account_id=account.pk, amount_micros=usd(amount), reason="test funds", actor=None
        )
        account.refresh_from_db()
        return account

    return give


@dataclass
class Booked:
    rental: Rental
    node_ids: list[int]
    start: datetime

    def at(self, seconds: float) -> datetime:
        return self.start + timedelta(seconds=seconds)

    def report(self, *, seq, confirmed_s, run="run-1", started_s=0, node=None, final=False):
        usage_report_apply(
            node_id=node or self.node_ids[0],
            rental_id=self.rental.pk,
            run_id=run,
            seq=seq,
            gpu_count=self.rental.gpus_per_node,
            started_at=self.at(started_s),
            confirmed_at=self.at(confirmed_s),
            final=final,
        )


@pytest.fixture
def book_many(user, fund):
    """Rent GPUs through the real services (funds check, scheduler) and run the rentals, with
    their billing window moved `hours_ago` into the past so reports can confirm hours of use.
    Each spec is a dict of `book` arguments; one scheduler cycle places them all."""

    def make(specs: list[dict], *, customer=None) -> list[Booked]:
        customer = customer or user
        if account_for_team(team=personal_team(customer)).balance_micros <= 0:
            fund(customer)
        rentals = [
            rental_create(
                customer=customer,
                team=personal_team(customer),
                request=RentalRequest(
                    gpus_per_node=spec.get("gpus", 1),
                    node_count=spec.get("nodes", 1),
                    duration_s=int(spec.get("hours", 2) * 3600),
                    kind=spec.get("kind", "on_demand"),
                    bid_per_gpu_hour=Decimal(spec["bid"]) if spec.get("bid") else None,
                    max_charge=Decimal(spec["max_charge"]) if spec.get("max_charge") else None,
                    runtime=RuntimeSpec(image="gpumarket/harness:dev"),
                ),
            )
            for spec in specs
        ]
        scheduler_cycle_run(pool=rentals[0].pool)
        booked = []
        for rental, spec in zip(rentals, specs, strict=True):
            rental.refresh_from_db()
            assert rental.status == RentalStatus.SCHEDULED, rental.status_reason
            hours_ago = spec.get("hours_ago")
            start = (
                rental.scheduled_start
                if hours_ago is None
                else timezone.now().replace(microsecond=0) - timedelta(hours=hours_ago)
            )
            # The whole booking moves: its window, its allocations (released at their end
            # once that is past, freeing the GPUs for the next booking) and its history, so
            # the rental has held its GPUs and run since `start`.
            end = start + timedelta(seconds=rental.duration_s)
            Rental.objects.filter(pk=rental.pk).update(scheduled_start=start, scheduled_end=end)
            Allocation.objects.filter(rental=rental).update(
                during=DateTimeTZRange(start, end),
                released_at=end if end <= timezone.now() else None,
            )
            rental.refresh_from_db()
            with transaction.atomic():
                for to in (RentalStatus.PROVISIONING, RentalStatus.RUNNING):
                    rental = rental_transition(
                        rental=rental,
                        to_status=to,
                        actor_kind=RentalEvent.Actor.AGENT,
                        reason="test",
                    )
            RentalEvent.objects.filter(rental=rental).update(created_at=start)
            Rental.objects.filter(pk=rental.pk).update(started_at=start)
            rental.started_at = start
            node_ids = sorted(
                set(Allocation.objects.filter(rental=rental).values_list("node_id", flat=True))
            )
            booked.append(Booked(rental=rental, node_ids=node_ids, start=start))
        return booked

    return make


@pytest.fixture
def book(book_many):
    """One rental, as `book_many` books them."""

    def make(*, customer=None, **spec) -> Booked:
        return book_many([spec], customer=customer)[0]

    return make
