"""GPU health end to end: NVML (faked at the pynvml boundary) -> the agent's telemetry source
and protocol -> the heartbeat API -> placement, the rental lifecycle, the provider's page.

The agent's side here is the real NvmlSource and the real GpuSample payloads; the server's is
the real heartbeat endpoint, scheduler and lifecycle on PostgreSQL."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.test import Client
from django.utils import timezone
from rest_framework.test import APIClient

from core.metrics import BENCHMARKS_UNASKED
from marketplace.models import (
    Allocation,
    Gpu,
    GpuHealth,
    GpuHealthEvent,
    Node,
    Rental,
    RentalKind,
    RentalStatus,
)
from nodeagent.telemetry.nvml import NvmlSource
from notifications.models import Notification
from provisioning.models import ContainerRun, NodeBenchmark
from provisioning.services import nodes_benchmark_schedule, nodes_reliability_update
from provisioning.services.health import sample_verdict
from scheduler.services import scheduler_cycle_run
from tests.nodeagent.telemetry.fake_nvml import FakeNvml
from tests.provisioning.test_gangs import _beat, _gang, _join, _report, _run

pytestmark = pytest.mark.django_db

HOST = {"cpu_cores": 32, "ram_gb": 256, "disk_gb": 2000, "driver_version": "550.54.15",
        "cuda_version": "12.4"}  # fmt: skip
BENCH = {"event": "benchmark", "precision": "bf16", "device_name": "H100",
         "matmul_tflops": 700.0}  # fmt: skip


class Host:
    """One GPU host as its agent sees it: the fake NVML, the agent's NVML source, and the
    node's API client."""

    def __init__(self, monkeypatch, api, join_token) -> None:
        self.monkeypatch = monkeypatch
        self.nvml = FakeNvml(gpus=4).install(monkeypatch)
        self.source = NvmlSource()
        gpus = [g.to_payload() for g in self.source.discover().gpus]
        body = {
            "join_token": join_token,
            "hostname": "gpu-host-7",
            "host": HOST,
            "internet_filtered": True,
            "gpus": gpus,
        }
        r = api.post("/api/agent/v1/join/", body, format="json")
        assert r.status_code == 201, r.content
        self.client = APIClient()
        self.client.credentials(HTTP_AUTHORIZATION=f"Bearer {r.json()['node_token']}")
        self.node = Node.objects.get(pk=r.json()["node_id"])
        self.running: dict[str, dict] = {}  # rental id -> its container report

    def beat(self, *, telemetry: bool = True, **body) -> dict:
        """One heartbeat: the GPUs' samples as the agent sends them, the runs it has."""
        if telemetry:
            body["telemetry"] = [s.to_payload() for s in self.source.sample()]
        body.setdefault("containers", list(self.running.values()))
        r = self.client.post("/api/agent/v1/heartbeat/", body, format="json")
        assert r.status_code == 200, r.content
        answer = r.json()
        for entry in answer["desired"]:  # what the server wants runs
            self.running[entry["rental_id"]] = {
                "rental_id": entry["rental_id"], "run_id": entry["run_id"],
                "status": "running", "started_at": 1.0e9,
            }  # fmt: skip
        for rental_id in set(self.running) - {e["rental_id"] for e in answer["desired"]}:
            del self.running[rental_id]  # what it no longer wants stops
        return answer

    def restart_agent(self) -> None:
        """The host was repaired (GPU reset) and its agent started again: counters start over."""
        self.source.close()
        self.nvml.events.clear()
        self.source = NvmlSource()

    def gpu(self, index: int) -> Gpu:
        return Gpu.objects.get(node=self.node, index=index)


@pytest.fixture
def host(monkeypatch, api, join_token) -> Host:
    host = Host(monkeypatch, api, join_token)
    answer = host.beat()
    assert answer["run_benchmark"] is True  # asked at join, on every GPU
    assert answer["benchmark"]["gpu_indices"] == []
    assert answer["benchmark"]["command"] == ["python", "-m", "harness", "benchmark", "--quick"]
    assert host.beat(benchmark=BENCH)["run_benchmark"] is False
    return host


