"""A rental over two hosts is ONE training job: two hosts in their own network namespaces, each
with its own node agent (local-process runtime, 2 simulated GPUs), joined to the server over one
link each and to each other over a fabric of their own (a bridge in a third namespace). A 2 x 2
rental runs the harness on both with a pipeline stage per host: the job has 4 ranks, its loss
curve is the one the same job has on one host, and the rental completes when both have finished.

Needs root (network namespaces); the namespaces and links are removed even when a test fails.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from decimal import Decimal

import pytest

from marketplace.models import Node, NodeStatus, Rental, RentalStatus
from marketplace.services.rentals import RentalRequest, RuntimeSpec, rental_create
from provisioning.models import ContainerRun, RunMetric
from provisioning.services import join_token_create
from tests.e2e.conftest import HARNESS_IMAGE, ROOT, credit_customer, wait_for
from tests.e2e.stack import Stack, agent_command
from tests.e2e.test_multihost import Host, _ip, _namespaces_possible
from tests.factories import personal_team

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

GPUS = 2
STEPS = 5
# Pipeline parallel over the two hosts (stage 0 on node rank 0, stage 1 on node rank 1), data
# parallel over each host's two processes: one job of 4 ranks.
CONFIG = {
    "model": {"name": "transformer", "preset": "tiny"},
    "data": {"name": "text", "seq_len": 16},
    "train": {"steps": STEPS, "lr": 3e-3, "grad_clip": 0.5, "log_every": 1, "device": "cpu",
              "precision": "fp32", "seed": 3},
    "checkpoint": {"enabled": False},
    "layout": {"pp": 2, "micro_batch": 4, "grad_accum": 1, "pp_microbatches": 2},
}  # fmt: skip


class Fabric:
    """A bridge in its own namespace; each host gets a second link to it, 10.232.0.<i+1>/24."""

    def __init__(self) -> None:
        tag = f"{os.getpid() % 100000}"
        self.ns = f"gpmf{tag}"
        self.links: list[str] = []

    def create(self) -> None:
        _ip("netns", "add", self.ns)
        _ip("link", "add", "br0", "type", "bridge", ns=self.ns)
        _ip("link", "set", "br0", "up", ns=self.ns)

    def attach(self, host: Host, index: int) -> str:
        outer, inner = f"gfo{index}{self.ns[4:]}"[:15], f"gfi{index}{self.ns[4:]}"[:15]
        _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
        _ip("link", "set", outer, "netns", self.ns)
        _ip("link", "set", inner, "netns", host.ns)
        _ip("link", "set", outer, "master", "br0", ns=self.ns)
        _ip("link", "set", outer, "up", ns=self.ns)
        address = f"10.232.0.{index + 1}"
        _ip("addr", "add", f"{address}/24", "dev", inner, ns=host.ns)
        _ip("link", "set", inner, "up", ns=host.ns)
        self.links.append(inner)
        return address

    def remove(self) -> None:
        subprocess.run(["ip", "netns", "del", self.ns], check=False, capture_output=True)


@pytest.fixture
def fabric_hosts():
    reason = _namespaces_possible()
    if reason:
        pytest.skip(reason)
    hosts = [Host(10 + i) for i in range(2)]
    fabric = Fabric()
    try:
        fabric.create()
        addresses = []
        for i, host in enumerate(hosts):
            host.create()
            addresses.append(fabric.attach(host, i))
        yield list(zip(hosts, addresses, strict=True))
    finally:
        for host in hosts:
            host.remove()
        fabric.remove()


@pytest.fixture
def gang_stack(stack_env, provider, tmp_path, fabric_hosts):
    hosts = [host for host, _ in fabric_hosts]
    stack = Stack(
        # No object storage: its presigned URLs name loopback, which a namespace cannot reach.
        env={**stack_env, "S3_ENDPOINT_URL": "", "S3_BUCKET": "",
             "ALLOWED_HOSTS": ",".join(["127.0.0.1", "localhost", *(h.server_ip for h in hosts)])},
        tmp=tmp_path, join_token=None, agent=None, binds=tuple(h.server_ip for h in hosts),
    )  # fmt: skip
    for host, address in fabric_hosts:
        _, token = join_token_create(
            provider=provider, created_by=provider.owner, region="gang",
            price_per_gpu_hour=Decimal("0.60"), min_bid_per_gpu_hour=Decimal("0.20"),
        )  # fmt: skip
        command = agent_command(
            state=tmp_path / host.hostname, runtime="process", gpus=GPUS, hostname=host.hostname
        )
        server = f"http://{host.server_ip}:{stack.port}"
        stack.agents[f"agent-{host.hostname}"] = [
            "ip", "netns", "exec", host.ns, *command, "--server", server, "--join-token", token,
            "--fabric-address", address,
            # One cluster, as a gang needs: the first agent to join creates it.
            "--cluster", "gang-fabric", "--interconnect", "ethernet", "--interconnect-gbps", "10",
        ]  # fmt: skip
    try:
        yield stack.start()
    finally:
        stack.stop()


def _one_host_losses(tmp_path) -> list[float]:
    """The same job on one host: 4 local processes."""
    config = tmp_path / "one-host.json"
    config.write_text(json.dumps(CONFIG))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "NNODES")}
    env["GPUMARKET_WORKSPACE"] = str(tmp_path / "one-host")
    out = subprocess.run(
        [sys.executable, "-m", "harness", "--config", str(config), "--nproc", "4"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    events = [json.loads(line) for line in out.stdout.splitlines() if line.strip()]
    return [e["loss"] for e in events if e.get("event") == "step"]


def test_a_two_host_rental_trains_one_job_with_a_pipeline_stage_per_host(
    gang_stack, fabric_hosts, user, tmp_path
):
    stack = gang_stack
    credit_customer(user)
    try:
        wait_for(
            lambda: Node.objects.filter(region="gang", status=NodeStatus.ONLINE).count() == 2,
            120, "both agents to join",
        )  # fmt: skip
    except AssertionError:
        print(stack.log(f"agent-{fabric_hosts[0][0].hostname}")[-3000:])
        raise
    declared = dict(Node.objects.filter(region="gang").values_list("hostname", "fabric_address"))
    assert declared == {host.hostname: address for host, address in fabric_hosts}
    # when a 2 x 2 GPU rental runs the harness
    rental = rental_create(
        customer=user,
        team=personal_team(user),
        request=RentalRequest(
            gpus_per_node=GPUS, node_count=2, duration_s=3600, region="gang",
            runtime=RuntimeSpec(image=HARNESS_IMAGE, harness_config=CONFIG),
        ),
    )  # fmt: skip
    try:
        wait_for(
            lambda: Rental.objects.get(pk=rental.pk).status in (RentalStatus.COMPLETED,
                                                              RentalStatus.FAILED),
            300, "the gang to finish",
        )  # fmt: skip
    except AssertionError:
        for host, _ in fabric_hosts:
            print(stack.log(f"agent-{host.hostname}")[-3000:])
        raise
    rental.refresh_from_db()
    # then it completed as one job: both members ran and exited 0
    runs = ContainerRun.objects.filter(rental=rental)
    assert rental.status == RentalStatus.COMPLETED, (rental.status_reason, rental.log_tail)
    assert sorted(runs.values_list("exit_code", flat=True)) == [0, 0]
    # and the job had 4 ranks, rank 0's start event reporting a stage per host
    metrics = [m.data for m in RunMetric.objects.filter(rental=rental).order_by("pk")]
    [start] = [m for m in metrics if m.get("event") == "start"]
    assert start["world_size"] == 4
    assert (start["layout"]["pp"], start["layout"]["dp"]) == (2, 2)
    # and its loss curve is the one-host curve of the same job
    steps = sorted((m["step"], m["loss"]) for m in metrics if m.get("event") == "step")
    assert [s for s, _ in steps] == list(range(1, STEPS + 1))
    assert [loss for _, loss in steps] == pytest.approx(_one_host_losses(tmp_path), rel=1e-5)
    # and it was billed from the moment its last member ran (the server's RUNNING event, after
    # every member's reported start), not before
    started = [r.started_at for r in runs]
    running = rental.events.get(to_status=RentalStatus.RUNNING)
    assert rental.started_at == running.created_at >= max(started)
