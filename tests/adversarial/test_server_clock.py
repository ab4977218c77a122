"""A forging agent against the server's clock: billed time starts at the server's own RUNNING
event whatever start time the agent reports, the rental shows the server's times, and a stop
frees the GPUs after the stop grace whatever the agent keeps reporting."""

# The agent API suite's fixtures are imported below, so test arguments "redefine" them.
# ruff: noqa: F811

from __future__ import annotations

from datetime import timedelta

import pytest
from django.test import Client
from django.utils import timezone

from agentprotocol import DEFAULT_STOP_GRACE_S
from billing.models import UsageMeter
from billing.services import billing_pass_run
from marketplace.lifecycle import rental_stop
from marketplace.models import Allocation, Rental, RentalEvent, RentalStatus
from provisioning.models import ContainerRun
from provisioning.services import rentals_release_stopped
from tests.factories import personal_team
from tests.provisioning.test_agent_api import _beat, _schedule, agent  # noqa: F401

pytestmark = pytest.mark.django_db


def _provisioning(agent, rent, *, back_s: int):
    """A 1-GPU rental handed to the agent, its creation, placement and hand-over moved `back_s`
    seconds into the past (the server's own rows: what it authorised, and when)."""
    rental = _schedule(rent, 1)
    [desired] = _beat(agent).json()["desired"]
    back = timedelta(seconds=back_s)
    rental.refresh_from_db()
    Rental.objects.filter(pk=rental.pk).update(created_at=rental.created_at - back)
    RentalEvent.objects.filter(rental=rental).update(created_at=timezone.now() - back)
    for alloc in Allocation.objects.filter(rental=rental):
        alloc.during = type(alloc.during)(alloc.during.lower - back, alloc.during.upper)
        alloc.save(update_fields=["during"])
    rental.refresh_from_db()
    return rental, desired["run_id"]


def test_a_forged_start_is_billed_from_the_servers_running_event(agent, rent, user):
    # Given a rental handed over 100 s ago, created 100 s ago
    rental, run_id = _provisioning(agent, rent, back_s=100)
    forged = timezone.now() - timedelta(hours=1)  # an hour before the rental was created
    run = {"rental_id": str(rental.pk), "run_id": run_id, "started_at": forged.timestamp()}
    # When its agent reports the container running since an hour ago
    assert _beat(agent, containers=[{**run, "status": "running"}]).status_code == 200
    # (as if the server recorded it 60 s ago)
    rental.refresh_from_db()
    assert rental.started_at == rental.events.get(to_status=RentalStatus.RUNNING).created_at
    confirmed = timezone.now()
    RentalEvent.objects.filter(rental=rental, to_status=RentalStatus.RUNNING).update(
        created_at=confirmed - timedelta(seconds=60)
    )
    Rental.objects.filter(pk=rental.pk).update(started_at=confirmed - timedelta(seconds=60))
    rental.refresh_from_db()
    running = rental.events.get(to_status=RentalStatus.RUNNING)
    # and confirms usage from that forged start to now
    usage = {
        "seq": 1, "rental_id": str(rental.pk), "run_id": run_id, "gpu_count": 1,
        "started_at": forged.timestamp(), "confirmed_at": confirmed.timestamp(), "final": False,
    }  # fmt: skip
    assert _beat(agent, usage=[usage]).status_code == 200
    billing_pass_run()
    # Then 60 GPU-seconds are billed: from the server's RUNNING event, not the hand-over 100 s
    # back and not the forged start an hour back
    assert UsageMeter.objects.get(rental=rental).gpu_seconds == 60
    # And the rental's start is the server's event; the agent's is kept on its run as reported
    assert rental.started_at == running.created_at
    assert rental.started_at >= rental.created_at
    reported = ContainerRun.objects.get(run_id=run_id).started_at
    assert abs((reported - forged).total_seconds()) < 0.001
    # And the customer's page shows the server's start, not the forged one
    page = Client()
    page.force_login(user)
    html = page.get(f"/rentals/{rental.pk}/").content.decode()
    assert timezone.localtime(rental.started_at).strftime("%Y-%m-%d %H:%M:%S") in html
    ran = html.split("<dt>Ran</dt>", 1)[1].split("</dd>", 1)[0]
    assert timezone.localtime(forged).strftime("%Y-%m-%d %H:%M:%S") not in ran
    # (the agent's claim is shown apart, as reported)
    reported = html.split('class="muted reported">', 1)[1].split("</dd>", 1)[0]
    assert timezone.localtime(forged).strftime("%Y-%m-%d %H:%M:%S") in reported
    assert "as the node's agent reported it" in reported
    api = page.get(f"/api/v1/rentals/{rental.pk}/").json()
    assert api["started_at"] == rental.started_at.isoformat().replace("+00:00", "Z")


def test_a_stopped_rental_reported_running_frees_its_gpus_after_the_grace(agent, rent, user):
    # Given a running rental that its owner stops
    rental, run_id = _provisioning(agent, rent, back_s=10)
    run = {"rental_id": str(rental.pk), "run_id": run_id, "started_at": timezone.now().timestamp()}
    _beat(agent, containers=[{**run, "status": "running"}])
    rental_stop(team=personal_team(user), actor=user, rental_id=rental.pk)
    stop = Rental.objects.get(pk=rental.pk).events.get(to_status=RentalStatus.STOPPING)
    grace = timedelta(seconds=DEFAULT_STOP_GRACE_S)
    # When its agent keeps reporting it running, within the grace and past it
    _beat(agent, containers=[{**run, "status": "running"}])
    assert rentals_release_stopped(now=stop.created_at + grace / 2) == 0
    assert Allocation.objects.filter(rental=rental, released_at__isnull=True).exists()
    assert rentals_release_stopped(now=stop.created_at + grace + timedelta(seconds=1)) == 1
    _beat(agent, containers=[{**run, "status": "running"}])
    # Then the rental is over and its GPUs were freed at the grace's end
    rental.refresh_from_db()
    assert (rental.status, rental.end_cause) == (RentalStatus.COMPLETED, "customer")
    assert rental.ended_at == stop.created_at + grace
    assert not Allocation.objects.filter(rental=rental, released_at__isnull=True).exists()
    assert {a.during.upper for a in Allocation.objects.filter(rental=rental)} == {
        stop.created_at + grace
    }
    assert _beat(agent).json()["desired"] == []