def _held(rental: Rental) -> list[int]:
    return sorted(
        Allocation.objects.filter(rental=rental, released_at__isnull=True).values_list(
            "gpu__index", flat=True
        )
    )


def _placed(rent, gpus: int, **kwargs) -> Rental:
    rental = rent(gpus, **kwargs)
    scheduler_cycle_run()
    rental.refresh_from_db()
    return rental


def _running_on_each_gpu(host: Host, rent, *, on_gpu_2: str) -> tuple[Rental, Rental, Rental]:
    """Rentals on GPUs 0-1, 2 and 3, all RUNNING; the one on GPU 2 is of kind `on_gpu_2`."""
    pair = _placed(rent, 2)
    assert _held(pair) == [0, 1]
    kwargs = {"bid_per_gpu_hour": "0.50"} if on_gpu_2 == RentalKind.INTERRUPTIBLE else {}
    middle = _placed(rent, 1, kind=on_gpu_2, **kwargs)
    assert _held(middle) == [2]
    last = _placed(rent, 1)
    assert _held(last) == [3]
    host.beat()  # handed over
    host.beat()  # reported running
    for rental in (pair, middle, last):
        rental.refresh_from_db()
        assert rental.status == RentalStatus.RUNNING
    return pair, middle, last


def test_an_xid_79_on_gpu_2_takes_it_out_at_once_requeues_its_rental_and_others_serve(host, rent):
    # given an interruptible rental on GPU 2 and on-demand ones on GPUs 0-1 and 3, all running
    pair, victim, last = _running_on_each_gpu(host, rent, on_gpu_2=RentalKind.INTERRUPTIBLE)
    # when the driver reports Xid 79 on GPU 2 and the agent's next heartbeat carries it
    host.nvml.xid(2, 79)
    answer = host.beat()
    # then GPU 2 is FAILED within that heartbeat, with its reason and a history row
    gpu = host.gpu(2)
    assert (gpu.health, gpu.health_reason) == (GpuHealth.FAILED, "Xid 79")
    [event] = GpuHealthEvent.objects.filter(gpu=gpu)
    assert (event.from_health, event.to_health, event.reason) == ("ok", "failed", "Xid 79")
    assert {g.index: g.health for g in Gpu.objects.filter(node=host.node)} == {
        0: "ok", 1: "ok", 2: "failed", 3: "ok"
    }  # fmt: skip
    # the rental on it is re-queued as the node's fault, its GPU freed and its run forgotten
    victim.refresh_from_db()
    assert victim.status == RentalStatus.PENDING
    assert victim.status_reason == "node gpu-host-7 GPU 2 failed: Xid 79; re-queued"
    assert _held(victim) == [] and not ContainerRun.objects.filter(rental=victim).exists()
    # the agent is told to stop it, and to run the platform's check on GPU 2
    assert sorted(e["rental_id"] for e in answer["desired"]) == sorted([str(pair.pk), str(last.pk)])
    assert answer["run_benchmark"] is True and answer["benchmark"]["gpu_indices"] == [2]
    # the node's other GPUs keep serving
    for rental in (pair, last):
        rental.refresh_from_db()
        assert rental.status == RentalStatus.RUNNING
    # the provider is told
    [told] = Notification.objects.filter(kind="node.gpu_failed")
    assert told.team.personal_of == host.node.provider.owner
    assert told.payload["node"] == {"id": host.node.pk, "hostname": "gpu-host-7", "gpu": 2,
                                    "reason": "Xid 79"}  # fmt: skip
    # and GPU 2 gets no new rental: the re-queued one and a new one wait, though GPU 2 is free
    newcomer = _placed(rent, 1)
    victim.refresh_from_db()
    assert (victim.status, newcomer.status) == (RentalStatus.PENDING, RentalStatus.PENDING)
    # until a healthy GPU frees up: the re-queued rental (oldest) resumes on GPU 3
    del host.running[str(last.pk)]
    host.beat(containers=[{"rental_id": str(last.pk), "run_id": _run_id(last), "status": "exited",
                           "exit_code": 0, "finished_at": 1.0e9}])  # fmt: skip
    scheduler_cycle_run()
    victim.refresh_from_db()
    assert victim.status == RentalStatus.SCHEDULED and _held(victim) == [3]


