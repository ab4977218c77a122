"""Images through the agent API: the allow-list an agent says at join and in heartbeats, the
images it holds, and the progress of a pull, as the server keeps and shows them."""

from __future__ import annotations

import pytest
from rest_framework.test import APIClient

from gpumarket_cli.rentals import rental_summary
from marketplace.lifecycle import start_error_cause
from marketplace.models import EndCause, Node, Rental, RentalStatus
from provisioning.models import ContainerRun
from scheduler.services import scheduler_cycle_run
from tests.provisioning.test_agent_api import HOST, _beat, _gpus

pytestmark = pytest.mark.django_db


def _join(api, join_token, **extra) -> APIClient:
    r = api.post(
        "/api/agent/v1/join/",
        {
            "join_token": join_token,
            "hostname": "img-host",
            "host": HOST,
            "gpus": _gpus(),
            "internet_filtered": True,
            **extra,
        },
        format="json",
    )
    assert r.status_code == 201, r.content
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {r.json()['node_token']}")
    client.node = Node.objects.get(pk=r.json()["node_id"])
    return client


def test_the_allow_list_said_at_join_and_changed_in_a_heartbeat_is_kept(api, join_token):
    agent = _join(api, join_token, image_allow=["gpumarket/harness:*"])
    assert Node.objects.get(pk=agent.node.pk).image_allow == ["gpumarket/harness:*"]
    r = _beat(agent, image_allow=["ghcr.io/*", "gpumarket/harness:*"])
    assert r.status_code == 200, r.content
    assert Node.objects.get(pk=agent.node.pk).image_allow == ["ghcr.io/*", "gpumarket/harness:*"]
    # a heartbeat that does not say it leaves it as it was
    _beat(agent)
    assert Node.objects.get(pk=agent.node.pk).image_allow == ["ghcr.io/*", "gpumarket/harness:*"]


def test_an_agent_that_never_said_accepts_any_image(api, join_token):
    agent = _join(api, join_token)
    assert Node.objects.get(pk=agent.node.pk).image_allow is None


def test_held_images_are_replaced_when_reported_and_kept_otherwise(api, join_token):
    agent = _join(api, join_token)
    held = [
        {"ref": "ghcr.io/team/train:1", "digest": "sha256:aa", "size_bytes": 10},
        {"ref": "gpumarket/harness:dev", "digest": "sha256:bb", "size_bytes": 20},
    ]
    assert _beat(agent, images=held).status_code == 200
    assert Node.objects.get(pk=agent.node.pk).images == held
    _beat(agent, images=None)
    assert Node.objects.get(pk=agent.node.pk).images == held
    _beat(agent, images=[])
    assert Node.objects.get(pk=agent.node.pk).images == []


def test_a_bad_image_entry_is_dropped_and_counted(api, join_token):
    agent = _join(api, join_token)
    r = _beat(agent, images=[{"ref": "x" * 300}, {"ref": "ok:1"}])
    assert r.status_code == 200 and r.json()["dropped"] == {"images": 1}
    assert Node.objects.get(pk=agent.node.pk).images == [
        {"ref": "ok:1", "digest": "", "size_bytes": 0}
    ]


def test_pull_progress_is_kept_on_the_run_and_shown_while_provisioning(api, join_token, rent, user):
    # given a rental handed to its node's agent (PROVISIONING)
    agent = _join(api, join_token)
    rental = rent(2)
    scheduler_cycle_run()
    [desired] = _beat(agent).json()["desired"]
    owner = APIClient()
    owner.force_authenticate(user)
    assert owner.get(f"/api/v1/rentals/{rental.pk}/").json()["pull_progress"] is None
    # when the agent reports its image's pull under way
    pull = {"rental_id": str(rental.pk), "run_id": desired["run_id"]}
    r = _beat(agent, pulls=[{**pull, "done_bytes": 3_200_000_000, "total_bytes": 8_100_000_000}])
    assert r.status_code == 200, r.content
    # then the run keeps it, and the rental's API and page show it
    run = ContainerRun.objects.get(run_id=desired["run_id"])
    assert run.pull_progress["done_bytes"] == 3_200_000_000
    shown = owner.get(f"/api/v1/rentals/{rental.pk}/").json()
    assert shown["status"] == RentalStatus.PROVISIONING
    assert shown["pull_progress"] == {
        "done_bytes": 3_200_000_000,
        "total_bytes": 8_100_000_000,
        "text": "pulling 3.2 of 8.1 GB",
    }
    [status_line] = [x for x in rental_summary(shown).splitlines() if x.startswith("status ")]
    assert status_line.startswith("status    provisioning")
    assert status_line.endswith("(pulling 3.2 of 8.1 GB)")
    owner.force_login(user)
    page = owner.get(f"/rentals/{rental.pk}/")
    assert "pulling 3.2 of 8.1 GB" in page.content.decode()
    # and once the container runs, a late pull report changes nothing and nothing is shown
    running = {**pull, "status": "running", "started_at": 1.0e9}
    _beat(agent, containers=[running])
    _beat(agent, pulls=[{**pull, "done_bytes": 1, "total_bytes": 2}])
    assert ContainerRun.objects.get(run_id=desired["run_id"]).pull_progress["done_bytes"] == (
        3_200_000_000
    )
    assert owner.get(f"/api/v1/rentals/{rental.pk}/").json()["pull_progress"] is None


def test_an_image_too_large_for_its_node_ends_the_rental_as_the_customers_doing(
    api, join_token, rent
):
    agent = _join(api, join_token)
    rental = rent(2)
    scheduler_cycle_run()
    [desired] = _beat(agent).json()["desired"]
    error = (
        "image '127.0.0.1:5000/big:1' is too large for this node (its layers add up to 9.0 GB; "
        "this node takes at most 5.0 GB)"
    )
    missing = {"rental_id": str(rental.pk), "run_id": desired["run_id"], "status": "missing"}
    _beat(agent, containers=[{**missing, "error": error}])
    rental = Rental.objects.get(pk=rental.pk)
    assert rental.status == RentalStatus.FAILED
    assert rental.end_cause == EndCause.CUSTOMER
    assert "too large for this node" in rental.status_reason
    assert start_error_cause("no such image 'x:1' (or no access to it): not found") == (
        EndCause.CUSTOMER
    )
