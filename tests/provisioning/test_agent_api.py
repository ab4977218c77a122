"""The agent API as the node agent speaks it: join, heartbeat, desired state, state changes."""

import json
import os
from datetime import timedelta
from decimal import Decimal

import pytest
import redis
from django.utils import timezone
from rest_framework.test import APIClient

from marketplace.models import Allocation, Node, NodeEvent, NodeStatus, Rental, RentalStatus
from provisioning.models import ContainerRun, NodeCredential, RunMetric
from provisioning.services import join_token_create, node_credential_revoke, nodes_mark_silent
from scheduler.services import scheduler_cycle_run
from tests.factories import personal_team

pytestmark = pytest.mark.django_db

HOST = {"cpu_cores": 32, "ram_gb": 256, "disk_gb": 2000, "driver_version": "550.54",
        "cuda_version": "12.4"}  # fmt: skip


def _gpus(n=4, name="NVIDIA A100-SXM4-80GB", memory_mb=81920):
    return [
        {"index": i, "uuid": f"GPU-test-{i}-{name[-4:]}", "name": name, "memory_mb": memory_mb,
         "topology_group": "nvl0"}
        for i in range(n)
    ]  # fmt: skip


@pytest.fixture
def agent(api, join_token):
    r = api.post(
        "/api/agent/v1/join/",
        {
            "join_token": join_token,
            "hostname": "gpu-host-1",
            "host": HOST,
            "internet_filtered": True,
            "gpus": _gpus(),
        },
        format="json",
    )
    assert r.status_code == 201, r.content
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {r.json()['node_token']}")
    client.node = Node.objects.get(pk=r.json()["node_id"])
    return client


def _beat(agent, **body):
    return agent.post("/api/agent/v1/heartbeat/", body, format="json")


def test_join_lists_the_node_with_catalog_gpus_and_stores_the_token_hashed(agent):
    node = agent.node
    assert (node.hostname, node.region, node.status, node.gpu_count) == (
        "gpu-host-1",
        "eu-west",
        NodeStatus.ONLINE,
        4,
    )
    assert node.gpu_model.slug == "a100-sxm4-80gb"
    assert node.price_per_gpu_hour == Decimal("1.2000") and node.nvlink
    cred = NodeCredential.objects.get(node=node)
    assert len(cred.key_hash) == 64
    assert node.benchmark_requested


@pytest.mark.parametrize(
    ("name", "memory_mb", "slug"),
    [
        ("NVIDIA H100 80GB HBM3", 81559, "h100-sxm5-80gb"),
        ("NVIDIA H100 PCIe", 81559, "h100-pcie-80gb"),
        ("NVIDIA GeForce RTX 4090", 24564, "rtx4090-24gb"),
        ("Tesla V100-SXM2-32GB", 32768, "v100-sxm2-32gb"),
        ("NVIDIA A100-PCIE-40GB", 40960, "a100-pcie-40gb"),
        ("rtx3090-24gb", 24576, "rtx3090-24gb"),
    ],
)
def test_nvml_names_match_catalog_cards(db, name, memory_mb, slug):
    from provisioning.services import catalog_match

    assert catalog_match(name, memory_mb).slug == slug


def test_a_used_join_token_is_refused_and_changes_nothing(api, agent, join_token):
    r = api.post(
        "/api/agent/v1/join/",
        {
            "join_token": join_token,
            "hostname": "gpu-host-2",
            "host": HOST,
            "internet_filtered": True,
            "gpus": _gpus(),
        },
        format="json",
    )
    assert r.status_code == 400 and "join_token" in r.json()
    assert Node.objects.count() == 1


def test_an_unknown_gpu_is_refused_and_the_token_stays_usable(api, join_token):
    r = api.post(
        "/api/agent/v1/join/",
        {"join_token": join_token, "hostname": "h", "host": HOST,
         "gpus": _gpus(name="Voodoo 5 6000", memory_mb=64)},
        format="json",
    )  # fmt: skip
    assert r.status_code == 400 and "gpus" in r.json()
    assert Node.objects.count() == 0
    ok = api.post(
        "/api/agent/v1/join/",
        {
            "join_token": join_token,
            "hostname": "h",
            "host": HOST,
            "internet_filtered": True,
            "gpus": _gpus(),
        },
        format="json",
    )
    assert ok.status_code == 201


@pytest.mark.parametrize("header", [None, "Bearer gpn_forged", "Bearer"])
def test_forged_or_missing_node_token_is_401_and_changes_nothing(agent, header):
    node = agent.node
    before = Node.objects.get(pk=node.pk).last_seen_at
    client = APIClient()
    if header:
        client.credentials(HTTP_AUTHORIZATION=header)
    r = client.post("/api/agent/v1/heartbeat/", {}, format="json")
    assert r.status_code == 401
    assert Node.objects.get(pk=node.pk).last_seen_at == before