def _run_id(rental: Rental) -> str:
    return ContainerRun.objects.filter(rental=rental).values_list("run_id", flat=True).get()


def test_an_on_demand_rental_on_a_failed_gpu_fails_as_a_node_fault(host, rent):
    # given a started on-demand rental on GPU 2
    pair, victim, last = _running_on_each_gpu(host, rent, on_gpu_2=RentalKind.ON_DEMAND)
    # when GPU 2 reports volatile uncorrectable ECC errors (an older agent's sample: no Xid)
    host.nvml.gpus[2].ecc = 12
    host.beat()
    # then the rental fails, the node named as the cause, and the rest run on
    victim.refresh_from_db()
    assert victim.status == RentalStatus.FAILED
    assert victim.status_reason == "node gpu-host-7 GPU 2 failed: 12 uncorrectable ECC errors"
    assert victim.ended_at is not None and _held(victim) == []
    for rental in (pair, last):
        rental.refresh_from_db()
        assert rental.status == RentalStatus.RUNNING
    # and the node's measured reliability counts it against the node
    nodes_reliability_update(now=timezone.now() + timedelta(hours=1))
    from provisioning.services.reliability import _runs_by_node

    runs = {r["node_id"]: (r["ran"], r["failed"]) for r in _runs_by_node(
        since=timezone.now() - timedelta(days=1), now=timezone.now())}  # fmt: skip
    assert runs[host.node.pk] == (3, 1)


def test_a_failed_gpu_returns_only_after_a_passing_check_on_a_clean_gpu(host):
    # given GPU 2 failed (Xid 79)
    host.nvml.xid(2, 79)
    host.beat()
    assert host.gpu(2).health == GpuHealth.FAILED
    # when the check runs while GPU 2 still shows its fault: it stays out
    host.beat(benchmark=BENCH)
    assert host.gpu(2).health == GpuHealth.FAILED
    # when the host is repaired and reports clean: still out, reporting well is not a check
    host.restart_agent()
    assert host.beat()["run_benchmark"] is False
    assert host.gpu(2).health == GpuHealth.FAILED
    # a benchmark sent unasked is dropped and counted, and stores nothing
    stored, unasked = NodeBenchmark.objects.count(), BENCHMARKS_UNASKED._value.get()
    assert host.beat(benchmark=BENCH)["dropped"] == {"benchmark": 1}
    assert NodeBenchmark.objects.count() == stored and host.gpu(2).health == GpuHealth.FAILED
    assert BENCHMARKS_UNASKED._value.get() == unasked + 1
    # the recheck is due an hour after the last benchmark: asked for, on GPU 2
    assert nodes_benchmark_schedule(now=timezone.now()) == 0
    assert nodes_benchmark_schedule(now=timezone.now() + timedelta(hours=2)) == 1
    answer = host.beat()
    assert answer["run_benchmark"] is True and answer["benchmark"]["gpu_indices"] == [2]
    # a check below the card's band does not pass
    host.beat(benchmark={**BENCH, "matmul_tflops": 300.0})
    assert host.gpu(2).health == GpuHealth.FAILED
    Node.objects.filter(pk=host.node.pk).update(benchmark_requested=True)
    # then a passing check with GPU 2 clean brings it back
    host.beat(benchmark=BENCH)
    gpu = host.gpu(2)
    assert (gpu.health, gpu.health_reason) == (GpuHealth.OK, "check passed: 700 TFLOPS")
    assert list(GpuHealthEvent.objects.filter(gpu=gpu).values_list("to_health", flat=True)) == [
        "ok", "failed"
    ]  # fmt: skip


