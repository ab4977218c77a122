"""Agents hear of work at once: the live server, the real wake server on the suite's Redis and
a real agent (local-process runtime). With heartbeats every two minutes, a placement still
reaches the agent and runs within seconds, and a stop reaches it as fast; with the wake server
gone, the agent works on at its heartbeat interval as it did before there was one."""

from __future__ import annotations

import pytest

from marketplace import lifecycle
from marketplace.models import Node, NodeStatus, Rental, RentalStatus
from marketplace.services.rentals import RuntimeSpec
from nodeagent.runtime.process import LocalProcessDriver, ProcessDriverConfig
from scheduler.services import scheduler_cycle_run
from tests.e2e.conftest import HARNESS_IMAGE, credit_customer, wait_for
from tests.factories import personal_team
from tests.provisioning.wake import WakeServer

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

SLOW_INTERVAL_S = 120  # the agents' heartbeat: a placement waits up to this without a wake-up
SLEEP = RuntimeSpec(image=HARNESS_IMAGE, command=["python", "-c", "import time; time.sleep(600)"])


@pytest.fixture
def wake_server(tmp_path, stack_env):
    server = WakeServer(log=tmp_path / "wake.log", env=stack_env).start()
    yield server
    server.stop()


def _interval(settings, seconds: int, **more) -> None:
    settings.GPUMARKET = {**settings.GPUMARKET, "HEARTBEAT_INTERVAL_S": seconds, **more}


def _agent_online(start_agent, user) -> Node:
    credit_customer(user)
    start_agent(runtime="process")
    return wait_for(
        lambda: Node.objects.filter(region="e2e", status=NodeStatus.ONLINE).first(),
        120,
        "the agent to join",
    )


def _heartbeats_slowed(settings, node: Node) -> None:
    """From here on the agent heartbeats every SLOW_INTERVAL_S (its next answer says so)."""
    _interval(settings, SLOW_INTERVAL_S)
    seen = Node.objects.get(pk=node.pk).last_seen_at
    wait_for(lambda: Node.objects.get(pk=node.pk).last_seen_at != seen, 30, "a heartbeat")


def _place(rent) -> Rental:
    rental = rent(1, region="e2e", runtime=SLEEP)
    scheduler_cycle_run()
    rental.refresh_from_db()
    assert rental.status == RentalStatus.SCHEDULED
    return rental


def _status(rental: Rental) -> str:
    rental.refresh_from_db()
    return rental.status


def test_a_placement_and_a_stop_reach_the_agent_long_before_its_next_heartbeat(
    settings, wake_server, start_agent, rent, user, tmp_path
):
    _interval(settings, 2, WAKE_URL=wake_server.url, WAKE_CHANNEL=wake_server.channel)
    node = _agent_online(start_agent, user)
    wait_for(lambda: wake_server.health()["waiting"] == 1, 30, "the agent's poll")
    _heartbeats_slowed(settings, node)
    # When a rental is placed on the node, the agent hears of it at once: it runs well before
    # the next heartbeat, SLOW_INTERVAL_S away.
    woken = wake_server.health()["woken"]
    rental = _place(rent)
    wait_for(lambda: _status(rental) == RentalStatus.RUNNING, SLOW_INTERVAL_S / 3, "RUNNING")
    assert wake_server.health()["woken"] > woken
    # A stop reaches it as fast: the run's process ends.
    lifecycle.rental_stop(team=personal_team(user), actor=user, rental_id=rental.pk)
    driver = LocalProcessDriver(
        ProcessDriverConfig(state_dir=str(tmp_path / "node1" / "runs"), node_id=str(node.pk))
    )
    wait_for(
        lambda: all(s.status != "running" for s in driver.list_managed()),
        SLOW_INTERVAL_S / 3,
        "the run to stop",
    )


def test_the_agent_works_on_when_the_wake_server_is_gone(
    settings, wake_server, start_agent, rent, user
):
    _interval(settings, 2, WAKE_URL=wake_server.url, WAKE_CHANNEL=wake_server.channel)
    node = _agent_online(start_agent, user)
    wait_for(lambda: wake_server.health()["waiting"] == 1, 30, "the agent's poll")
    wake_server.stop()
    seen = Node.objects.get(pk=node.pk).last_seen_at
    wait_for(lambda: Node.objects.get(pk=node.pk).last_seen_at != seen, 30, "a heartbeat")
    rental = _place(rent)
    wait_for(lambda: _status(rental) == RentalStatus.RUNNING, 60, "RUNNING by heartbeats alone")
    assert Node.objects.get(pk=node.pk).status == NodeStatus.ONLINE
