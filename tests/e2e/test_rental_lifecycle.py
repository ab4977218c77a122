"""End to end on the real stack: API -> Celery scheduler -> agent -> Docker container -> back.

Each test starts a real node agent (simulated GPUs, the Docker runtime) against the live server;
a real Celery worker runs the scheduler cycles that rental_create queues.
"""

from __future__ import annotations

import pytest
from django.test import override_settings

from marketplace.models import Node, NodeStatus, Rental, RentalStatus
from provisioning.models import ContainerRun, RunMetric
from provisioning.services import node_credential_revoke, nodes_mark_silent
from tests.e2e.conftest import (
    HARNESS_IMAGE,
    credit_customer,
    managed_containers,
    remove_managed,
    wait_for,
)

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

TRAIN_FOREVER = {
    "model": {"name": "mnist_cnn"},
    "data": {"name": "digits", "batch_size": 32},
    "train": {"steps": 1_000_000, "log_every": 5, "device": "cpu"},
    "checkpoint": {"every_steps": 50},
}


def _rent(auth_api, **runtime) -> str:
    body = {
        "gpus_per_node": 1,
        "region": "e2e",
        "duration_s": 3600,
        "runtime": {"image": HARNESS_IMAGE, **runtime},
        "network": "internal",  # the host's engine runs without iptables: no internet there
    }
    r = auth_api.post("/api/v1/rentals/", body, format="json")
    assert r.status_code == 201, r.content
    return r.json()["id"]


def _status(rental_id: str) -> str:
    return Rental.objects.values_list("status", flat=True).get(pk=rental_id)


def _wait_status(rental_id: str, status: str, timeout: float = 180) -> Rental:
    wait_for(lambda: _status(rental_id) == status, timeout, f"rental {status}")
    return Rental.objects.get(pk=rental_id)


def _steps(rental_id: str) -> int:
    return RunMetric.objects.filter(rental_id=rental_id, event="step").count()


@pytest.fixture(autouse=True)
def _funded_customer(settings, user):
    """The real path: the funds check is on and the customer has credit from ops."""
    settings.BILLING_FUNDS_CHECK = True
    credit_customer(user)


@pytest.fixture(autouse=True)
def _no_leftover_containers(docker_client):
    yield
    remove_managed(docker_client)


def _joined() -> Node:
    return wait_for(lambda: Node.objects.filter(region="e2e").first(), 90, "the agent to join")


def test_a_rental_trains_in_a_real_container_and_stops_cleanly(
    auth_api, celery_worker, start_agent, docker_client
):
    start_agent()
    node = _joined()
    assert node.simulated and node.gpu_count == 2
    rental_id = _rent(auth_api, harness_config=TRAIN_FOREVER)
    _wait_status(rental_id, RentalStatus.RUNNING)
    wait_for(lambda: _steps(rental_id) >= 3, 120, "harness metrics")
    [container] = managed_containers(docker_client, rental_id)
    host = container.attrs["HostConfig"]
    assert host["Privileged"] is False
    assert host["NetworkMode"] != "host" and host["PidMode"] != "host"
    assert host["NanoCpus"] > 0 and host["Memory"] >= 2048 * 1024 * 1024
    assert container.labels["gpumarket.rental"] == rental_id

    r = auth_api.post(f"/api/v1/rentals/{rental_id}/stop/")
    assert r.json()["status"] == "stopping"
    rental = _wait_status(rental_id, RentalStatus.COMPLETED)
    assert rental.exit_code == 0
    wait_for(lambda: not managed_containers(docker_client, rental_id), 60, "container removal")
    # SIGTERM made the harness checkpoint and say so before exiting.
    events = set(RunMetric.objects.filter(rental_id=rental_id).values_list("event", flat=True))
    assert {"start", "step", "checkpoint", "summary"} <= events
    summary = RunMetric.objects.get(rental_id=rental_id, event="summary").data
    assert summary["exit_reason"] == "sigterm"
    assert list(rental.events.values_list("to_status", flat=True)) == [
        "pending", "scheduled", "provisioning", "running", "stopping", "completed",
    ]  # fmt: skip


def test_a_killed_agent_adopts_its_container_on_restart(
    auth_api, celery_worker, start_agent, docker_client
):
    agent = start_agent()
    _joined()
    rental_id = _rent(auth_api, harness_config=TRAIN_FOREVER)
    _wait_status(rental_id, RentalStatus.RUNNING)
    [before] = managed_containers(docker_client, rental_id)
    agent.kill()
    seen = _steps(rental_id)
    agent.start()
    # Metrics flow again only once the new agent has adopted the running container.
    wait_for(lambda: _steps(rental_id) > seen + 2, 120, "metrics after the restart")
    after = managed_containers(docker_client, rental_id)
    assert [c.id for c in after] == [before.id]
    assert _status(rental_id) == RentalStatus.RUNNING
    assert ContainerRun.objects.filter(rental_id=rental_id).count() == 1