def test_a_degraded_gpu_still_rents_is_shown_and_recovers_when_its_signals_clear(
    host, api, make_node
):
    # given a dearer healthy H100 node beside ours
    other = make_node(card="h100-sxm5-80gb", gpus=4, price="5.00")
    # and on ours GPU 1 throttled by heat and GPU 3 on a narrowed PCIe link
    host.nvml.gpus[1].throttle = 0x40
    host.nvml.gpus[3].pcie_width = 8
    host.beat()
    assert (host.gpu(1).health, host.gpu(1).health_reason) == (
        "degraded", "hardware thermal slowdown"
    )  # fmt: skip
    assert host.gpu(3).health_reason == "PCIe link x8 of x16"
    # the same signals again change nothing and write no history
    host.beat()
    assert GpuHealthEvent.objects.filter(node=host.node).count() == 2
    # then the offer still lists all four GPUs, says two are degraded, and comes after the
    # healthy node even ordered by price
    offer, healthy = api.get("/api/v1/offers/", {"ordering": "price"}).json()["results"][::-1]
    assert healthy["node_id"] == other.pk and offer["node_id"] == host.node.pk
    assert (offer["free_gpus"], offer["degraded_gpus"]) == (4, 2)
    # the provider sees it on the API
    owner = APIClient()
    owner.force_authenticate(host.node.provider.owner)
    nodes = owner.get(f"/api/v1/providers/{host.node.provider_id}/nodes/").json()
    [shown] = [n for n in nodes if n["id"] == host.node.pk]
    assert [(g["index"], g["health"], g["health_reason"]) for g in shown["unhealthy_gpus"]] == [
        (1, "degraded", "hardware thermal slowdown"), (3, "degraded", "PCIe link x8 of x16")
    ]  # fmt: skip
    # and on their page
    browser = Client()
    browser.force_login(host.node.provider.owner)
    page = browser.get("/provider/").content.decode()
    assert "GPU 1 degraded: hardware thermal slowdown" in page
    # when the throttling ends (an idle heartbeat with clean samples)
    host.nvml.gpus[1].throttle = 0x1
    host.beat()
    assert host.gpu(1).health == GpuHealth.OK and host.gpu(3).health == GpuHealth.DEGRADED


def test_a_forged_score_cannot_become_the_measured_one(host, api):
    # given a node whose measured TFLOPS came from the platform's benchmark (700)
    assert Node.objects.get(pk=host.node.pk).measured_tflops == 700.0
    Node.objects.filter(pk=host.node.pk).update(benchmark_requested=True)
    # when a hacked agent answers with a score no H100 reaches
    host.beat(benchmark={**BENCH, "matmul_tflops": 99999.0})
    # then it is kept for the record, not believed, and the offer shows the measured one
    assert Node.objects.get(pk=host.node.pk).measured_tflops == 700.0
    assert NodeBenchmark.objects.filter(node=host.node, plausible=False).count() == 1
    [offer] = api.get("/api/v1/offers/").json()["results"]
    assert offer["measured_tflops"] == 700.0


def test_a_node_that_drifts_below_its_band_is_flagged_and_ranked_down(host, api, make_node):
    # given another H100 node, dearer, measured in its band
    other = make_node(card="h100-sxm5-80gb", gpus=4, price="5.00")
    Node.objects.filter(pk=other.pk).update(measured_tflops=650.0)
    # when this node's next benchmark falls to a third of the card's peak
    Node.objects.filter(pk=host.node.pk).update(benchmark_requested=True)
    host.beat(benchmark={**BENCH, "matmul_tflops": 300.0})
    node = Node.objects.get(pk=host.node.pk)
    assert node.benchmark_below_band is True
    # and an absurd figure sent next is not believed, so it cannot clear the flag
    Node.objects.filter(pk=host.node.pk).update(benchmark_requested=True)
    host.beat(benchmark={**BENCH, "matmul_tflops": 99999.0})
    assert Node.objects.get(pk=host.node.pk).benchmark_below_band is True
    # then the cheaper node is listed after the dearer one, flagged
    offers = api.get("/api/v1/offers/", {"ordering": "price"}).json()["results"]
    assert [(o["node_id"], o["benchmark_below_band"]) for o in offers] == [
        (other.pk, False), (host.node.pk, True)
    ]  # fmt: skip
    # a benchmark back in the band clears the flag
    Node.objects.filter(pk=host.node.pk).update(benchmark_requested=True)
    host.beat(benchmark=BENCH)
    assert Node.objects.get(pk=host.node.pk).benchmark_below_band is False