def test_an_idle_heartbeat_is_one_statement_with_its_token_check(agent):
    """Telemetry only, nothing held: the token is checked, the node marked seen and its held
    GPUs read by one statement."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    sample = {"gpu_index": 0, "ts": 1.0, "util_pct": 5.0, "mem_used_mb": 1, "power_w": 1.0,
              "temp_c": 30.0}  # fmt: skip
    # The first heartbeat of a token this process has not seen checks the token on its own
    # before reading the body (authenticate before work)...
    with CaptureQueriesContext(connection) as queries:
        assert _beat(agent, telemetry=[sample]).status_code == 200
    assert len(queries) == 2 and "provisioning_nodecredential" in queries[0]["sql"]
    # ...and the ones after it are one statement.
    Node.objects.filter(pk=agent.node.pk).update(last_seen_at=None)
    with CaptureQueriesContext(connection) as queries:
        r = _beat(agent, telemetry=[sample])
    assert r.status_code == 200, r.content
    assert len(queries) == 1, [q["sql"] for q in queries]
    assert "provisioning_nodecredential" in queries[0]["sql"]
    assert r.json()["desired"] == [] and r.json()["run_benchmark"] is True  # asked at join
    assert Node.objects.get(pk=agent.node.pk).last_seen_at is not None


@pytest.mark.parametrize(
    ("body", "content_type"),
    [
        ("{", "application/json"),
        ('{"containers": "not a list"}', "application/json"),
        ("[" * 50_000, "application/json"),
        ("containers=1", "application/x-www-form-urlencoded"),
    ],
)
def test_a_bad_heartbeat_is_401_for_a_bad_token_and_400_for_a_good_one(agent, body, content_type):
    """The token is checked with the body: an unknown or revoked token is told only that, and
    nothing is applied either way."""
    seen = Node.objects.get(pk=agent.node.pk).last_seen_at
    good = agent._credentials["HTTP_AUTHORIZATION"]
    for header, want in [("Bearer gpn_forged", 401), (good, None)]:
        client = APIClient()
        client.credentials(HTTP_AUTHORIZATION=header)
        r = client.generic("POST", "/api/agent/v1/heartbeat/", body, content_type=content_type)
        if want == 401:
            assert r.status_code == 401 and r["WWW-Authenticate"] == "Bearer", r.content
        else:
            assert r.status_code in (400, 415), r.content
    node_credential_revoke(node_id=agent.node.pk, actor=None)
    r = agent.generic("POST", "/api/agent/v1/heartbeat/", body, content_type=content_type)
    assert r.status_code == 401
    assert Node.objects.get(pk=agent.node.pk).last_seen_at == seen


@pytest.mark.parametrize("method", ["OPTIONS", "GET", "PUT"])
def test_other_methods_on_the_heartbeat_need_a_valid_token_first(agent, method):
    forged = APIClient()
    forged.credentials(HTTP_AUTHORIZATION="Bearer gpn_forged")
    r = forged.generic(method, "/api/agent/v1/heartbeat/")
    assert r.status_code == 401, r.content
    assert "actions" not in r.content.decode()
    assert agent.generic(method, "/api/agent/v1/heartbeat/").status_code in (200, 405)


def test_the_node_read_at_each_agent_call_is_what_the_orm_reads(agent):
    """Every agent call reads its node by token in one hand-built statement: each field comes
    back as the ORM gives it, and a revoked or unknown token reads no node."""
    from provisioning.services.join import node_authenticate

    raw = agent._credentials["HTTP_AUTHORIZATION"].split()[1]
    read = node_authenticate(raw)
    want = Node.objects.get(pk=agent.node.pk)
    for field in Node._meta.concrete_fields:
        assert getattr(read, field.attname) == getattr(want, field.attname), field.name
    assert not read._state.adding
    assert node_authenticate(raw + "x") is None
    node_credential_revoke(node_id=agent.node.pk, actor=None)
    assert node_authenticate(raw) is None


def test_revoked_node_token_is_401(agent):
    assert _beat(agent).status_code == 200
    node_credential_revoke(node_id=agent.node.pk, actor=None)
    r = _beat(agent, containers=[])
    assert r.status_code == 401


def test_a_bad_element_is_dropped_and_counted_a_bad_heartbeat_is_400_naming_the_field(agent):
    r = _beat(agent, containers=[{"rental_id": "not-a-uuid", "run_id": "x", "status": "running"}])
    assert r.status_code == 200 and r.json()["dropped"] == {"containers": 1}
    seen = Node.objects.get(pk=agent.node.pk).last_seen_at
    r = _beat(agent, metrics=[{"rental_id": "x"}] * 501)
    assert r.status_code == 400 and "metrics" in r.json()
    assert Node.objects.get(pk=agent.node.pk).last_seen_at == seen


def test_what_one_heartbeat_dropped_or_sent_is_not_seen_by_the_next(agent):
    """Each thread validates with one reused serializer: nothing of a body stays in it."""
    bad_benchmark = {"matmul_tflops": -1}
    bad_sample = {"gpu_index": 0, "ts": 1.0, "util_pct": 500, "mem_used_mb": 1, "power_w": 1,
                  "temp_c": 1}  # fmt: skip
    r = _beat(agent, benchmark=bad_benchmark, telemetry=[bad_sample], logs=[{"x": 1}] * 2)
    assert r.json()["dropped"] == {"benchmark": 1, "telemetry": 1, "logs": 2}
    # The next heartbeat leaves those fields out: none of them is counted again.
    assert _beat(agent).json()["dropped"] == {}
    r = _beat(agent, containers="not a list")
    assert r.status_code == 400 and list(r.json()) == ["containers"]
    # A refused body leaves no error behind for a good one.
    r = _beat(agent, telemetry=[{**bad_sample, "util_pct": 50}])
    assert r.status_code == 200 and r.json()["dropped"] == {}


def _schedule(rent, gpus=2, **kwargs):
    rental = rent(gpus, **kwargs)
    scheduler_cycle_run()
    rental.refresh_from_db()
    assert rental.status == RentalStatus.SCHEDULED
    return rental


def _status(rental):
    rental.refresh_from_db()
    return rental.status


def test_a_run_goes_provisioning_running_stopping_completed(agent, rent):
    rental = _schedule(rent, 2)
    answer = _beat(agent).json()
    [desired] = answer["desired"]
    assert desired["rental_id"] == str(rental.pk)
    assert desired["gpu_indices"] == [0, 1]
    assert desired["memory_limit_mb"] >= 2048 and desired["cpu_limit"] == 16.0
    assert _status(rental) == RentalStatus.PROVISIONING
    run = {"rental_id": str(rental.pk), "run_id": desired["run_id"], "started_at": 1.0e9}
    line = json.dumps({"event": "step", "step": 1, "loss": 2.5})
    metric = {"rental_id": str(rental.pk), "run_id": desired["run_id"], "line": line}
    _beat(agent, containers=[{**run, "status": "running"}], metrics=[metric, metric])
    assert _status(rental) == RentalStatus.RUNNING
    _beat(agent, containers=[{**run, "status": "running"}], metrics=[metric])  # replay
    assert RunMetric.objects.filter(rental=rental).count() == 1
    assert RunMetric.objects.get(rental=rental).data["loss"] == 2.5
    owner = APIClient()
    owner.force_authenticate(rental.customer)
    shown = owner.get(f"/api/v1/rentals/{rental.pk}/metrics/", {"event": "step"}).json()
    assert [(m["step"], m["loss"]) for m in shown["results"]] == [(1, 2.5)]
    stranger = APIClient()
    stranger.force_authenticate(agent.node.provider.owner)
    assert stranger.get(f"/api/v1/rentals/{rental.pk}/metrics/").status_code == 404
    from marketplace.lifecycle import rental_stop

    rental_stop(team=personal_team(rental.customer), actor=rental.customer, rental_id=rental.pk)
    assert _beat(agent, containers=[{**run, "status": "running"}]).json()["desired"] == []
    _beat(agent, containers=[{**run, "status": "exited", "exit_code": 0, "finished_at": 1.0e9}])
    rental.refresh_from_db()
    assert (rental.status, rental.exit_code) == (RentalStatus.COMPLETED, 0)
    assert not Allocation.objects.filter(rental=rental, released_at__isnull=True).exists()
    assert list(rental.events.values_list("to_status", flat=True)) == [
        "pending", "scheduled", "provisioning", "running", "stopping", "completed",
    ]  # fmt: skip


def test_a_container_that_exits_non_zero_fails_the_rental_with_code_and_log(agent, rent):
    rental = _schedule(rent, 1)
    [desired] = _beat(agent).json()["desired"]
    run = {"rental_id": str(rental.pk), "run_id": desired["run_id"]}
    _beat(agent, containers=[{**run, "status": "running", "started_at": 1.0e9}])
    _beat(
        agent,
        containers=[{**run, "status": "exited", "exit_code": 3, "log_tail": "Traceback...\nBoom"}],
    )
    rental.refresh_from_db()
    assert (rental.status, rental.exit_code) == (RentalStatus.FAILED, 3)
    assert rental.log_tail.endswith("Boom")
    # The reason ends with the run's last line, as Kubernetes' FallbackToLogsOnError.
    assert rental.status_reason == "container exited with code 3: Boom"
    assert ContainerRun.objects.get(rental=rental).status == "exited"
    assert _beat(agent).json()["desired"] == []


@pytest.mark.parametrize(
    ("log_tail", "reason"),
    [
        ("", "container exited with code 1"),
        ("\n  \n\t\n", "container exited with code 1"),
        ("step 1\nRuntimeError: CUDA out of memory\n\n", "container exited with code 1: "
         "RuntimeError: CUDA out of memory"),
        # Bidirectional overrides are dropped (escape characters are already replaced in the
        # stored log), long lines cut.
        ("evil\u202egpj.exe\x1b[31m", "container exited with code 1: evilgpj.exe\ufffd[31m"),
        ("x" * 5000, "container exited with code 1: " + "x" * 299 + "…"),
    ],
)  # fmt: skip
def test_a_failed_run_s_reason_ends_with_its_last_log_line(agent, rent, log_tail, reason):
    rental = _schedule(rent, 1)
    [desired] = _beat(agent).json()["desired"]
    run = {"rental_id": str(rental.pk), "run_id": desired["run_id"]}
    _beat(agent, containers=[{**run, "status": "running", "started_at": 1.0e9}])
    _beat(agent, containers=[{**run, "status": "exited", "exit_code": 1, "log_tail": log_tail}])
    rental.refresh_from_db()
    assert (rental.status, rental.status_reason) == (RentalStatus.FAILED, reason)


def test_a_silent_node_goes_offline_and_its_rentals_follow_the_policy(agent, rent):
    running = _schedule(rent, 2)
    waiting = _schedule(rent, 2)
    answer = _beat(agent).json()
    started = next(d for d in answer["desired"] if d["rental_id"] == str(running.pk))
    _beat(agent, containers=[{"rental_id": str(running.pk), "run_id": started["run_id"],
                              "status": "running", "started_at": 1.0e9}])  # fmt: skip
    Rental.objects.filter(pk=waiting.pk).update(status=RentalStatus.SCHEDULED)
    from datetime import timedelta

    from django.utils import timezone

    Node.objects.filter(pk=agent.node.pk).update(last_seen_at=timezone.now() - timedelta(hours=1))
    assert nodes_mark_silent() == [agent.node.pk]
    agent.node.refresh_from_db()
    assert agent.node.status == NodeStatus.OFFLINE
    assert _status(running) == RentalStatus.FAILED
    assert _status(waiting) == RentalStatus.PENDING
    waiting.refresh_from_db()
    assert "went silent" in waiting.status_reason
    assert not Allocation.objects.filter(node=agent.node, released_at__isnull=True).exists()
    # The agent comes back: the node is online again.
    _beat(agent)
    agent.node.refresh_from_db()
    assert agent.node.status == NodeStatus.ONLINE


@pytest.fixture
def fleet_of(make_node, settings):
    """A wake server named, one idle heartbeat a second for the whole fleet: `n` listed nodes
    beside the agent's own, counted afresh."""
    from provisioning.services import heartbeat

    settings.GPUMARKET = {
        **settings.GPUMARKET, "WAKE_URL": "http://wake.invalid/wake/v1/",
        "IDLE_HEARTBEATS_PER_S": 1, "IDLE_HEARTBEAT_MAX_S": 30, "NODE_SILENCE_TIMEOUT_S": 60,
    }  # fmt: skip

    def grow(n):
        for _ in range(n):
            make_node(gpus=1)
        heartbeat._listed_nodes[:] = [0, 0, 0, float("-inf")]

    # A wake server listens on the channel (a real Redis subscriber standing in for it).
    listener = redis.Redis.from_url(os.environ["REDIS_URL"]).pubsub()
    listener.subscribe(settings.GPUMARKET["WAKE_CHANNEL"])
    listener.get_message(timeout=2)
    grow.listener = listener
    yield grow
    listener.close()
    heartbeat._listed_nodes[:] = [0, 0, 0, float("-inf")]


