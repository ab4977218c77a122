"""The running stack keeps itself going: periodic work runs under a real beat and worker, a
killed worker or agent comes back under the supervisor, a Redis restart loses no pending rental.

Each test runs the stack as `dev.py up` does (gunicorn, worker, beat, agent under
devstack.supervisor.Supervisor) on the test database and a Redis of its own.
"""

from __future__ import annotations

import itertools
import os
import re
import signal
import threading
import time
from datetime import timedelta
from decimal import Decimal

import pytest
import requests
from django.utils import timezone

from accounts.services import api_token_create
from billing.models import TelemetrySample
from marketplace.models import (
    Allocation,
    Node,
    NodeStatus,
    Rental,
    RentalEvent,
    RentalStatus,
)
from marketplace.services import GpuSpec, node_register
from marketplace.services.rentals import RentalRequest, RuntimeSpec, rental_create
from provisioning.models import ContainerRun
from provisioning.services import join_token_create
from tests.e2e.conftest import (
    HARNESS_IMAGE,
    credit_customer,
    managed_containers,
    remove_managed,
    wait_for,
)
from tests.e2e.stack import Stack, agent_command
from tests.factories import personal_team

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

PLACED = {RentalStatus.SCHEDULED, RentalStatus.PROVISIONING, RentalStatus.RUNNING}


@pytest.fixture(autouse=True)
def _funded_customer(user):
    """Credit from ops, so billing's pass does not stop the rentals for funds."""
    credit_customer(user)


@pytest.fixture
def token(user) -> str:
    return api_token_create(user=user, team=personal_team(user), name="control-plane")[1]


def _status(rental_id) -> str:
    return Rental.objects.values_list("status", flat=True).get(pk=rental_id)


def _node() -> Node:
    return wait_for(lambda: Node.objects.filter(hostname="cp-1").first(), 120, "the agent to join")


def _sleeper(user, *, duration_s: int = 3600, deadline: timedelta = timedelta(hours=1)) -> Rental:
    """A rental created by the service itself: its queued cycle goes to the suite's broker, not
    the stack's, so only the stack's own periodic work can place it (a lost message)."""
    now = timezone.now()
    return rental_create(
        customer=user,
        team=personal_team(user),
        request=RentalRequest(
            gpus_per_node=1,
            duration_s=duration_s,
            region="e2e",
            start_deadline=now + deadline,
            runtime=RuntimeSpec(image=HARNESS_IMAGE, command=["sleep", "3600"]),
        ),
    )


def test_every_periodic_task_runs_and_does_its_job(start_stack, user, provider):
    stack = start_stack(runtime="process", gpus=2)
    node = _node()
    # Given a node whose agent never heartbeats, a rental whose message was lost, one whose
    # start deadline passes before any GPU frees up, and one booked for 15 seconds.
    ghost = node_register(
        provider=provider, hostname="ghost-1", region="ghost", cpu_cores=8, ram_gb=64,
        disk_gb=500, price_per_gpu_hour=Decimal("1.00"), min_bid_per_gpu_hour=Decimal("0.5"),
        gpus=[GpuSpec(index=0, uuid="GPU-ghost-0", model_slug="rtx4090-24gb")],
        status=NodeStatus.ONLINE, simulated=True,
    )  # fmt: skip
    lost = _sleeper(user)
    short = _sleeper(user, duration_s=15)
    # Both GPUs are now taken (or about to be): this one can only wait, and its deadline is near.
    expiring = _sleeper(user, deadline=timedelta(seconds=3))

    # Then beat's scheduler tick places the rentals without any new create...
    wait_for(lambda: _status(lost.pk) in PLACED, 60, "the lost-message rental placed")
    wait_for(lambda: _status(short.pk) in PLACED, 60, "the short rental placed")
    # ...expires the one past its deadline...
    wait_for(lambda: _status(expiring.pk) == RentalStatus.EXPIRED, 60, "the rental EXPIRED")
    # ...takes the silent node offline...
    wait_for(
        lambda: Node.objects.get(pk=ghost.pk).status == NodeStatus.OFFLINE, 60, "ghost OFFLINE"
    )
    assert Node.objects.get(pk=node.pk).status == NodeStatus.ONLINE
    # ...ends the booked time as a completion, not a failure...
    wait_for(lambda: _status(short.pk) == RentalStatus.COMPLETED, 90, "booked end COMPLETED")
    reasons = list(RentalEvent.objects.filter(rental=short).values_list("reason", flat=True))
    assert "booked time ended" in reasons, reasons
    # ...and moves the agent's telemetry from the Redis buffer into PostgreSQL.
    wait_for(lambda: TelemetrySample.objects.filter(node_id=node.pk).exists(), 60, "telemetry rows")
    assert _status(lost.pk) in PLACED
    assert stack.messages == [], stack.messages  # nothing crashed
    beat = stack.log("beat")
    assert "Couldn't apply scheduled task" not in beat, beat[-3000:]


