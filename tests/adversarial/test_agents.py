"""Hostile containers and hostile or broken agents against the real server.

A container prints whatever it likes; an agent sends whatever it likes. Neither takes a node
down, fails a heartbeat half-way or makes the server answer 5xx; node-reported numbers are
bounded before they reach prices. Each test names the attack it replays.
"""

from __future__ import annotations

import json
import sys
from decimal import Decimal

import pytest
from rest_framework.test import APIClient

from marketplace.models import Gpu, Node, Rental, RentalStatus
from marketplace.services.rentals import RentalRequest, RuntimeSpec, rental_create
from provisioning.models import ContainerRun, JoinToken, NodeBenchmark, NodeCredential, RunMetric
from provisioning.services import join_token_create
from scheduler.services import scheduler_cycle_run

# The live-agent fixtures of the end-to-end suite (a real `python -m nodeagent` process).
from tests.e2e.conftest import join_token, stack_env, start_agent, wait_for  # noqa: F401
from tests.factories import ProviderFactory, personal_team

# A root agent runs process-runtime commands as nobody, through the 0700 pytest directories.
from tests.nodeagent.conftest import agent_dirs_searchable  # noqa: F401

HOST = {"cpu_cores": 32, "ram_gb": 256, "disk_gb": 2000}
HEARTBEAT = "/api/agent/v1/heartbeat/"
JOIN = "/api/agent/v1/join/"

DEEP = '{"a": ' + "[" * 1100
BAD_METRIC_LINES = [
    DEEP,
    '{"a": ' + "[" * 100_000 + "]" * 100_000 + "}",
    '{"step": 3000000000}',
    '{"loss": NaN}',
    '{"loss": 1e999}',
    '{"event": "a\\u0000b"}',
    '{"event": "\\ud800"}',
    "[1, 2]",
]


def _gpus(n=4, tag="a"):
    return [
        {"index": i, "uuid": f"GPU-adv-{tag}-{i}", "name": "NVIDIA A100-SXM4-80GB",
         "memory_mb": 81920, "topology_group": "nvl0"}
        for i in range(n)
    ]  # fmt: skip


def _token(provider) -> str:
    _, raw = join_token_create(
        provider=provider, created_by=provider.owner, region="eu-west",
        price_per_gpu_hour=Decimal("1.20"), min_bid_per_gpu_hour=Decimal("0.40"),
    )  # fmt: skip
    return raw


def _join(provider, *, gpus=None, hostname="adv-1", host=HOST):
    return APIClient().post(
        JOIN,
        {"join_token": _token(provider), "hostname": hostname, "host": host,
         "internet_filtered": True, "gpus": gpus or _gpus()},
        format="json",
    )  # fmt: skip


def _client(token: str) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {token}")
    return client


@pytest.fixture
def agent(provider):
    r = _join(provider)
    assert r.status_code == 201, r.content
    client = _client(r.json()["node_token"])
    client.node = Node.objects.get(pk=r.json()["node_id"])
    return client


def _beat(agent, **body):
    return agent.post(HEARTBEAT, body, format="json")


def _running(agent, rent, gpus=1):
    """A rental scheduled on the agent's node, reported running; its run entry."""
    rental = rent(gpus)
    scheduler_cycle_run()
    desired = _beat(agent).json()["desired"]
    [entry] = [d for d in desired if d["rental_id"] == str(rental.pk)]
    run = {"rental_id": str(rental.pk), "run_id": entry["run_id"], "started_at": 1.8e9}
    assert _beat(agent, containers=[{**run, "status": "running"}]).status_code == 200
    rental.refresh_from_db()
    assert rental.status == RentalStatus.RUNNING
    return rental, run


# -- the heartbeat: each element on its own ----------------------------------------------------