def test_an_idle_node_of_a_large_fleet_is_asked_to_heartbeat_less_often(agent, rent, fleet_of):
    fleet_of(19)  # 20 nodes listed at one idle heartbeat a second: every 20 s each
    assert _beat(agent).json()["heartbeat_interval_s"] == 20
    assert Node.objects.get(pk=agent.node.pk).heartbeat_interval_s == 20
    fleet_of(40)  # past the ceiling
    assert _beat(agent).json()["heartbeat_interval_s"] == 30
    # A node that holds GPUs reports at the base interval, and is lost after the base timeout.
    running = _schedule(rent, 2)
    assert _beat(agent).json()["heartbeat_interval_s"] == 1
    assert Node.objects.get(pk=agent.node.pk).heartbeat_interval_s == 0
    Rental.objects.filter(pk=running.pk).update(status=RentalStatus.CANCELLED)
    Allocation.objects.filter(rental=running).update(released_at=timezone.now())
    assert _beat(agent).json()["heartbeat_interval_s"] == 30


def test_a_busy_node_of_a_large_busy_fleet_is_asked_to_heartbeat_less_often(
    agent, rent, fleet_of, make_node, settings
):
    # given two nodes holding GPUs (the agent's and another), one busy heartbeat a second
    settings.GPUMARKET = {
        **settings.GPUMARKET, "BUSY_HEARTBEATS_PER_S": 1, "BUSY_HEARTBEAT_MAX_S": 30
    }  # fmt: skip
    make_node(gpus=4)
    first, second = _schedule(rent, 4), _schedule(rent, 4)
    assert {
        Allocation.objects.filter(rental=r).values_list("node_id", flat=True).first()
        for r in (first, second)
    } >= {agent.node.pk}
    fleet_of(0)
    # when the agent's node heartbeats (the full path: it holds GPUs)
    answer = _beat(agent).json()
    # then it is asked for one every 2 s, and stored so: the sweep waits three of them
    assert answer["heartbeat_interval_s"] == 2
    assert answer["desired"]
    assert Node.objects.get(pk=agent.node.pk).heartbeat_interval_s == 2
    # and never past BUSY_HEARTBEAT_MAX_S: at the base interval again, stored as 0
    settings.GPUMARKET = {**settings.GPUMARKET, "BUSY_HEARTBEAT_MAX_S": 1}
    assert _beat(agent).json()["heartbeat_interval_s"] == 1
    assert Node.objects.get(pk=agent.node.pk).heartbeat_interval_s == 0