def _create(stack: Stack, token: str, n: int, pause: float = 0.0) -> list[str]:
    body = {
        "gpus_per_node": 1,
        "region": "e2e",
        "duration_s": 3600,
        "runtime": {"image": HARNESS_IMAGE, "command": ["sleep", "3600"]},
        # the host's engine runs without iptables: no filtered internet there
        "network": "internal",
    }
    headers = {"Authorization": f"Bearer {token}"}
    ids = []
    for _ in range(n):
        r = requests.post(f"{stack.url}/api/v1/rentals/", json=body, headers=headers, timeout=30)
        assert r.status_code == 201, r.text
        ids.append(r.json()["id"])
        time.sleep(pause)
    return ids


def test_killed_worker_and_agent_come_back_and_every_rental_runs_once(
    start_stack, token, docker_client
):
    stack = start_stack(runtime="docker", gpus=6)
    _node()
    created: list[str] = []
    burst = threading.Thread(target=lambda: created.extend(_create(stack, token, 6)))
    # When the worker's main process and the agent are SIGKILLed during a burst of creates
    burst.start()
    time.sleep(0.5)
    os.kill(stack.pid("worker"), signal.SIGKILL)
    os.kill(stack.pid("agent"), signal.SIGKILL)
    burst.join(120)
    assert len(created) == 6
    # Then the supervisor restarted both, and every rental runs in exactly one container.
    wait_for(lambda: stack.supervisor.children["worker"].restarts >= 1, 60, "worker restarted")
    wait_for(lambda: stack.supervisor.children["agent"].restarts >= 1, 60, "agent restarted")
    for rental_id in created:
        wait_for(lambda r=rental_id: _status(r) == RentalStatus.RUNNING, 180, f"{rental_id} runs")
    for rental_id in created:
        assert len(managed_containers(docker_client, rental_id)) == 1
        assert ContainerRun.objects.filter(rental_id=rental_id).count() == 1
    for rental_id in created:
        remove_managed(docker_client, rental_id)
    assert any("worker exited with code" in m for m in stack.messages), stack.messages
    assert any("agent exited with code" in m for m in stack.messages), stack.messages


def test_redis_restart_mid_burst_leaves_nothing_pending(start_stack, token):
    stack = start_stack(runtime="process", gpus=6)
    _node()
    created: list[str] = []
    # When Redis stops in the middle of a burst of creates and comes back a few seconds later
    burst = threading.Thread(target=lambda: created.extend(_create(stack, token, 6, pause=1.0)))
    burst.start()
    time.sleep(1.5)
    stack.stop_redis()
    time.sleep(3)
    stack.start_redis()
    burst.join(120)
    # Then every create was accepted, and every rental of the burst is placed and runs.
    assert len(created) == 6
    for rental_id in created:
        wait_for(lambda r=rental_id: _status(r) == RentalStatus.RUNNING, 180, f"{rental_id} runs")
    assert not Rental.objects.filter(status=RentalStatus.PENDING).exists()


POOLS = ("a", "b")
POOL_GPUS = 4
POOL_BURST = 7  # per pool: more than its GPUs, so some rentals must wait with a reason
# The reason rental_submit stores: no cycle has looked at the rental yet.
SUBMITTED = "waiting for the scheduler"
_CYCLE_LINE = re.compile(r"scheduler cycle pool=(\S+) began=([\d.]+) ended=([\d.]+)")


@pytest.fixture
def pooled_stack(stack_env, provider, tmp_path):
    """Two Celery workers, beat, web, and one agent per scheduler pool."""
    stack = Stack(
        env={**stack_env, "LOG_LEVEL": "INFO"}, tmp=tmp_path, join_token=None, agent=None,
        workers=2,
    )  # fmt: skip
    for pool in POOLS:
        _, join = join_token_create(
            provider=provider, created_by=provider.owner, region="e2e", pool=pool,
            price_per_gpu_hour=Decimal("0.60"), min_bid_per_gpu_hour=Decimal("0.20"),
        )  # fmt: skip
        command = agent_command(
            state=tmp_path / f"agent-{pool}", runtime="process", gpus=POOL_GPUS,
            hostname=f"pool-{pool}",
        )  # fmt: skip
        stack.agents[f"agent-{pool}"] = [*command, "--server", stack.url, "--join-token", join]
    try:
        yield stack.start()
    finally:
        stack.stop()