@pytest.mark.django_db
def test_every_malformed_element_kind_is_dropped_and_counted_and_the_rest_applied(agent, rent):
    rental, run = _running(agent, rent)
    waiting = rent(1)
    scheduler_cycle_run()  # SCHEDULED on this node: the answer must hand it over
    good_line = json.dumps({"event": "step", "step": 7, "loss": 2.5})
    sample = {"gpu_index": 0, "ts": 1.8e9, "util_pct": 50.0, "mem_used_mb": 1,
              "power_w": 1.0, "temp_c": 40.0}  # fmt: skip
    metric = {"rental_id": run["rental_id"], "run_id": run["run_id"]}
    r = _beat(
        agent,
        containers=[
            {**run, "status": "running"},
            {**run, "rental_id": "not-a-uuid", "status": "running"},
            {**run, "status": "exited", "exit_code": 3_000_000_000},
            {**run, "status": "running", "started_at": 1e300},
            "not an object",
        ],
        usage=[{**run, "seq": 0, "gpu_count": 1, "started_at": 1.0, "confirmed_at": 2.0}],
        telemetry=[sample, {**sample, "ts": 1e300}, {**sample, "mem_used_mb": 3_000_000_000}],
        metrics=[
            {**metric, "line": good_line},
            *({**metric, "line": line} for line in BAD_METRIC_LINES),
            {**metric, "line": "x" * 5000},
        ],
        benchmark={"matmul_tflops": "fast", "mem_bandwidth_gbs": "lots"},
    )
    assert r.status_code == 200, r.content
    answer = r.json()
    # Metric lines are refused at the edge (too long) or by the service (the rest): one count.
    assert answer["dropped"] == {
        "benchmark": 1,
        "containers": 4,
        "metrics": len(BAD_METRIC_LINES) + 1,
        "telemetry": 2,
        "usage": 1,
    }
    # The good elements were applied, and the desired state came back with the waiting rental.
    assert [m.data for m in RunMetric.objects.filter(rental=rental)] == [json.loads(good_line)]
    rental.refresh_from_db()
    assert rental.status == RentalStatus.RUNNING
    assert str(waiting.pk) in {d["rental_id"] for d in answer["desired"]}
    waiting.refresh_from_db()
    assert waiting.status == RentalStatus.PROVISIONING
    assert NodeBenchmark.objects.count() == 0


@pytest.mark.django_db
def test_a_nul_in_an_exited_containers_log_tail_ends_its_rental_with_the_tail_cleaned(agent, rent):
    rental, run = _running(agent, rent)
    r = _beat(
        agent,
        containers=[{**run, "status": "exited", "exit_code": 3, "log_tail": "boom\x00\x1b[0m\n"}],
    )
    assert r.status_code == 200 and r.json()["dropped"] == {}
    rental.refresh_from_db()
    assert (rental.status, rental.exit_code) == (RentalStatus.FAILED, 3)
    assert ContainerRun.objects.get(rental=rental).log_tail == "boom\ufffd\ufffd[0m\n"


@pytest.mark.django_db
@pytest.mark.parametrize(
    "body",
    [
        b"[]",
        b'"heartbeat"',
        b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        b'{"containers": ' + b"[" * 1100,
        b'{"agent_version": "a\\u0000b"}',
        b'{"agent_version": "a\x00b"}',
        b'{"sent_at": NaN}',
        b'{"agent_version": "\xff\xfe"}',
        b'{"containers": {"not": "a list"}}',
        b'{"metrics": ' + json.dumps([{"line": "{}"}] * 501).encode() + b"}",
        b'{"sent_at": 1e300}',
    ],
    ids=lambda body: body[:24].decode(errors="replace"),
)
def test_a_malformed_heartbeat_is_one_400_and_nothing_is_written(agent, rent, body):
    rental = rent(1)
    scheduler_cycle_run()
    seen = Node.objects.get(pk=agent.node.pk).last_seen_at
    r = agent.generic("POST", HEARTBEAT, body, content_type="application/json")
    assert r.status_code == 400, r.content
    assert Node.objects.get(pk=agent.node.pk).last_seen_at == seen
    rental.refresh_from_db()
    assert rental.status == RentalStatus.SCHEDULED
    assert not ContainerRun.objects.exists()


# -- node-reported numbers ---------------------------------------------------------------------