def test_a_node_that_joins_is_told_the_interval_the_idle_fleet_uses(api, fleet_of, make_join_token):
    # given 19 listed nodes at one idle heartbeat a second
    fleet_of(19)
    body = {"join_token": make_join_token(), "hostname": "gpu-host-2", "host": HOST,
            "gpus": _gpus()}  # fmt: skip
    r = api.post("/api/agent/v1/join/", body, format="json")
    assert r.status_code == 201, r.content
    # then the joined node (the 20th) is told the idle fleet's interval at once
    assert r.json()["heartbeat_interval_s"] == 20


def test_without_a_wake_server_every_node_heartbeats_at_the_base_interval(
    agent, fleet_of, settings
):
    settings.GPUMARKET = {**settings.GPUMARKET, "WAKE_URL": ""}
    fleet_of(50)
    assert _beat(agent).json()["heartbeat_interval_s"] == 1
    assert Node.objects.get(pk=agent.node.pk).heartbeat_interval_s == 0


def test_with_no_wake_server_listening_idle_nodes_keep_the_base_interval(agent, fleet_of):
    fleet_of.listener.unsubscribe()
    fleet_of.listener.get_message(timeout=2)
    fleet_of(50)  # configured, but nothing would wake them
    assert _beat(agent).json()["heartbeat_interval_s"] == 1
    assert Node.objects.get(pk=agent.node.pk).heartbeat_interval_s == 0