def _pooled(user, stack: Stack, pool: str) -> str:
    """A create in `pool`; its cycle request goes to the stack's broker (lost while Redis is
    down, as a web process's would be)."""
    rental = rental_create(
        customer=user,
        team=personal_team(user),
        request=RentalRequest(
            gpus_per_node=1, duration_s=3600, region="e2e", pool=pool,
            runtime=RuntimeSpec(image=HARNESS_IMAGE, command=["sleep", "3600"]),
        ),
    )  # fmt: skip
    stack.send_task("scheduler.cycle", pool)
    return str(rental.pk)


def _settled(ids: list[str]) -> bool:
    """Every rental placed, or pending with a reason a scheduler cycle gave."""
    rows = Rental.objects.filter(pk__in=ids).values_list("status", "status_reason")
    return all(
        status in PLACED or (status == RentalStatus.PENDING and reason != SUBMITTED)
        for status, reason in rows
    )


def test_two_workers_and_two_pools_place_a_burst_through_a_redis_restart_and_a_killed_worker(
    pooled_stack, user
):
    stack = pooled_stack
    wait_for(
        lambda: Node.objects.filter(pool__in=POOLS, status=NodeStatus.ONLINE).count() == 2,
        120, "both pools' agents to join",
    )  # fmt: skip
    created: list[tuple[str, str]] = []
    # When a burst of creates into both pools meets a Redis restart in its middle...
    for i in range(POOL_BURST):
        if i == POOL_BURST // 2:
            stack.stop_redis()
        for pool in POOLS:
            created.append((pool, _pooled(user, stack, pool)))
        if i == POOL_BURST // 2:
            time.sleep(2)
            stack.start_redis()
    # ...and the worker running a pool's cycle is SIGKILLed while it holds the pool's lock
    # (the rentals beyond the GPUs keep full cycles coming, beat's tick queues them).
    killed = wait_for(
        lambda: next(filter(None, (stack.kill_lock_holder(f"scheduler:{p}") for p in POOLS)), None),
        120, "a worker in the middle of a cycle", every=0.01,
    )  # fmt: skip
    wait_for(lambda: stack.supervisor.children[killed].restarts >= 1, 60, f"{killed} restarted")
    ids = [rental_id for _, rental_id in created]
    wait_for(lambda: _settled(ids), 180, "every rental placed or waiting with a reason")

    # Then no rental is lost: each pool's GPUs are all taken, one rental each, on that pool's
    # node, and the rest wait with the scheduler's reason.
    for pool in POOLS:
        mine = [rental_id for p, rental_id in created if p == pool]
        placed = Rental.objects.filter(pk__in=mine, status__in=PLACED)
        assert placed.count() == POOL_GPUS, pool
        assert Rental.objects.filter(pk__in=mine, status=RentalStatus.PENDING).count() == (
            POOL_BURST - POOL_GPUS
        )
        held = Allocation.objects.filter(rental__in=placed, released_at__isnull=True)
        assert held.count() == POOL_GPUS
        assert set(held.values_list("node__pool", flat=True)) == {pool}
        assert held.values("gpu").distinct().count() == POOL_GPUS
    # ...and no two cycles of one pool overlapped in time, across both workers' logs.
    cycles: dict[str, list[tuple[float, float]]] = {pool: [] for pool in POOLS}
    for name in stack.workers:
        lines = _CYCLE_LINE.findall(stack.log(name))
        # Both workers ran cycles: the killed one was in the middle of one (which it never got to
        # log), and it may have run no other before or after its restart.
        assert lines or name == killed, f"{name} ran no cycle"
        for pool, began, ended in lines:
            cycles[pool].append((float(began), float(ended)))
    for pool, spans in cycles.items():
        spans.sort()
        assert spans, pool
        for (_, ended), (began, _) in itertools.pairwise(spans):
            assert began >= ended, (pool, spans)
    assert any(f"{killed} exited with code" in m for m in stack.messages), stack.messages