@pytest.mark.django_db
@pytest.mark.parametrize("tflops", [1e-20, 1e9, 0.5])
def test_an_implausible_benchmark_is_kept_flagged_and_never_priced(agent, tflops):
    bench = {"event": "benchmark", "precision": "bf16", "matmul_tflops": tflops}
    r = _beat(agent, benchmark=bench)
    assert r.status_code == 200 and r.json()["run_benchmark"] is False
    stored = NodeBenchmark.objects.get(node=agent.node)
    assert (stored.matmul_tflops, stored.plausible) == (tflops, False)
    assert Node.objects.get(pk=agent.node.pk).measured_tflops is None
    api = APIClient()
    offers = api.get("/api/v1/offers/")
    assert offers.status_code == 200
    [offer] = offers.json()["results"]
    assert (offer["measured_tflops"], offer["price_per_measured_tflop_hour"]) == (None, None)
    advice = api.post("/api/v1/advisor/", {"params_b": 0.5, "tokens_b": 1}, format="json")
    assert advice.status_code == 200 and advice.json()["plans"]


@pytest.mark.django_db
@pytest.mark.parametrize("tflops", [1e-20, 0.0, 1e9])
def test_offers_and_advisor_never_divide_by_an_absurd_stored_rate(agent, tflops):
    """A rate stored before the bounds existed (or written around them) is not used either."""
    Node.objects.filter(pk=agent.node.pk).update(measured_tflops=tflops)
    api = APIClient()
    offers = api.get("/api/v1/offers/", {"ordering": "price_per_tflop"})
    assert offers.status_code == 200
    assert offers.json()["results"][0]["price_per_measured_tflop_hour"] is None
    advice = api.post("/api/v1/advisor/", {"params_b": 0.5, "tokens_b": 1}, format="json")
    assert advice.status_code == 200 and advice.json()["plans"]


@pytest.mark.django_db
def test_a_plausible_benchmark_is_priced(agent):
    r = _beat(agent, benchmark={"precision": "bf16", "matmul_tflops": 250.0})
    assert r.status_code == 200
    assert NodeBenchmark.objects.get(node=agent.node).plausible is True
    [offer] = APIClient().get("/api/v1/offers/").json()["results"]
    assert offer["measured_tflops"] == 250.0


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("field", "host", "gpus"),
    [
        ("cpu_cores", {**HOST, "cpu_cores": 1_000_000}, None),
        ("ram_gb", {**HOST, "ram_gb": 10**9}, None),
        ("disk_gb", {**HOST, "disk_gb": 0}, None),
        ("memory_mb", HOST, [{**g, "memory_mb": 10**12} for g in _gpus()]),
        ("gpus", HOST, _gpus(65)),
        ("gpus", HOST, [{**g, "uuid": "GPU-same"} for g in _gpus()]),
    ],
)
def test_join_bounds_what_a_host_reports_with_a_400_naming_the_field(provider, field, host, gpus):
    r = _join(provider, host=host, gpus=gpus)
    assert r.status_code == 400 and field in json.dumps(r.json()), r.content
    assert not Node.objects.exists()


# -- rejoin ------------------------------------------------------------------------------------


@pytest.mark.django_db
def test_a_host_that_lost_its_token_rejoins_its_node(agent, provider, rent):
    rental, _ = _running(agent, rent)
    _beat(agent, benchmark={"precision": "bf16", "matmul_tflops": 250.0})
    node = agent.node
    gpus = [{**g, "index": 3 - g["index"]} for g in _gpus()]  # renumbered by a reboot
    r = _join(provider, gpus=gpus, host={**HOST, "ram_gb": 512})
    assert r.status_code == 201, r.content
    assert r.json()["node_id"] == node.pk
    assert _beat(agent).status_code == 401  # the lost token is revoked
    again = _client(r.json()["node_token"])
    assert _beat(again).status_code == 200
    assert Node.objects.count() == 1 and Gpu.objects.count() == 4
    assert dict(Gpu.objects.values_list("uuid", "index")) == {g["uuid"]: g["index"] for g in gpus}
    node.refresh_from_db()
    assert (node.ram_gb, node.benchmark_requested, node.measured_tflops) == (512, True, 250.0)
    assert NodeBenchmark.objects.filter(node=node).count() == 1  # history kept
    assert NodeCredential.objects.filter(node=node, revoked_at__isnull=True).count() == 1
    assert JoinToken.objects.filter(node=node).count() == 2
    rental.refresh_from_db()
    assert rental.status == RentalStatus.RUNNING