def test_a_node_is_lost_after_three_of_its_own_intervals(agent, fleet_of, make_node):
    fleet_of(39)  # 40 nodes: every 30 s (the ceiling), silent after 90 s
    _beat(agent)
    quiet = make_node(gpus=1)  # heard from at the base interval: silent after 60 s
    now = timezone.now()
    Node.objects.filter(pk__in=[agent.node.pk, quiet.pk]).update(last_seen_at=now)
    # The rest of the fleet was told the long interval too (nodes never heard from are lost).
    Node.objects.exclude(pk__in=[agent.node.pk, quiet.pk]).update(
        last_seen_at=now, heartbeat_interval_s=30
    )
    assert nodes_mark_silent(now=now + timedelta(seconds=59)) == []
    assert nodes_mark_silent(now=now + timedelta(seconds=61)) == [quiet.pk]
    assert nodes_mark_silent(now=now + timedelta(seconds=89)) == []
    lost = nodes_mark_silent(now=now + timedelta(seconds=91))
    assert len(lost) == 40 and agent.node.pk in lost and quiet.pk not in lost
    event = NodeEvent.objects.get(node=agent.node, to_status=NodeStatus.OFFLINE)
    assert event.reason == "no heartbeat for 90 s"
    assert Node.objects.get(pk=agent.node.pk).status == NodeStatus.OFFLINE