@pytest.mark.parametrize(
    ("signals", "verdict"),
    [
        ({}, ("ok", "")),
        # the heartbeat of the report: answered 200, the node kept serving on that GPU
        (
            {"healthy": False, "xid_errors": 3, "ecc_errors": 12},
            ("failed", "12 uncorrectable ECC errors"),
        ),
        ({"lost": True}, ("failed", "fell off the bus")),
        ({"fatal_xid": 48}, ("failed", "Xid 48")),
        ({"fatal_xid": 13}, ("ok", "")),  # an application's fault, not the GPU's
        ({"remap_failed": True}, ("failed", "row remapping failed")),
        ({"throttle_reasons": 0x1 | 0x4}, ("ok", "")),  # idle, power cap: normal
        ({"throttle_reasons": 0x80}, ("degraded", "power brake")),
        ({"pcie_gen": 3, "pcie_gen_max": 5}, ("degraded", "PCIe gen 3 of 5")),
        ({"retire_pending": True}, ("degraded", "memory repair pending a reset")),
        ({"healthy": False}, ("degraded", "the agent reports it unhealthy")),
    ],
)
def test_what_each_signal_means(signals, verdict):
    got = sample_verdict({"gpu_index": 0, **signals})
    assert (got.health, got.reason) == verdict


@pytest.fixture
def members(api, make_join_token):
    """Two 2-GPU nodes of one provider in one cluster, as tests/provisioning/test_gangs.py
    joins them."""
    fabric = {"cluster": "gang", "interconnect": "ethernet", "interconnect_gbps": 25}
    first = _join(api, make_join_token(), "gang-a", **fabric)
    second = _join(api, make_join_token(), "gang-b", cluster="gang")
    return sorted([first, second], key=lambda agent: agent.node.pk)


def test_a_gpu_fault_on_one_member_ends_the_whole_gang_on_every_node(members, rent):
    # given an interruptible rental over two nodes, running on both
    gang = _gang(rent, kind=RentalKind.INTERRUPTIBLE, bid_per_gpu_hour="0.50")
    runs = [_run(agent, gang) for agent in members]
    for agent, desired in zip(members, runs, strict=True):
        _report(agent, desired, "running", started_at=1.0e9)
    gang.refresh_from_db()
    assert gang.status == RentalStatus.RUNNING
    # when GPU 1 of the second member reports a double-bit ECC Xid
    first, second = members
    sample = {"gpu_index": 1, "ts": 1.0e9, "util_pct": 90.0, "mem_used_mb": 1, "power_w": 300.0,
              "temp_c": 60.0, "fatal_xid": 48, "healthy": False}  # fmt: skip
    _report(second, runs[1], "running", started_at=1.0e9)
    answer = second.post("/api/agent/v1/heartbeat/", {"telemetry": [sample]}, format="json").json()
    # then the whole gang goes back to the queue, its GPUs freed on both nodes, every run
    # forgotten, and both members are told to stop
    gang.refresh_from_db()
    assert gang.status == RentalStatus.PENDING
    assert gang.status_reason == f"node {second.node.hostname} GPU 1 failed: Xid 48; re-queued"
    assert _held(gang) == [] and not ContainerRun.objects.filter(rental=gang).exists()
    assert answer["desired"] == [] and _beat(first)["desired"] == []
    # only that GPU is out
    assert [g.index for g in Gpu.objects.filter(health=GpuHealth.FAILED)] == [1]
    assert Gpu.objects.get(health=GpuHealth.FAILED).node_id == second.node.pk


def test_an_idle_node_is_measured_again_daily_a_busy_one_is_left_alone(host, rent):
    # given a node measured at its join
    later = timezone.now() + timedelta(hours=25)
    # when it holds a rental a day later: not asked (a benchmark never contends with a rental)
    rental = _placed(rent, 1, duration_s=3 * 86400)
    assert rental.status == RentalStatus.SCHEDULED
    assert nodes_benchmark_schedule(now=later) == 0
    # when it is idle again: asked, once
    Allocation.objects.filter(rental=rental).update(released_at=timezone.now())
    assert nodes_benchmark_schedule(now=timezone.now()) == 0  # measured less than a day ago
    assert nodes_benchmark_schedule(now=later) == 1
    assert nodes_benchmark_schedule(now=later) == 0
    answer = host.beat()
    assert answer["run_benchmark"] is True and answer["benchmark"]["gpu_indices"] == []