@pytest.mark.django_db
def test_another_provider_presenting_the_gpus_is_refused_and_nothing_changes(agent):
    other = ProviderFactory()
    r = _join(other)
    assert r.status_code == 409 and "gpus" in json.dumps(r.json()), r.content
    assert _beat(agent).status_code == 200  # the node's token still works
    assert set(Node.objects.values_list("provider_id", flat=True)) == {agent.node.provider_id}
    assert not JoinToken.objects.filter(provider=other, used_at__isnull=False).exists()


@pytest.mark.django_db
def test_part_of_a_node_or_a_taken_hostname_is_a_409_not_a_500(agent, provider):
    r = _join(provider, gpus=_gpus(2))
    assert r.status_code == 409 and "gpus" in json.dumps(r.json())
    r = _join(provider, gpus=_gpus(tag="b"))  # new GPUs, the listed node's hostname
    assert r.status_code == 409 and "hostname" in json.dumps(r.json())
    assert Node.objects.count() == 1


# -- a real agent and a hostile container --------------------------------------------------------

HOSTILE_PROGRAM = r"""
import sys, time
out = sys.stdout.buffer
for line in [
    b'{"a":' + b'[' * 1100,
    b'{"a": ' + b'[' * 100000 + b']' * 100000 + b'}',
    b'{"step": 3000000000}',
    b'{"loss": NaN}',
    b'{"event": "\x00"}',
    b'{"event": "a\\u0000b"}',
    b'{' + b'x' * 1000000,
    b'\xff\xfe{"step": 1}',
    b'{"event": "\xff"}',
    b'{"event": "step", "step": 1, "loss": 2.5}',
]:
    out.write(line + b'\n')
out.flush()
time.sleep(3600)
"""


@pytest.mark.e2e
@pytest.mark.django_db(transaction=True)
def test_a_container_printing_hostile_output_does_not_take_the_node_down(start_agent, user):  # noqa: F811
    agent = start_agent(runtime="process")
    node = wait_for(lambda: Node.objects.first(), 90, "the agent to join")

    def rent(command):
        return rental_create(
            customer=user,
            team=personal_team(user),
            request=RentalRequest(
                gpus_per_node=1, duration_s=3600,
                runtime=RuntimeSpec(image="gpumarket/harness:dev", command=command),
            ),
        )  # fmt: skip

    hostile = rent([sys.executable, "-c", HOSTILE_PROGRAM])
    neighbour = rent([sys.executable, "-c", "import time; time.sleep(3600)"])
    scheduler_cycle_run()

    def status(rental):
        return Rental.objects.values_list("status", flat=True).get(pk=rental.pk)

    for rental in (hostile, neighbour):
        wait_for(lambda r=rental: status(r) == RentalStatus.RUNNING, 90, "both rentals RUNNING")
    wait_for(lambda: RunMetric.objects.filter(rental=hostile).exists(), 60, "the good metric")
    seen = Node.objects.get(pk=node.pk).last_seen_at
    wait_for(lambda: Node.objects.get(pk=node.pk).last_seen_at > seen, 30, "later heartbeats")
    assert agent.proc.poll() is None, agent.log()
    assert "output lines refused as metrics" in agent.log()
    assert [m.data for m in RunMetric.objects.filter(rental=hostile).order_by("id")] == [
        {"event": "\ufffd"},
        {"event": "step", "step": 1, "loss": 2.5},
    ]
    assert (status(hostile), status(neighbour)) == (RentalStatus.RUNNING, RentalStatus.RUNNING)