def test_one_silent_node_sweep_at_a_time(agent):
    from django.db import connections

    from core.locks import advisory_key

    Node.objects.filter(pk=agent.node.pk).update(last_seen_at=timezone.now() - timedelta(hours=1))
    # Another process's sweep holds the lock: this one leaves everything as it was.
    other = connections.create_connection("default")
    try:
        with other.cursor() as cursor:
            cursor.execute(
                "SELECT pg_advisory_lock(%s)", [advisory_key("provisioning:nodes_mark_silent")]
            )
        assert nodes_mark_silent() == []
        assert Node.objects.get(pk=agent.node.pk).status == NodeStatus.ONLINE
    finally:
        other.close()
    assert nodes_mark_silent() == [agent.node.pk]


def test_a_benchmark_result_is_recorded_and_shown_in_offers(agent, api):
    bench = {"event": "benchmark", "precision": "bf16", "device_name": "A100",
             "matmul_tflops": 250.0, "mem_bandwidth_gbs": 1500.0}  # fmt: skip
    assert _beat(agent).json()["run_benchmark"] is True
    assert _beat(agent, benchmark=bench).json()["run_benchmark"] is False
    [offer] = api.get("/api/v1/offers/").json()["results"]
    assert offer["measured_tflops"] == 250.0
    assert offer["price_per_measured_tflop_hour"] == "0.004800"


def test_a_running_rental_is_asked_to_stop_when_its_booked_time_ends(agent, rent):
    from datetime import timedelta

    from django.utils import timezone

    from provisioning.services import rentals_end_booked_time

    rental = _schedule(rent, 1)
    [desired] = _beat(agent).json()["desired"]
    run = {"rental_id": str(rental.pk), "run_id": desired["run_id"], "started_at": 1.0e9}
    _beat(agent, containers=[{**run, "status": "running"}])
    assert rentals_end_booked_time() == 0
    later = timezone.now() + timedelta(hours=2)
    assert rentals_end_booked_time(now=later) == 1
    rental.refresh_from_db()
    assert (rental.status, rental.status_reason) == (RentalStatus.STOPPING, "booked time ended")


def test_heartbeat_telemetry_is_buffered_then_stored_in_bulk(agent):
    from billing.models import TelemetryMinute, TelemetrySample
    from core.redis_clients import redis_clients
    from provisioning.services import TELEMETRY_BUFFER_KEY, telemetry_flush

    redis_clients().background().delete(TELEMETRY_BUFFER_KEY)
    samples = [
        {"gpu_index": g, "ts": 1.8e9 + t, "util_pct": 50.0 + g, "mem_used_mb": 1000,
         "power_w": 300.0, "temp_c": 60.0}
        for t in (0, 1) for g in (0, 1)
    ]  # fmt: skip
    assert _beat(agent, telemetry=samples[:2]).status_code == 200
    assert _beat(agent, telemetry=samples[2:]).status_code == 200
    assert TelemetrySample.objects.count() == 0  # not on the heartbeat's path
    assert telemetry_flush() == 4
    rows = TelemetrySample.objects.filter(node_id=agent.node.pk)
    assert sorted(rows.values_list("gpu_index", "util_pct")) == [
        (0, 50.0), (0, 50.0), (1, 51.0), (1, 51.0),
    ]  # fmt: skip
    assert TelemetryMinute.objects.filter(node=agent.node).count() == 2
    assert telemetry_flush() == 0


def _buffered() -> list[dict]:
    from core.redis_clients import redis_clients
    from provisioning.services import TELEMETRY_BUFFER_KEY

    raw = redis_clients().background().lrange(TELEMETRY_BUFFER_KEY, 0, -1)
    return [json.loads(entry) for entry in raw]


def _sample(ts: float, gpu: int = 0) -> dict:
    return {"gpu_index": gpu, "ts": ts, "util_pct": 10.0, "mem_used_mb": 1, "power_w": 1.0,
            "temp_c": 30.0}  # fmt: skip


