"""A gang whose host dies mid-run stops as one and resumes as one: three hosts in network
namespaces (test_gang's hosts and fabric), each with its own agent (local-process runtime, 2
simulated GPUs) and a way to the object store. An interruptible 2 x 2 rental with a pipeline
stage per host checkpoints to the store; once a whole checkpoint is synced, one of its hosts
dies (its links cut, every process in it SIGKILLed, its agent included). The server finds the
node silent and re-queues the gang as a whole (the survivor's run is stopped by its desired
state); it is placed on the two live hosts, every member is staged the checkpoint, and the job
resumes from it: its loss goes on as in the run that was never interrupted, and its output is
one result (one checkpoint tree, each node's log under its own prefix).

Needs root (network namespaces); the namespaces, links and forwarders are removed even when the
test fails.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from decimal import Decimal
from urllib.parse import urlsplit

import pytest

from marketplace.models import Node, NodeStatus, Rental, RentalEvent, RentalStatus
from marketplace.services.rentals import RentalRequest, RuntimeSpec, rental_create
from provisioning.models import ContainerRun, RunMetric
from provisioning.services import join_token_create
from storage.models import Artifact
from storage.selectors import latest_checkpoint
from tests.e2e.conftest import HARNESS_IMAGE, ROOT, credit_customer, wait_for
from tests.e2e.stack import Stack, agent_command
from tests.e2e.test_gang import Fabric
from tests.e2e.test_multihost import Host, _ip, _namespaces_possible
from tests.factories import personal_team

# Three agents, two placements of a 4-rank job and a reference run on a shared machine.
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.django_db(transaction=True),
    pytest.mark.timeout(1800),
]

GPUS = 2
HOSTS = 3
# Long enough that the host dies mid-run whatever the machine's load (a step of this job takes
# about 0.1 s on one core here; the first whole checkpoint is synced within seconds).
STEPS = 300
LOG_EVERY = 5
CONFIG = {
    "model": {"name": "transformer", "preset": "tiny"},
    "data": {"name": "text", "seq_len": 16},
    "train": {"steps": STEPS, "lr": 3e-3, "grad_clip": 0.5, "log_every": LOG_EVERY,
              "device": "cpu", "precision": "fp32", "seed": 3},
    "checkpoint": {"enabled": True, "every_steps": 25, "keep": 3},
    "layout": {"pp": 2, "micro_batch": 4, "grad_accum": 1, "pp_microbatches": 2},
}  # fmt: skip


class StoreForwarder:
    """The object store, reachable from inside a host's namespace at the address the server
    presigns for (the store's loopback address): a forwarder in the namespace sends to one on
    the host's server-side address, which sends to the store. The presigned Host header is
    carried unchanged, so signatures hold."""

    def __init__(self, host: Host, endpoint: str) -> None:
        parts = urlsplit(endpoint)
        self.host, self.store_host, self.store_port = host, parts.hostname, parts.port
        self.procs: list[subprocess.Popen] = []

    def start(self) -> None:
        # The relay listens on the host's server-side address, on the store's port number.
        relay = f"{self.host.server_ip}:{self.store_port}"
        self.procs.append(subprocess.Popen(
            ["socat", f"TCP-LISTEN:{self.store_port},bind={self.host.server_ip},fork,reuseaddr",
             f"TCP:{self.store_host}:{self.store_port}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        ))  # fmt: skip
        self.procs.append(subprocess.Popen(
            ["ip", "netns", "exec", self.host.ns, "socat",
             f"TCP-LISTEN:{self.store_port},bind={self.store_host},fork,reuseaddr", f"TCP:{relay}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        ))  # fmt: skip

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)


@pytest.fixture
def three_hosts(object_store_env):
    reason = _namespaces_possible()
    if reason:
        pytest.skip(reason)
    hosts = [Host(60 + i) for i in range(HOSTS)]
    fabric = Fabric()
    forwarders = [StoreForwarder(h, object_store_env["S3_ENDPOINT_URL"]) for h in hosts]
    try:
        fabric.create()
        addresses = []
        for i, host in enumerate(hosts):
            host.create()
            addresses.append(fabric.attach(host, i))
        for forwarder in forwarders:
            forwarder.start()
        yield fabric, list(zip(hosts, addresses, strict=True))
    finally:
        for forwarder in forwarders:
            forwarder.stop()
        for host in hosts:
            host.remove()
        fabric.remove()


@pytest.fixture
def lost_host_stack(stack_env, object_store, object_store_env, provider, tmp_path, three_hosts):
    _, hosts = three_hosts
    stack = Stack(
        env={**stack_env, **object_store_env, "S3_PUBLIC_ENDPOINT_URL": "",
             "ALLOWED_HOSTS": ",".join(["127.0.0.1", "localhost",
                                        *(h.server_ip for h, _ in hosts)])},
        tmp=tmp_path, join_token=None, agent=None, binds=tuple(h.server_ip for h, _ in hosts),
    )  # fmt: skip
    for host, address in hosts:
        _, token = join_token_create(
            provider=provider, created_by=provider.owner, region="lost",
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
            "--cluster", "lost-fabric", "--interconnect", "ethernet", "--interconnect-gbps", "10",
        ]  # fmt: skip
    try:
        yield stack.start()
    finally:
        stack.stop()


def _reference_losses(tmp_path) -> dict[int, float]:
    """The same job on one host, never interrupted: step -> loss."""
    config = tmp_path / "reference.json"
    config.write_text(json.dumps({**CONFIG, "checkpoint": {"enabled": False}}))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "NNODES")}
    env["GPUMARKET_WORKSPACE"] = str(tmp_path / "reference")
    out = subprocess.run(
        [sys.executable, "-m", "harness", "--config", str(config), "--nproc", "4"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=True,
    )  # fmt: skip
    events = [json.loads(line) for line in out.stdout.splitlines() if line.strip()]
    return {e["step"]: e["loss"] for e in events if e.get("event") == "step"}


def _whole_checkpoint(rental: Rental):
    return latest_checkpoint(
        Artifact.objects.filter(rental=rental), world_size=rental.node_count * GPUS
    )


def _held_nodes(rental: Rental) -> set[str]:
    return set(
        rental.allocations.filter(released_at__isnull=True).values_list("node__hostname", flat=True)
    )


def _kill(stack: Stack, fabric: Fabric, hosts: list[tuple[Host, str]], host: Host) -> None:
    """The host dies: no restart of its agent, its links cut (no goodbye reaches its peers),
    then every process in its namespace SIGKILLed."""
    stack.supervisor.children[f"agent-{host.hostname}"].cmd = ["sleep", "infinity"]
    index = next(i for i, (h, _) in enumerate(hosts) if h is host)
    host.link(up=False)
    _ip("link", "set", f"gfo{index}{fabric.ns[4:]}"[:15], "down", ns=fabric.ns)
    pids = subprocess.run(
        ["ip", "netns", "pids", host.ns], capture_output=True, text=True, check=True
    ).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            continue


def test_a_gang_whose_host_dies_stops_and_resumes_as_a_whole_from_its_checkpoint(
    lost_host_stack, three_hosts, user, tmp_path
):
    stack = lost_host_stack
    fabric, hosts = three_hosts
    credit_customer(user)
    by_name = {host.hostname: host for host, _ in hosts}
    try:
        wait_for(
            lambda: Node.objects.filter(region="lost", status=NodeStatus.ONLINE).count() == HOSTS,
            180, "three agents to join",
        )  # fmt: skip
    except AssertionError:
        print(stack.log(f"agent-{hosts[0][0].hostname}")[-3000:])
        raise
    # given an interruptible 2 x 2 rental with a pipeline stage per host, checkpointing
    rental = rental_create(
        customer=user,
        team=personal_team(user),
        request=RentalRequest(
            gpus_per_node=GPUS, node_count=2, duration_s=3600, region="lost",
            kind="interruptible", bid_per_gpu_hour=Decimal("0.50"),
            # The local-process runtime runs the interpreter the agent runs: this checkout's
            # harness, whatever checkout the virtualenv was installed from.
            runtime=RuntimeSpec(image=HARNESS_IMAGE, harness_config=CONFIG,
                                env={"PYTHONPATH": str(ROOT)}),
        ),
    )  # fmt: skip

    def logs() -> str:
        agents = [stack.log(f"agent-{h.hostname}")[-2000:] for h, _ in hosts]
        runs = [f"{r.run_id} {r.status} {r.exit_code}:\n{r.log_tail[-3000:]}"
                for r in ContainerRun.objects.filter(rental=rental)]  # fmt: skip
        harness = [
            f"{path}:\n{path.read_text(errors='replace')[-3000:]}"
            for path in sorted(tmp_path.glob("mh-*/volumes/*/logs/harness.log"))
        ]
        return "\n".join([*agents, *runs, *harness])

    try:
        wait_for(lambda: Rental.objects.get(pk=rental.pk).status == RentalStatus.RUNNING,
                 240, "the gang to run")  # fmt: skip
        first_placement = _held_nodes(rental)
        # when a whole checkpoint (every rank's shard, from both hosts) is synced
        checkpoint = wait_for(lambda: _whole_checkpoint(rental), 240, "a whole checkpoint")
    except AssertionError:
        print(logs())
        raise
    members = {
        r.node_rank: r.node.hostname
        for r in ContainerRun.objects.filter(rental=rental).select_related("node")
    }
    assert sorted(members) == [0, 1] and set(members.values()) == first_placement
    # and the host of node rank 0 (the job's master) dies
    lost = by_name[members[0]]
    survivor = members[1]
    _kill(stack, fabric, hosts, lost)
    assert Rental.objects.get(pk=rental.pk).status == RentalStatus.RUNNING, "ended before the kill"
    assert 0 < checkpoint.step < STEPS

    # then the server finds the node silent and re-queues the gang as a whole, naming it
    lost_node = Node.objects.get(hostname=lost.hostname)
    wait_for(lambda: Node.objects.get(pk=lost_node.pk).status == NodeStatus.OFFLINE, 120,
             "the dead host to be marked silent")  # fmt: skip
    requeued = RentalEvent.objects.filter(rental=rental, to_status=RentalStatus.PENDING).last()
    assert requeued.reason == f"node {lost.hostname} went silent; re-queued"
    # and it is placed on the two live hosts, never on the dead one's GPUs
    spare = next(h.hostname for h, _ in hosts if h.hostname not in first_placement)
    try:
        wait_for(lambda: _held_nodes(rental) == {survivor, spare}, 180, "the second placement")
        # and the survivor's old run was stopped by its desired state, then every member
        # started the job again from the checkpoint
        resumed = wait_for(
            lambda: RunMetric.objects.filter(rental=rental, event="start", step__isnull=True)
            .filter(data__start_step__gt=0)
            .first(),
            300, "the resumed job to start",
        )  # fmt: skip
        wait_for(lambda: Rental.objects.get(pk=rental.pk).status in (RentalStatus.COMPLETED,
                                                                     RentalStatus.FAILED),
                 600, "the resumed gang to finish")  # fmt: skip
    except AssertionError:
        rental.refresh_from_db()
        print(rental.status, rental.status_reason, logs())
        raise
    rental.refresh_from_db()
    assert rental.status == RentalStatus.COMPLETED, (rental.status_reason, logs())
    start_step = resumed.data["start_step"]
    assert checkpoint.step <= start_step < STEPS
    assert resumed.data["resumed_from"].endswith(f"step_{start_step:09d}")
    assert resumed.data["world_size"] == 4

    # and its loss goes on where it stopped: the resumed steps' losses are the uninterrupted
    # run's
    after = {
        m.step: m.data["loss"]
        for m in RunMetric.objects.filter(rental=rental, run_id=resumed.run_id, event="step")
    }
    assert min(after) > start_step and max(after) == STEPS
    reference = _reference_losses(tmp_path)
    steps = sorted(after)
    assert [after[s] for s in steps] == pytest.approx([reference[s] for s in steps], rel=1e-4)

    # and its output is one result: one checkpoint tree, each node's log under its own prefix
    paths = set(Artifact.objects.filter(rental=rental).values_list("path", flat=True))
    final = f"checkpoints/step_{STEPS:09d}"
    names = (".metadata", "harness.pt", *(f"__{rank}_0.distcp" for rank in range(4)))
    assert {f"{final}/{name}" for name in names} <= paths
    assert {"nodes/0/logs/harness.log", "nodes/1/logs/harness.log"} <= paths
    assert not [p for p in paths if p.startswith("logs/") or "/checkpoints/" in p]
