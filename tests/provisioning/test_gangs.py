"""A rental over two nodes through the agent API: every member gets the same job description
(torchrun's variables), the rental runs and is billed from the moment its last member runs,
it ends when all members have finished or one has failed, and a gang whose members do not all
start is placed again, then failed, never billed."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from marketplace.lifecycle import rental_stop
from marketplace.models import Allocation, Node, Rental, RentalStatus
from marketplace.services.rentals import RuntimeSpec
from provisioning.models import ContainerRun
from provisioning.services import gangs_start_timeout, nodes_mark_silent
from provisioning.services.gangs import master_port
from scheduler.services import scheduler_cycle_run
from tests.factories import personal_team
from tests.provisioning.test_agent_api import HOST, _gpus

pytestmark = pytest.mark.django_db

S = RentalStatus


def _join(api, token: str, hostname: str, **extra) -> APIClient:
    gpus = [{**gpu, "uuid": f"{gpu['uuid']}-{hostname}"} for gpu in _gpus(2)]
    body = {
        "join_token": token,
        "hostname": hostname,
        "host": HOST,
        "internet_filtered": True,
        "gpus": gpus,
        **extra,
    }
    r = api.post("/api/agent/v1/join/", body, format="json", REMOTE_ADDR="192.0.2.77")
    assert r.status_code == 201, r.content
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {r.json()['node_token']}")
    client.node = Node.objects.get(pk=r.json()["node_id"])
    return client


@pytest.fixture
def members(api, make_join_token):
    """Two 2-GPU nodes of one provider in one cluster (the first creates it at its join, the
    second joins it); the first declares its fabric address, the second's is the address its
    join came from."""
    fabric = {"cluster": "gang", "interconnect": "ethernet", "interconnect_gbps": 25}
    first = _join(api, make_join_token(), "gang-a", fabric_address="10.40.0.11", **fabric)
    second = _join(api, make_join_token(), "gang-b", cluster="gang")
    return sorted([first, second], key=lambda agent: agent.node.pk)


def _beat(agent, **body):
    r = agent.post("/api/agent/v1/heartbeat/", body, format="json")
    assert r.status_code == 200, r.content
    return r.json()


def _gang(rent, **kwargs) -> Rental:
    rental = rent(2, node_count=2, **kwargs)
    scheduler_cycle_run()
    rental.refresh_from_db()
    assert rental.status == S.SCHEDULED
    assert Allocation.objects.filter(rental=rental).values("node").distinct().count() == 2
    return rental


def _run(agent, rental) -> dict:
    [desired] = _beat(agent)["desired"]
    assert desired["rental_id"] == str(rental.pk)
    return desired


def _report(agent, desired, status, **fields):
    run = {"rental_id": desired["rental_id"], "run_id": desired["run_id"], "status": status}
    return _beat(agent, containers=[{**run, **fields}])


def test_the_join_records_the_fabric_address_declared_or_seen(members):
    addresses = {agent.node.hostname: agent.node.fabric_address for agent in members}
    assert addresses == {"gang-a": "10.40.0.11", "gang-b": "192.0.2.77"}


def test_a_bad_fabric_address_is_a_400_naming_the_field(api, join_token):
    body = {"join_token": join_token, "hostname": "h", "host": HOST, "gpus": _gpus(2),
            "fabric_address": "10.0.0.300"}  # fmt: skip
    r = api.post("/api/agent/v1/join/", body, format="json")
    assert r.status_code == 400 and "fabric_address" in r.json()
    assert not Node.objects.filter(hostname="h").exists()


def test_every_member_gets_the_same_job_description_with_its_own_rank(members, rent):
    # given a 2 x 2 GPU rental whose customer set variables of the same names
    env = {"MASTER_ADDR": "evil.example", "MY_SETTING": "kept"}
    rental = _gang(rent, runtime=RuntimeSpec(image="gpumarket/harness:dev", env=env))
    # when each member's agent heartbeats
    runs = [_run(agent, rental) for agent in members]
    # then each run has torchrun's variables: one job of 4 ranks, node rank by node id, rank 0's
    # node as the master, one port for the rental
    addresses = [agent.node.fabric_address or agent.node.hostname for agent in members]
    for rank, desired in enumerate(runs):
        env = desired["env"]
        assert env["NNODES"] == "2" and env["NODE_RANK"] == str(rank)
        assert env["NPROC_PER_NODE"] == "2" and env["WORLD_SIZE"] == "4"
        assert env["MASTER_ADDR"] == addresses[0]
        assert env["MASTER_PORT"] == str(master_port(rental))
        assert env["GPUMARKET_NODE_ADDR"] == addresses[rank]
        assert env["GPUMARKET_GANG_ADDRS"] == ",".join(addresses)
        assert env["GPUMARKET_RENTAL_ID"] == str(rental.pk)
        # the platform's description wins; the customer's other variables are kept
        assert env["MY_SETTING"] == "kept"
    assert runs[0]["run_id"] != runs[1]["run_id"]


def test_a_single_node_rental_gets_no_job_description(members, rent):
    rental = rent(2)
    scheduler_cycle_run()
    env = next(
        d["env"] for agent in members for d in _beat(agent)["desired"] if d["rental_id"]
    )  # fmt: skip
    assert Rental.objects.get(pk=rental.pk).node_count == 1
    assert "NNODES" not in env and "MASTER_ADDR" not in env


def test_the_gang_runs_from_its_last_members_start_and_ends_when_all_have_finished(members, rent):
    rental = _gang(rent)
    first, second = members
    run_a, run_b = _run(first, rental), _run(second, rental)
    # when the first member runs, the rental waits for the second, unbilled
    _report(first, run_a, "running", started_at=1.0e9)
    rental.refresh_from_db()
    assert (rental.status, rental.started_at) == (S.PROVISIONING, None)
    assert "1 of 2 members running" in rental.status_reason
    # when the second runs, 30 s later, the rental is RUNNING from that moment: the server's
    # RUNNING event, not the start either agent reported (kept on its run, as reported)
    _report(second, run_b, "running", started_at=1.0e9 + 30)
    rental.refresh_from_db()
    assert rental.status == S.RUNNING
    assert rental.started_at == rental.events.get(to_status=S.RUNNING).created_at
    assert ContainerRun.objects.get(run_id=run_b["run_id"]).started_at.timestamp() == (
        pytest.approx(1.0e9 + 30)
    )
    # when one member finishes its part, the rental goes on until the other has too
    _report(second, run_b, "exited", exit_code=0, finished_at=1.0e9 + 90)
    rental.refresh_from_db()
    assert rental.status == S.RUNNING
    assert _run(first, rental)["run_id"] == run_a["run_id"]  # the first member keeps running
    _report(first, run_a, "exited", exit_code=0, finished_at=1.0e9 + 95)
    rental.refresh_from_db()
    assert (rental.status, rental.exit_code) == (S.COMPLETED, 0)
    assert not Allocation.objects.filter(rental=rental, released_at__isnull=True).exists()


def test_one_failing_member_ends_the_gang_and_stops_the_other(members, rent):
    rental = _gang(rent)
    first, second = members
    run_a, run_b = _run(first, rental), _run(second, rental)
    _report(first, run_a, "running", started_at=1.0e9)
    _report(second, run_b, "running", started_at=1.0e9 + 1)
    # when the second member's job fails
    _report(second, run_b, "exited", exit_code=1, log_tail="rank 3 failed")
    rental.refresh_from_db()
    # then the rental failed with the reason, and the first member is asked to stop
    assert (rental.status, rental.exit_code) == (S.FAILED, 1)
    assert _beat(first)["desired"] == []


def test_a_gang_whose_members_do_not_all_start_is_placed_again_then_failed_unbilled(
    members, rent, settings
):
    settings.GPUMARKET = {**settings.GPUMARKET, "GANG_START_TIMEOUT_S": 60,
                          "GANG_START_ATTEMPTS": 2}  # fmt: skip
    rental = _gang(rent)
    first, second = members
    run_a = _run(first, rental)
    _run(second, rental)  # handed over, never starts
    _report(first, run_a, "running", started_at=1.0e9)
    # before the timeout nothing happens
    assert gangs_start_timeout(now=timezone.now()) == 0
    # past it the rental goes back to the queue with the reason, its GPUs freed
    later = timezone.now() + timedelta(seconds=120)
    assert gangs_start_timeout(now=later) == 1
    rental.refresh_from_db()
    assert rental.status == S.PENDING and rental.started_at is None
    assert "1 of 2 ran (waiting for gang-" in rental.status_reason
    assert not Allocation.objects.filter(rental=rental, released_at__isnull=True).exists()
    assert not ContainerRun.objects.filter(rental=rental).exists()
    assert _beat(first)["desired"] == []
    # placed again, it fails the same way: the second time it is failed, never having run
    scheduler_cycle_run()
    rental.refresh_from_db()
    assert rental.status == S.SCHEDULED
    for agent in members:
        _run(agent, rental)
    assert gangs_start_timeout(now=timezone.now() + timedelta(seconds=120)) == 1
    rental.refresh_from_db()
    assert rental.status == S.FAILED and rental.started_at is None
    assert "0 of 2 ran" in rental.status_reason
    assert not Allocation.objects.filter(rental=rental, released_at__isnull=True).exists()


def _running_gang(members, rent, **kwargs) -> Rental:
    rental = _gang(rent, **kwargs)
    for i, agent in enumerate(members):
        _report(agent, _run(agent, rental), "running", started_at=1.0e9 + i)
    rental.refresh_from_db()
    assert rental.status == S.RUNNING
    return rental


def _silent(agent) -> None:
    Node.objects.filter(pk=agent.node.pk).update(last_seen_at=timezone.now() - timedelta(hours=1))


def test_a_lost_member_node_requeues_an_interruptible_gang_as_a_whole(
    api, make_join_token, members, rent
):
    # given an interruptible 2 x 2 gang running on two nodes, and a third node free
    spare = _join(api, make_join_token(), "gang-c", cluster="gang")
    rental = _running_gang(members, rent, kind="interruptible", bid_per_gpu_hour="0.50")
    first, second = members
    # when the second member's node goes silent
    _silent(second)
    assert nodes_mark_silent() == [second.node.pk]
    rental.refresh_from_db()
    # then the whole gang goes back to the queue with the node named, every GPU freed, and
    # the member that still runs is stopped by its desired state
    assert rental.status == S.PENDING
    assert rental.status_reason == f"node {second.node.hostname} went silent; re-queued"
    assert not Allocation.objects.filter(rental=rental, released_at__isnull=True).exists()
    assert not ContainerRun.objects.filter(rental=rental).exists()
    assert _beat(first)["desired"] == []
    # and it is placed again as a whole on live nodes: the survivor and the spare, never the
    # lost node's GPUs
    scheduler_cycle_run()
    rental.refresh_from_db()
    assert rental.status == S.SCHEDULED
    held = set(
        Allocation.objects.filter(rental=rental, released_at__isnull=True).values_list(
            "node_id", flat=True
        )
    )
    assert held == {first.node.pk, spare.node.pk}
    # and the survivor gets a new run of the new placement, beside its stopped one
    [desired] = _beat(first)["desired"]
    assert desired["env"]["NNODES"] == "2"
    assert ContainerRun.objects.filter(rental=rental, node=first.node).count() == 1


def test_a_lost_member_node_fails_an_on_demand_gang_with_the_reason(members, rent):
    rental = _running_gang(members, rent)
    first, second = members
    _silent(second)
    nodes_mark_silent()
    rental.refresh_from_db()
    assert rental.status == S.FAILED
    assert rental.status_reason == f"node {second.node.hostname} went silent"
    assert not Allocation.objects.filter(rental=rental, released_at__isnull=True).exists()
    assert _beat(first)["desired"] == []
    # the stopped member's late exit report changes nothing
    assert not ContainerRun.objects.filter(rental=rental).exists()


def test_the_rental_shows_each_member_its_node_its_state_and_its_log(
    members, rent, auth_api, client, user
):
    # given a running gang whose rank 0 printed lines and whose other member then failed
    rental = _running_gang(members, rent)
    first, second = members
    run_a = ContainerRun.objects.get(rental=rental, node=first.node)
    lines = [
        {"rental_id": str(rental.pk), "run_id": run_a.run_id, "line_no": i, "line": f"step {i}"}
        for i in range(30)
    ]
    _beat(first, logs=lines)
    run_b = ContainerRun.objects.get(rental=rental, node=second.node)
    desired_b = {"rental_id": str(rental.pk), "run_id": run_b.run_id}
    _report(second, desired_b, "exited", exit_code=1, log_tail="rank 3 failed\n")
    # when the customer reads the rental through the API
    r = auth_api.get(f"/api/v1/rentals/{rental.pk}/")
    assert r.status_code == 200
    # then each member is listed by node rank with its node, its run's state and its log tail
    [a, b] = r.json()["members"]
    assert (a["node_rank"], a["node"], a["state"]) == (0, first.node.hostname, "running")
    assert a["log_tail"].splitlines() == [f"step {i}" for i in range(10, 30)]
    assert (b["node_rank"], b["node"], b["state"], b["exit_code"]) == (
        1, second.node.hostname, "exited", 1,
    )  # fmt: skip
    assert b["log_tail"] == "rank 3 failed\n"
    # and the rental's page shows the same
    client.force_login(user)
    html = client.get(f"/rentals/{rental.pk}/").content.decode()
    assert html.count('<tr class="member">') == 2
    assert second.node.hostname in html and "rank 3 failed" in html and "step 29" in html


def test_a_stop_reaches_every_member_and_the_gang_ends_once_stopped(members, rent, user):
    # given a running gang
    rental = _running_gang(members, rent)
    first, second = members
    # when the customer stops it
    rental_stop(team=personal_team(user), actor=user, rental_id=rental.pk)
    # then no member is desired any more: each agent stops (SIGTERM: checkpoint, exit 0)
    assert _beat(first)["desired"] == [] and _beat(second)["desired"] == []
    # and the first member's exit ends the rental as stopped, not failed
    run_a = ContainerRun.objects.get(rental=rental, node=first.node)
    _report(first, {"rental_id": str(rental.pk), "run_id": run_a.run_id}, "exited", exit_code=0)
    rental.refresh_from_db()
    assert (rental.status, rental.status_reason) == (S.COMPLETED, "stopped")