def test_a_heartbeats_samples_reach_the_redis_buffer_from_the_process_outbox(agent):
    """The heartbeat makes no round trip for its samples: the outbox's thread pushes them."""
    import time

    from core.redis_clients import redis_clients
    from provisioning.services import TELEMETRY_BUFFER_KEY

    redis_clients().background().delete(TELEMETRY_BUFFER_KEY)
    for t in range(3):
        assert _beat(agent, telemetry=[_sample(1.8e9 + t)]).status_code == 200
    deadline = time.monotonic() + 10
    while len(_buffered()) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [(e["node"], e["samples"][0]["ts"]) for e in _buffered()] == [
        (agent.node.pk, 1.8e9 + t) for t in range(3)
    ]


def test_samples_wait_in_the_outbox_while_redis_is_down_and_go_in_order_when_it_is_back(
    agent, caplog, monkeypatch
):
    import socket

    from core.redis_clients import RedisClients, redis_clients, redis_clients_replaced
    from provisioning.services import TELEMETRY_BUFFER_KEY, telemetry_outbox_push
    from provisioning.services import telemetry as telemetry_module

    redis_clients().background().delete(TELEMETRY_BUFFER_KEY)
    monkeypatch.setattr(telemetry_module, "OUTBOX_MAX_ENTRIES", 4)
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # nothing listens there: every connection is refused
    with redis_clients_replaced(RedisClients(f"redis://127.0.0.1:{port}/0", hot_pause_s=0)):
        for t in range(6):
            assert _beat(agent, telemetry=[_sample(1.8e9 + t)]).status_code == 200
        assert telemetry_outbox_push() == 0  # refused, and kept
    telemetry_outbox_push()  # or the outbox's thread, whichever comes first
    # the newest 4, in order; the 2 oldest were dropped, and said so
    assert [e["samples"][0]["ts"] for e in _buffered()] == [1.8e9 + t for t in range(2, 6)]
    assert "2 heartbeats' samples dropped" in caplog.text
    assert telemetry_outbox_push() == 0


def test_a_forked_process_pushes_only_its_own_samples(agent):
    import os

    from core.redis_clients import redis_clients
    from provisioning.services import (
        TELEMETRY_BUFFER_KEY,
        telemetry_buffer,
        telemetry_outbox_discard,
        telemetry_outbox_push,
    )

    client = redis_clients().background()
    client.delete(TELEMETRY_BUFFER_KEY)
    telemetry_buffer(node_id=1, samples=[_sample(1.0)])
    pid = os.fork()
    if pid == 0:  # the child: the parent's entry is not its to push
        code = 1
        try:
            telemetry_buffer(node_id=2, samples=[_sample(2.0)])
            code = 0 if telemetry_outbox_push() == 1 else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    telemetry_outbox_push()  # the parent's own (unless its thread pushed it already)
    assert sorted(e["node"] for e in _buffered()) == [1, 2]  # each once
    telemetry_outbox_discard()


@pytest.fixture
def agent_rate(settings):
    from core.redis_clients import redis_clients

    # Node ids start again in every test database, and every test's agent joins from loopback:
    # counts of earlier tests and runs are not theirs.
    client = redis_clients().background()
    for counters in ("agent", "agent_unverified", "join"):
        for key in client.scan_iter(f"gpumarket:rate:{counters}:*"):
            client.delete(key)

    def set_rate(rate: str, scope: str = "agent") -> None:
        settings.REST_FRAMEWORK = {
            **settings.REST_FRAMEWORK,
            "DEFAULT_THROTTLE_RATES": {**settings.REST_FRAMEWORK["DEFAULT_THROTTLE_RATES"],
                                       scope: rate},
        }  # fmt: skip

    return set_rate


def test_a_node_over_its_rate_gets_429_with_retry_after_and_nothing_applied(
    agent, agent_rate, api, provider
):
    agent_rate("3/hour")
    for _ in range(3):
        assert _beat(agent).status_code == 200
    seen = Node.objects.get(pk=agent.node.pk).last_seen_at
    r = _beat(agent)
    assert r.status_code == 429
    # A sliding window: at most the window and the share one request weighs of the next
    assert 0 < int(r["Retry-After"]) <= 3600 * (1 + 1 / 3)
    assert Node.objects.get(pk=agent.node.pk).last_seen_at == seen  # the heartbeat was not applied
    # Another node has its own budget
    _, raw = join_token_create(
        provider=provider, created_by=provider.owner, region="eu-west",
        price_per_gpu_hour=Decimal("1.20"), min_bid_per_gpu_hour=Decimal("0.40"),
    )  # fmt: skip
    r = api.post(
        "/api/agent/v1/join/",
        {"join_token": raw, "hostname": "gpu-host-2", "host": HOST, "internet_filtered": True,
         "gpus": [{**g, "uuid": f"{g['uuid']}-2"} for g in _gpus()]},
        format="json",
    )  # fmt: skip
    assert r.status_code == 201, r.content
    other = APIClient()
    other.credentials(HTTP_AUTHORIZATION=f"Bearer {r.json()['node_token']}")
    assert _beat(other).status_code == 200