def test_a_container_exiting_non_zero_fails_the_rental_with_code_and_log(
    auth_api, celery_worker, start_agent, docker_client
):
    start_agent()
    _joined()
    rental_id = _rent(
        auth_api,
        command=["python", "-c", "import sys; print('loading shards', flush=True); sys.exit(3)"],
    )
    rental = _wait_status(rental_id, RentalStatus.FAILED)
    assert rental.exit_code == 3
    assert "loading shards" in rental.log_tail
    assert "code 3" in rental.status_reason
    wait_for(lambda: not managed_containers(docker_client, rental_id), 60, "container removal")


def test_a_config_that_cannot_fit_the_card_is_refused_at_start_with_the_reason(
    auth_api, celery_worker, start_agent, docker_client
):
    # The simulated host's cards are RTX 4090s (24 GB); GPT-2 1.5B under plain data parallelism
    # in bf16 keeps 16 bytes of states per parameter: about 25 GB before any activation.
    start_agent()
    _joined()
    too_big = {
        "model": {"name": "transformer", "preset": "gpt2-1.5b"},
        "data": {"name": "text", "seq_len": 512, "batch_size": 1},
        "train": {"steps": 10, "precision": "bf16", "device": "cpu"},
    }
    rental_id = _rent(auth_api, harness_config=too_big)
    rental = _wait_status(rental_id, RentalStatus.FAILED)
    assert rental.exit_code == 2
    assert "container exited with code 2: config error: layout: needs about" in (
        rental.status_reason
    ), rental.status_reason
    assert "the GPUs have 24 GB" in rental.status_reason
    # Refused before training: not one step was reported.
    assert _steps(rental_id) == 0


def test_a_silent_node_goes_offline_and_its_rental_fails_by_policy(
    auth_api, celery_worker, start_agent, docker_client
):
    agent = start_agent()
    node = _joined()
    rental_id = _rent(auth_api, harness_config=TRAIN_FOREVER)
    _wait_status(rental_id, RentalStatus.RUNNING)
    agent.kill()
    silence = {"NODE_SILENCE_TIMEOUT_S": 2, "NODE_LOST_POLICY": "fail", "HEARTBEAT_INTERVAL_S": 1}
    with override_settings(GPUMARKET=silence):
        wait_for(lambda: nodes_mark_silent() == [node.pk], 30, "the node to be marked silent")
    node.refresh_from_db()
    assert node.status == NodeStatus.OFFLINE
    rental = _wait_status(rental_id, RentalStatus.FAILED, timeout=5)
    assert "went silent" in rental.status_reason
    # The agent comes back: the node is online again and the orphan container is stopped.
    agent.start()
    wait_for(lambda: Node.objects.get(pk=node.pk).status == NodeStatus.ONLINE, 60, "online")
    wait_for(lambda: not managed_containers(docker_client, rental_id), 90, "orphan removal")


def test_a_revoked_node_token_is_refused_and_the_agent_stops(start_agent):
    agent = start_agent()
    node = _joined()
    wait_for(lambda: Node.objects.get(pk=node.pk).last_seen_at, 30, "a heartbeat")
    node_credential_revoke(node_id=node.pk, actor=None)
    code = agent.proc.wait(60)
    assert code != 0
    seen = Node.objects.get(pk=node.pk).last_seen_at
    assert "401" in agent.log() or "revoked" in agent.log()
    assert Node.objects.get(pk=node.pk).last_seen_at == seen


def test_usage_spooled_while_the_server_is_unreachable_replays_once(
    auth_api, celery_worker, start_agent, live_server, docker_client, tmp_path
):
    from billing.models import UsageSegment
    from tests.e2e.conftest import TcpProxy

    port = int(live_server.url.rsplit(":", 1)[1])
    proxy = TcpProxy(port)
    try:
        start_agent(via=proxy.port)
        _joined()
        rental_id = _rent(auth_api, harness_config=TRAIN_FOREVER)
        _wait_status(rental_id, RentalStatus.RUNNING)

        def segment():
            return UsageSegment.objects.filter(rental_id=rental_id).first()

        wait_for(lambda: segment() and segment().reports >= 2, 60, "usage reports")
        before = segment()
        proxy.cut()  # the server is unreachable; the container keeps training
        import time

        time.sleep(6)
        during = segment()
        assert during.confirmed_until == before.confirmed_until or (
            during.last_seq - before.last_seq <= 1  # one report may have been in flight
        )
        outage_end = time.time()
        proxy.up.set()
        # The spooled reports arrive: the segment reaches past the outage, in one row.
        wait_for(
            lambda: segment().confirmed_until.timestamp() >= outage_end - 1,
            60,
            "the spooled reports to be applied",
        )
        after = segment()
        assert UsageSegment.objects.filter(rental_id=rental_id).count() == 1
        assert after.started_at == before.started_at
        assert after.last_seq > during.last_seq
        # Every report the agent sent counted once: reports applied never exceed seqs issued.
        assert after.reports <= after.last_seq - after.first_seq + 1
        spool = tmp_path / "node1" / "state" / "spool" / "usage.jsonl"
        # Drained: at most the report of the heartbeat in flight is left.
        wait_for(
            lambda: len(spool.read_text().splitlines()) <= 2,
            30,
            "the spool to drain after the acknowledgement",
        )
        assert _status(rental_id) == RentalStatus.RUNNING
    finally:
        proxy.close()
