"""A rental with JupyterLab: its token (made by the server, shown only to the rental's team),
its command when none is given, the node it needs, what its agent is told, and the URLs its
page and API list for its published ports."""

from datetime import UTC, datetime

import pytest

import agentprotocol
from marketplace import selectors
from marketplace.models import Node, Rental, RentalStatus
from provisioning.models import ContainerRun
from provisioning.services.heartbeat import HeartbeatReports, desired_state, node_heartbeat
from scheduler.services import scheduler_cycle_run
from tests.factories import UserFactory, personal_team

pytestmark = pytest.mark.django_db

HARNESS = {"model": {"name": "gpt"}, "data": {"name": "text"}}

BODY = {"gpus_per_node": 1, "duration_s": 3600, "jupyter": True,
        "runtime": {"image": "gpumarket/harness:dev", "ports": [8000]}}  # fmt: skip


def test_the_two_ends_agree_on_the_notebook_port():
    assert selectors.JUPYTER_PORT == agentprotocol.JUPYTER_PORT == 8888


def test_a_jupyter_rental_gets_a_token_of_its_own_shown_only_to_its_team(auth_api, make_node):
    make_node(card="a100-sxm4-80gb")
    # when two rentals ask for JupyterLab with no command
    first = auth_api.post("/api/v1/rentals/", BODY, format="json")
    second = auth_api.post("/api/v1/rentals/", BODY, format="json")
    assert first.status_code == second.status_code == 201, first.content
    rental = Rental.objects.get(pk=first.json()["id"])
    # then each has its own server-made token, and the notebook is the work
    assert rental.jupyter and len(rental.jupyter_token) == 43
    assert rental.jupyter_token != Rental.objects.get(pk=second.json()["id"]).jupyter_token
    assert rental.command == ["sleep", "infinity"] and rental.harness_config is None
    # and the team sees it on the rental, not in the list
    detail = auth_api.get(f"/api/v1/rentals/{rental.pk}/").json()
    assert (detail["jupyter"], detail["jupyter_token"]) == (True, rental.jupyter_token)
    listed = auth_api.get("/api/v1/rentals/").json()["results"][0]
    assert listed["jupyter"] is True and "jupyter_token" not in listed
    # while another team's member finds no such rental
    from rest_framework.test import APIClient

    from accounts.services import api_token_create

    stranger = UserFactory()
    _, raw = api_token_create(user=stranger, team=personal_team(stranger), name="t")
    other = APIClient()
    other.credentials(HTTP_AUTHORIZATION=f"Bearer {raw}")
    assert other.get(f"/api/v1/rentals/{rental.pk}/").status_code == 404


def test_jupyter_runs_beside_a_command_or_the_harness(auth_api, make_node):
    make_node(card="a100-sxm4-80gb")
    command = {**BODY, "runtime": {"image": "img", "command": ["python", "train.py"]}}
    harness = {**BODY, "runtime": {"image": "gpumarket/harness:dev",
                                   "harness_config": HARNESS}}  # fmt: skip
    a = Rental.objects.get(
        pk=auth_api.post("/api/v1/rentals/", command, format="json").json()["id"]
    )
    b = Rental.objects.get(
        pk=auth_api.post("/api/v1/rentals/", harness, format="json").json()["id"]
    )
    assert a.command == ["python", "train.py"] and a.jupyter
    assert b.command == [] and b.harness_config == HARNESS and b.jupyter


def test_no_node_that_can_publish_a_port_is_400_naming_jupyter_and_stores_nothing(
    auth_api, make_node
):
    node = make_node(card="a100-sxm4-80gb")
    Node.objects.filter(pk=node.pk).update(runtime="process", ssh_capable=False)
    r = auth_api.post("/api/v1/rentals/", BODY, format="json")
    assert r.status_code == 400
    assert r.json()["jupyter"] == [
        "this request can never be placed: jupyter: no matching node can run a container with "
        "a published port"
    ]
    assert not Rental.objects.exists()


def test_the_agent_is_told_the_token_and_the_port_and_the_page_lists_urls(
    auth_api, client, user, make_node
):
    node = make_node(card="a100-sxm4-80gb")
    rental_id = auth_api.post("/api/v1/rentals/", BODY, format="json").json()["id"]
    scheduler_cycle_run()
    rental = Rental.objects.get(pk=rental_id)
    assert rental.status == RentalStatus.SCHEDULED
    # the desired run carries the token and publishes the notebook's port beside the rental's
    [run] = desired_state(node=node, now=datetime.now(UTC))
    assert run.jupyter_token == rental.jupyter_token
    assert run.ports == (8000, 8888)
    assert run.command == ("sleep", "infinity")

    # once the agent reports both ports published, the API and the page list them as URLs
    Rental.objects.filter(pk=rental_id).update(status=RentalStatus.RUNNING)
    ContainerRun.objects.create(
        rental=rental, node=node, run_id=run.run_id, status="running",
        published=[{"container_port": 8000, "host": "gpu-1.example", "host_port": 41000},
                   {"container_port": 8888, "host": "gpu-1.example", "host_port": 41001}],
    )  # fmt: skip
    access = auth_api.get(f"/api/v1/rentals/{rental_id}/").json()["access"]
    assert [a["url"] for a in access] == [
        "http://gpu-1.example:41000/",
        f"http://gpu-1.example:41001/lab?token={rental.jupyter_token}",
    ]
    client.force_login(user)
    page = client.get(f"/rentals/{rental_id}/").content.decode()
    assert f'href="http://gpu-1.example:41001/lab?token={rental.jupyter_token}"' in page
    assert 'href="http://gpu-1.example:41000/"' in page and "Open JupyterLab" in page


def test_a_port_published_after_the_start_is_shown(auth_api, make_node):
    # given a running jupyter rental whose run showed only its own port so far
    node = make_node(card="a100-sxm4-80gb")
    rental_id = auth_api.post("/api/v1/rentals/", BODY, format="json").json()["id"]
    scheduler_cycle_run()
    [run] = desired_state(node=node, now=datetime.now(UTC))
    Rental.objects.filter(pk=rental_id).update(status=RentalStatus.RUNNING)
    port = {"container_port": 8000, "host": "gpu-1.example", "host_port": 41000}
    ContainerRun.objects.create(
        rental_id=rental_id, node=node, run_id=run.run_id, status="running",
        started_at=datetime.now(UTC), published=[port],
    )  # fmt: skip
    # when the next report adds the notebook's port (JupyterLab listens a moment later)
    notebook = {"container_port": 8888, "host": "gpu-1.example", "host_port": 41001}
    report = agentprotocol.ContainerReport(
        rental_id=rental_id, run_id=run.run_id, status=agentprotocol.ContainerStatus.RUNNING,
        started_at=1.0e9,
        published=tuple(agentprotocol.PublishedPort(**p) for p in (port, notebook)),
    )  # fmt: skip
    node_heartbeat(node=Node.objects.get(pk=node.pk), reports=HeartbeatReports(containers=[report]))
    # then both are kept: a report that changes the ports is not a steady one
    assert ContainerRun.objects.get(run_id=run.run_id).published == [port, notebook]