def test_a_nodes_agent_calls_share_one_budget(agent, agent_rate):
    """The heartbeat is counted before its token is checked, by token, as the node's other
    calls are: their requests count against the same rate."""
    agent_rate("3/hour")
    assert _beat(agent).status_code == 200
    rental = "00000000-0000-0000-0000-000000000000"
    for _ in range(2):  # refused by the view (no such run): counted all the same
        r = agent.post(f"/api/agent/v1/rentals/{rental}/artifacts/uploads/", {}, format="json")
        assert r.status_code == 400, r.content
    assert _beat(agent).status_code == 429


@pytest.fixture
def hung_redis():
    """A Redis address that accepts connections and never answers."""
    import socket

    from core.redis_clients import RedisClients, redis_clients_replaced

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    with redis_clients_replaced(RedisClients(f"redis://127.0.0.1:{listener.getsockname()[1]}/0")):
        yield
    listener.close()


def test_heartbeats_go_on_when_redis_hangs_and_redis_is_then_left_alone(
    agent, agent_rate, hung_redis
):
    from core.redis_clients import redis_clients

    agent_rate("1/hour")
    telemetry = [{"gpu_index": 0, "ts": 1.0, "util_pct": 5.0, "mem_used_mb": 1,
                  "power_w": 1.0, "temp_c": 30.0}]  # fmt: skip
    assert redis_clients().hot() is not None
    for _ in range(3):
        # over its rate of 1/hour, but let through: the limiter cannot count
        r = _beat(agent, telemetry=telemetry)
        assert r.status_code == 200, r.content
        # after the first timeout the heartbeat path does not ask Redis for a while
        assert redis_clients().hot() is None
    assert Node.objects.get(pk=agent.node.pk).status == NodeStatus.ONLINE


@pytest.mark.parametrize("rate", ["600", "600/fortnight", "x/min", "/min"])
def test_a_bad_rate_setting_is_refused(rate):
    from core.ratelimit import parse_rate

    with pytest.raises(ValueError, match="bad rate"):
        parse_rate(rate)


def test_a_bad_agent_rate_fails_the_start_up_check(settings, agent_rate):
    from django.core import checks

    agent_rate("lots")
    assert [e.id for e in checks.run_checks()] == ["marketplace.E001"]
    agent_rate("600/min")
    assert checks.run_checks() == []


def test_a_heartbeat_is_idle_only_with_nothing_but_telemetry_and_drop_counts():
    from dataclasses import fields

    from provisioning.services import HeartbeatReports

    sample = {"gpu_index": 0, "ts": 1.0}
    assert HeartbeatReports(telemetry=[sample], dropped={"logs": 2}).idle()
    for f in fields(HeartbeatReports):
        if f.name not in ("telemetry", "dropped"):
            assert not HeartbeatReports(**{f.name: [object()]}).idle(), f.name


def test_a_random_token_costs_one_lookup_and_counts_against_its_address(agent, agent_rate):
    """Authenticate before work: a heartbeat with a token nobody was given is refused after
    one token lookup, before its body is read or the heartbeat's statement runs; a new token
    per request gets a new per-token bucket but the same per-address one."""
    import secrets

    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    agent_rate("5/hour", "agent_unverified")
    assert _beat(agent).status_code == 200  # a real node, first seen: 1 of its address's 5
    forged = APIClient()
    bad_body = {"telemetry": "not a list", "containers": [{"rental_id": "x"}] * 1000}
    for _ in range(4):
        forged.credentials(HTTP_AUTHORIZATION=f"Bearer gpn_{secrets.token_urlsafe(32)}")
        with CaptureQueriesContext(connection) as queries:
            r = forged.post("/api/agent/v1/heartbeat/", bad_body, format="json")
        assert r.status_code == 401 and r.json() == {"detail": "invalid or revoked node token"}
        assert len(queries) == 1 and "LIMIT 1" in queries[0]["sql"]  # the token lookup alone
    # The address's bucket is spent, whatever token comes next
    forged.credentials(HTTP_AUTHORIZATION=f"Bearer gpn_{secrets.token_urlsafe(32)}")
    with CaptureQueriesContext(connection) as queries:
        r = forged.post("/api/agent/v1/heartbeat/", bad_body, format="json")
    assert r.status_code == 429 and int(r["Retry-After"]) > 0
    assert len(queries) == 0
    # A node whose token this process saw valid keeps heartbeating from the same address
    assert _beat(agent).status_code == 200
