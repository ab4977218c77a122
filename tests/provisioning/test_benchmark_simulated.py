"""A simulated node's benchmark: a figure for its card, believed from simulated nodes only."""

import pytest
from rest_framework.test import APIClient

from marketplace.models import Node
from nodeagent.benchmark import BenchmarkRunner
from nodeagent.telemetry.simulated import SimulatedSource
from provisioning.models import NodeBenchmark

pytestmark = pytest.mark.django_db

HOST = {"cpu_cores": 8, "ram_gb": 64, "disk_gb": 500, "driver_version": "simulated",
        "cuda_version": "12.4"}  # fmt: skip
H100_PEAK = 989.0


def _join(api, make_join_token, *, hostname: str, gpu_name: str, simulated: bool) -> APIClient:
    gpus = [
        {"index": i, "uuid": f"GPU-{hostname}-{i}", "name": gpu_name, "memory_mb": 81920,
         "topology_group": "nvl0"}
        for i in range(2)
    ]  # fmt: skip
    body = {
        "join_token": make_join_token(),
        "hostname": hostname,
        "host": HOST,
        "internet_filtered": True,
        "gpus": gpus,
    }
    r = api.post("/api/agent/v1/join/", {**body, "simulated": simulated}, format="json")
    assert r.status_code == 201, r.content
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {r.json()['node_token']}")
    client.node = Node.objects.get(pk=r.json()["node_id"])
    return client


def _beat(agent, **body) -> dict:
    r = agent.post("/api/agent/v1/heartbeat/", body, format="json")
    assert r.status_code == 200, r.content
    return r.json()


def _simulated_result(hostname: str) -> dict:
    """What the agent of a simulated H100 node sends: its benchmark runner, given the simulated
    telemetry's figure, runs no command (the one named here would fail)."""
    source = SimulatedSource(hostname=hostname, model_slug="h100-sxm5-80gb", count=2)
    runner = BenchmarkRunner(runtime="process", env={}, simulated=source.benchmark)
    assert runner.request()
    runner.wait(10)
    result = runner.result()
    assert result is not None
    return result


def test_a_simulated_node_benchmarks_plausibly_and_its_figure_is_shown(api, make_join_token):
    # given a simulated H100 node that the server asked for a benchmark at join
    agent = _join(api, make_join_token, hostname="sim-1", gpu_name="h100-sxm5-80gb", simulated=True)
    assert agent.node.gpu_model.slug == "h100-sxm5-80gb"
    assert _beat(agent)["run_benchmark"] is True
    # when its agent delivers the simulated benchmark
    result = _simulated_result("sim-1")
    assert result["simulated"] is True and result["device"] == "simulated"
    assert 0.6 * H100_PEAK <= result["matmul_tflops"] <= 0.8 * H100_PEAK
    assert _beat(agent, benchmark=result)["run_benchmark"] is False
    # then it is believed and shown as the node's measured TFLOPS
    agent.node.refresh_from_db()
    assert agent.node.measured_tflops == result["matmul_tflops"]
    bench = NodeBenchmark.objects.get(node=agent.node)
    assert bench.plausible and bench.raw["simulated"] is True
    [offer] = [o for o in api.get("/api/v1/offers/").json()["results"] if o["simulated"]]
    assert offer["measured_tflops"] == result["matmul_tflops"]


def test_the_simulated_figure_is_stable_per_host_and_differs_between_hosts():
    # given two simulated hosts of the same card
    first = [SimulatedSource(hostname="a", model_slug="h100-sxm5-80gb", count=1).benchmark()
             for _ in range(5)]  # fmt: skip
    other = SimulatedSource(hostname="b", model_slug="h100-sxm5-80gb", count=1).benchmark()
    # then one host's figures stay within the 1 % noise of each other, another host's differ
    figures = [r["matmul_tflops"] for r in first]
    assert max(figures) - min(figures) <= 0.02 * max(figures) + 0.01
    assert all(0.6 * H100_PEAK <= f <= 0.8 * H100_PEAK for f in [*figures, other["matmul_tflops"]])
    assert abs(other["matmul_tflops"] - figures[0]) > 0.0  # a per-host share, not one constant


def test_a_real_node_sending_a_simulated_result_is_refused(api, make_join_token):
    # given a real H100 node (it did not join as simulated)
    agent = _join(
        api, make_join_token, hostname="real-1", gpu_name="NVIDIA H100 80GB HBM3", simulated=False
    )
    assert agent.node.gpu_model.slug == "h100-sxm5-80gb"
    # when it sends the result a simulated node would send, in the card's band
    result = _simulated_result("real-1")
    _beat(agent, benchmark=result)
    # then it is kept for the record, flagged, and not shown
    agent.node.refresh_from_db()
    assert agent.node.measured_tflops is None
    assert NodeBenchmark.objects.get(node=agent.node).plausible is False


@pytest.mark.parametrize("simulated", [True, False])
def test_a_cpu_figure_stays_implausible_on_any_node(api, make_join_token, simulated):
    # given a node of either kind, and the figure a CPU matmul gives (what simulated nodes
    # reported before they had a simulated benchmark)
    name = "h100-sxm5-80gb" if simulated else "NVIDIA H100 80GB HBM3"
    agent = _join(api, make_join_token, hostname="cpu-1", gpu_name=name, simulated=simulated)
    cpu = {"event": "benchmark", "device": "cpu", "precision": "fp32", "device_name": "x86",
           "matmul_tflops": 0.4}  # fmt: skip
    # when it is reported
    _beat(agent, benchmark=cpu)
    # then it is refused as before: kept, flagged, never shown
    agent.node.refresh_from_db()
    assert agent.node.measured_tflops is None
    assert NodeBenchmark.objects.get(node=agent.node).plausible is False
