"""A Docker gang's private network: two hosts in network namespaces, each with its own Docker
Engine and node agent (Docker runtime, 3 simulated GPUs), joined to the server over one link
each and to each other over a fabric of their own (tests/e2e/test_gang.py's). A 2 x 2 rental
trains ONE job in containers over the gang's VXLAN overlay, with the loss curve of the same job
in 4 processes on one host and one checkpoint set in the bucket; a customer command running
its own `torchrun` with the variables it is given trains across the nodes too. While it runs,
a third tenant's container on one of the hosts, and the hosts themselves, cannot open a
connection to the gang's rendezvous port, on its overlay address or its fabric address.

Needs root (network namespaces, a Docker Engine per namespace); the engines, namespaces and
links are removed even when a test fails. The harness image is loaded into each engine once
per module.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from decimal import Decimal
from pathlib import Path

import pytest

from marketplace.models import Node, NodeStatus, Rental, RentalStatus
from marketplace.services.rentals import RentalRequest, RuntimeSpec, rental_create
from nodeagent.publish import CLONE_NEWNET
from nodeagent.runtime.docker import container_name
from nodeagent.runtime.gangnet import Gang
from provisioning.models import ContainerRun, RunMetric
from provisioning.services import join_token_create
from provisioning.services.gangs import master_port
from storage.models import Artifact
from tests.e2e.conftest import HARNESS_IMAGE, ROOT, credit_customer, wait_for
from tests.e2e.stack import Stack, agent_command
from tests.e2e.test_gang import Fabric
from tests.e2e.test_multihost import Host, _namespaces_possible
from tests.factories import UserFactory, personal_team

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

_libc = ctypes.CDLL(None, use_errno=True)

GPUS = 3  # a gang takes 2 on each host, a third tenant the one left on one of them
STEPS = 6
# Data parallel over the 4 ranks; a model whose checkpoint is one file written by rank 0 (a
# sharded checkpoint of a transformer is written by every rank into its own host's workspace).
CONFIG = {
    "model": {"name": "gpt", "layers": 1, "width": 32, "heads": 2},
    "data": {"name": "text", "batch_size": 8, "seq_len": 16},
    "train": {"steps": STEPS, "lr": 3e-3, "log_every": 1, "device": "cpu", "precision": "fp32",
              "seed": 5},
    "checkpoint": {"every_steps": STEPS, "keep": 1},
}  # fmt: skip

# A customer's own job: torchrun with the variables the run is given, one all_reduce over the
# 4 ranks, then rank 0 holds the job (and torchrun its rendezvous store) open until the test
# lets it go by creating /workspace/release in node rank 0's container.
TORCHRUN_JOB = """\
import json, os, time
import torch
import torch.distributed as dist
dist.init_process_group("gloo")
rank = dist.get_rank()
value = torch.tensor([float(rank)])
dist.all_reduce(value)
print(json.dumps({"event": "allreduce", "rank": rank, "world_size": dist.get_world_size(),
                  "sum": value.item(), "master": os.environ["MASTER_ADDR"]}), flush=True)
if rank == 0:
    deadline = time.time() + 600
    while not os.path.exists("/workspace/release") and time.time() < deadline:
        time.sleep(0.2)
dist.barrier()
dist.destroy_process_group()
"""
TORCHRUN_COMMAND = [
    "sh", "-c",
    "cat > /tmp/job.py <<'EOF'\n" + TORCHRUN_JOB + "EOF\n"
    'exec python3 -m torch.distributed.run --nnodes "$NNODES" --node-rank "$NODE_RANK" '
    '--nproc-per-node "$NPROC_PER_NODE" --master-addr "$MASTER_ADDR" '
    '--master-port "$MASTER_PORT" /tmp/job.py',
]  # fmt: skip


class Engine:
    """A Docker Engine of its own in a host's network namespace (its own data root, exec root,
    pidfile and socket; no iptables, no default bridge, as deploy/docker-engine.sh runs one,
    unless `iptables`: then the engine manages the namespace's packet filter and NAT, as a
    stock dockerd does). It keeps the test's mount namespace (nsenter --net, not `ip netns
    exec`), where the cgroup hierarchy it needs is mounted. `host` needs `ns` and `hostname`."""

    def __init__(self, host: Host, root: Path, *, iptables: bool = False):
        self.host = host
        self.root = root
        self.iptables = iptables
        self.socket = root / "docker.sock"
        self.url = f"unix://{self.socket}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        log = (self.root / "dockerd.log").open("wb")
        self.proc = subprocess.Popen(
            ["nsenter", f"--net=/var/run/netns/{self.host.ns}", "dockerd",
             f"--iptables={str(self.iptables).lower()}",
             f"--ip-masq={str(self.iptables).lower()}", "--bridge=none",
             f"--data-root={self.root / 'data'}", f"--exec-root={self.root / 'exec'}",
             f"--pidfile={self.root / 'dockerd.pid'}", f"--host={self.url}"],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        wait_for(self._answers, 60, f"the Docker Engine of {self.host.hostname}")

    def _answers(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError((self.root / "dockerd.log").read_text()[-2000:])
        return self.docker("info", check=False).returncode == 0

    def docker(self, *args: str, check: bool = True, stdin=None) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["docker", "-H", self.url, *args], stdin=stdin, capture_output=True, timeout=300,
            check=check,
        )  # fmt: skip

    def load(self, image: str) -> None:
        saved = subprocess.Popen(["docker", "save", image], stdout=subprocess.PIPE)
        self.docker("load", stdin=saved.stdout)
        assert saved.wait(60) == 0

    def stop(self) -> None:
        if self.proc is None:
            return
        containers = self.docker("ps", "-aq", check=False).stdout.split()
        if containers:
            self.docker("rm", "-f", *[c.decode() for c in containers], check=False)
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        shutil.rmtree(self.root, ignore_errors=True)


class LoopbackForward:
    """127.0.0.1:`port` inside a namespace, forwarded to 127.0.0.1:`port` outside: the
    object store's presigned URLs name loopback, which an agent in a namespace must reach."""

    def __init__(self, ns: str, port: int):
        self.port = port
        made: list[socket.socket] = []

        def listen_inside() -> None:
            own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
            try:
                enter_netns_path(f"/var/run/netns/{ns}")
                made.append(socket.create_server(("127.0.0.1", port)))
            finally:
                enter_netns_fd(own)
                os.close(own)

        thread = threading.Thread(target=listen_inside)
        thread.start()
        thread.join()
        self.server = made[0]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                inner, _ = self.server.accept()
            except OSError:
                return
            try:
                outer = socket.create_connection(("127.0.0.1", self.port), timeout=10)
            except OSError as exc:
                print(f"store forward to 127.0.0.1:{self.port}: {exc}", file=sys.stderr)
                inner.close()
                continue
            outer.settimeout(None)
            for src, dst in ((inner, outer), (outer, inner)):
                threading.Thread(target=_copy, args=(src, dst), daemon=True).start()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.server.shutdown(socket.SHUT_RDWR)
        self.server.close()


def _copy(src: socket.socket, dst: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while data := src.recv(65536):
            dst.sendall(data)
    with contextlib.suppress(OSError):
        dst.shutdown(socket.SHUT_WR)


def enter_netns_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        enter_netns_fd(fd)
    finally:
        os.close(fd)


def enter_netns_fd(fd: int) -> None:
    """Move the calling thread (only it) into the network namespace `fd` refers to."""
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"setns: {os.strerror(code)}")


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """Two hosts on a fabric, each with its own Docker Engine holding the harness image."""
    reason = _namespaces_possible()
    if reason:
        pytest.skip(reason)
    if shutil.which("dockerd") is None or shutil.which("nsenter") is None:
        pytest.skip("a Docker Engine per namespace needs dockerd and nsenter")
    hosts = [Host(20 + i) for i in range(2)]
    fabric = Fabric()
    made: list[Engine] = []
    try:
        fabric.create()
        addresses = []
        for i, host in enumerate(hosts):
            host.create()
            addresses.append(fabric.attach(host, i))
        # Short paths: containerd's sockets live under the exec root (108-byte socket paths).
        for host in hosts:
            made.append(Engine(host, Path(f"/tmp/gpme-{host.ns}")))
            made[-1].start()
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda e: e.load(HARNESS_IMAGE), made))
        yield list(zip(hosts, addresses, made, strict=True))
    finally:
        for engine in made:
            engine.stop()
        for host in hosts:
            host.remove()
        fabric.remove()


@pytest.fixture(scope="module")
def store_forwards(engines, object_store_env):
    """The object store's loopback address, reachable from inside each host's namespace."""
    port = int(object_store_env["S3_ENDPOINT_URL"].rsplit(":", 1)[1].split("/")[0])
    forwards = [LoopbackForward(host.ns, port) for host, _, _ in engines]
    yield
    for forward in forwards:
        forward.close()


@pytest.fixture
def docker_gang_stack(
    stack_env, object_store, object_store_env, provider, tmp_path, engines, store_forwards
):
    hosts = [host for host, _, _ in engines]
    stack = Stack(
        env={**stack_env, **object_store_env, "S3_PUBLIC_ENDPOINT_URL": "",
             "ALLOWED_HOSTS": ",".join(["127.0.0.1", "localhost", *(h.server_ip for h in hosts)])},
        tmp=tmp_path, join_token=None, agent=None, binds=tuple(h.server_ip for h in hosts),
    )  # fmt: skip
    for host, address, engine in engines:
        _, token = join_token_create(
            provider=provider, created_by=provider.owner, region="dgang",
            price_per_gpu_hour=Decimal("0.60"), min_bid_per_gpu_hour=Decimal("0.20"),
        )  # fmt: skip
        command = agent_command(
            state=tmp_path / host.hostname, runtime="docker", gpus=GPUS, hostname=host.hostname
        )
        server = f"http://{host.server_ip}:{stack.port}"
        # nsenter --net, as for the engine: in the mount namespace `ip netns exec` makes, the
        # agent's quota mounts of the workspaces would be invisible to the engine.
        stack.agents[f"agent-{host.hostname}"] = [
            "nsenter", f"--net=/var/run/netns/{host.ns}", "env", f"DOCKER_HOST={engine.url}",
            *command,
            "--server", server, "--join-token", token, "--fabric-address", address,
            # One cluster, as a gang needs: the first agent to join creates it.
            "--cluster", "dgang-fabric", "--interconnect", "ethernet", "--interconnect-gbps", "10",
        ]  # fmt: skip
    try:
        stack.start()
        try:
            wait_for(
                lambda: Node.objects.filter(region="dgang", status=NodeStatus.ONLINE).count() == 2,
                120, "both agents to join",
            )  # fmt: skip
        except AssertionError:
            print(stack.log(f"agent-{hosts[0].hostname}")[-3000:])
            raise
        yield stack
    finally:
        stack.stop()
        for _, _, engine in engines:
            # What the agents left (they are stopped): the next test starts from clean engines.
            ids = engine.docker("ps", "-aq", check=False).stdout.split()
            if ids:
                engine.docker("rm", "-f", *[i.decode() for i in ids], check=False)
        # and their quota workspaces, still mounted
        with open("/proc/mounts") as mounts:
            points = [line.split()[1] for line in mounts if str(tmp_path) in line.split()[1]]
        for point in points:
            subprocess.run(["umount", "-l", point], check=False, capture_output=True)


def _local_losses(config: dict, tmp_path: Path) -> list[float]:
    """The same job on one host: 4 local processes."""
    path = tmp_path / "one-host.json"
    path.write_text(json.dumps(config))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "NNODES")}
    env["GPUMARKET_WORKSPACE"] = str(tmp_path / "one-host")
    out = subprocess.run(
        [sys.executable, "-m", "harness", "--config", str(path), "--nproc", "4"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    events = [json.loads(line) for line in out.stdout.splitlines() if line.strip()]
    return [e["loss"] for e in events if e.get("event") == "step"]


def _rent(user, *, node_count: int, gpus: int, runtime: RuntimeSpec) -> Rental:
    credit_customer(user)
    return rental_create(
        customer=user,
        team=personal_team(user),
        request=RentalRequest(
            gpus_per_node=gpus, node_count=node_count, duration_s=3600, region="dgang",
            runtime=runtime, network="internal",  # the engines run without iptables
        ),
    )  # fmt: skip


def _wait_end(stack: Stack, engines, rental: Rental, what: str) -> Rental:
    try:
        wait_for(
            lambda: Rental.objects.get(pk=rental.pk).status in (RentalStatus.COMPLETED,
                                                              RentalStatus.FAILED),
            420, what,
        )  # fmt: skip
    except AssertionError:
        for host, _, _ in engines:
            print(stack.log(f"agent-{host.hostname}")[-4000:])
        raise
    rental.refresh_from_db()
    if rental.status != RentalStatus.COMPLETED:
        # What each member printed: the rental's own tail is the last failing member's only.
        for run in ContainerRun.objects.filter(rental=rental):
            print(f"node {run.node_id} exit {run.exit_code}:\n{run.log_tail}")
    return rental


def _connects(argv_prefix: list[str], address: str, port: int) -> bool:
    """Whether a TCP connection to address:port opens from where `argv_prefix` runs python."""
    probe = (
        "import socket,sys\n"
        "try:\n"
        f"    socket.create_connection(({address!r}, {port}), timeout=3).close()\n"
        "except OSError as e:\n"
        "    print(e); sys.exit(1)\n"
    )
    done = subprocess.run(
        [*argv_prefix, "python3", "-c", probe], capture_output=True, text=True, timeout=60
    )
    return done.returncode == 0


def test_a_docker_gang_trains_one_job_over_its_private_network(
    docker_gang_stack, engines, user, tmp_path, object_store
):
    stack = docker_gang_stack
    # when a 2 x 2 GPU rental runs the harness in containers on the two hosts
    rental = _rent(user, node_count=2, gpus=2,
                   runtime=RuntimeSpec(image=HARNESS_IMAGE, harness_config=CONFIG))  # fmt: skip
    rental = _wait_end(stack, engines, rental, "the gang to finish")
    # then it completed as one job: both members ran and exited 0
    runs = ContainerRun.objects.filter(rental=rental)
    assert rental.status == RentalStatus.COMPLETED, (rental.status_reason, rental.log_tail)
    assert sorted(runs.values_list("exit_code", flat=True)) == [0, 0]
    # and the job had 4 ranks, data parallel over both hosts
    metrics = [m.data for m in RunMetric.objects.filter(rental=rental).order_by("pk")]
    [start] = [m for m in metrics if m.get("event") == "start"]
    assert start["world_size"] == 4
    assert start["layout"]["dp"] == 4
    # and its loss curve is the one-host curve of the same job
    steps = sorted((m["step"], m["loss"]) for m in metrics if m.get("event") == "step")
    assert [s for s, _ in steps] == list(range(1, STEPS + 1))
    assert [loss for _, loss in steps] == pytest.approx(_local_losses(CONFIG, tmp_path), rel=1e-5)
    # and one checkpoint set is in the bucket, the final step's, written once
    checkpoints = sorted(
        path
        for path in Artifact.objects.filter(rental=rental).values_list("path", flat=True)
        if path.startswith("checkpoints/")
    )
    assert checkpoints == [f"checkpoints/step_{STEPS:09d}.pt"]
    keys = [
        o["Key"]
        for o in object_store.list_objects_v2(Bucket=object_store.bucket).get("Contents", [])
        if str(rental.pk) in o["Key"] and "/checkpoints/" in o["Key"]
    ]
    assert len(keys) == 1 and keys[0].endswith(checkpoints[0]), keys
    # and the gang's network went with its runs: no VXLAN device is left on either host
    for host, _, _ in engines:
        wait_for(
            lambda h=host: "gpv-" not in subprocess.run(
                ["ip", "-n", h.ns, "link", "show"], capture_output=True, text=True
            ).stdout,
            60, f"the gang's device on {host.hostname} to go",
        )  # fmt: skip


REDUCED = re.compile(
    r'"event": "allreduce", "rank": (\d+), "world_size": (\d+), "sum": ([0-9.]+), '
    r'"master": "([0-9.]+)"'
)


def _reduced(rental: Rental, by_name: dict) -> list[tuple[int, int, float, str]]:
    """The all_reduce lines the members' containers printed so far (their own logs)."""
    rental.refresh_from_db()
    assert rental.status not in (RentalStatus.FAILED, RentalStatus.COMPLETED), rental.log_tail
    found = []
    for run in ContainerRun.objects.filter(rental=rental).select_related("node"):
        engine = by_name[run.node.hostname][2]
        logs = engine.docker("logs", container_name(run.run_id), check=False).stdout.decode()
        found += [(int(r), int(w), float(v), m) for r, w, v, m in REDUCED.findall(logs)]
    return found


def test_a_customer_torchrun_spans_the_gang_and_nothing_else_reaches_it(
    docker_gang_stack, engines, user
):
    stack = docker_gang_stack
    by_name = {host.hostname: (host, address, engine) for host, address, engine in engines}
    # given a third tenant's container on one of the hosts
    tenant = UserFactory()
    other = _rent(tenant, node_count=1, gpus=1,
                  runtime=RuntimeSpec(image=HARNESS_IMAGE, command=["sleep", "3600"]))  # fmt: skip
    wait_for(lambda: Rental.objects.get(pk=other.pk).status == RentalStatus.RUNNING, 180,
             "the other tenant's rental to run")  # fmt: skip
    [other_run] = ContainerRun.objects.filter(rental=other).select_related("node")
    _, _, other_engine = by_name[other_run.node.hostname]
    # when a customer command runs its own torchrun on a 2 x 2 rental
    rental = _rent(user, node_count=2, gpus=2,
                   runtime=RuntimeSpec(image=HARNESS_IMAGE, command=TORCHRUN_COMMAND))  # fmt: skip
    try:
        wait_for(lambda: len(_reduced(rental, by_name)) == 4, 300, "the 4 ranks' all_reduce")
    except AssertionError:
        for host, _, _ in engines:
            print(stack.log(f"agent-{host.hostname}")[-4000:])
        raise
    # then its 4 ranks formed one job across the hosts, on the gang's overlay addresses
    reduced = _reduced(rental, by_name)
    assert sorted(rank for rank, _, _, _ in reduced) == [0, 1, 2, 3]
    assert {(world, total) for _, world, total, _ in reduced} == {(4, 6.0)}
    [master] = {m for _, _, _, m in reduced}
    assert master == str(
        Gang.of(
            str(rental.pk), {"NNODES": "2", "NODE_RANK": "0", "GPUMARKET_GANG_ADDRS": "a,b"}
        ).address(0)
    )
    port = master_port(rental)
    runs = sorted(ContainerRun.objects.filter(rental=rental).select_related("node"),
                  key=lambda r: r.node_id)  # fmt: skip
    rank0, rank1 = (by_name[r.node.hostname] for r in runs)
    fabric_master = runs[0].node.fabric_address
    # the store listens: node rank 1's container reaches it (so a refusal below means something)
    member = ["docker", "-H", rank1[2].url, "exec", container_name(runs[1].run_id)]
    assert _connects(member, master, port)
    # and the third tenant's container cannot, on the overlay address nor the fabric address
    outsider = ["docker", "-H", other_engine.url, "exec", container_name(other_run.run_id)]
    assert not _connects(outsider, master, port)
    assert not _connects(outsider, fabric_master, port)
    # and neither can the hosts
    for host, _, _ in engines:
        on_host = ["ip", "netns", "exec", host.ns]
        assert not _connects(on_host, master, port), host.hostname
        assert not _connects(on_host, fabric_master, port), host.hostname
    # and the store still listens (the refusals were not a job that had ended)
    assert _connects(member, master, port)
    # when the job is let go, the rental completes
    rank0[2].docker("exec", container_name(runs[0].run_id), "touch", "/workspace/release")
    rental = _wait_end(stack, engines, rental, "the torchrun gang to finish")
    assert rental.status == RentalStatus.COMPLETED, (rental.status_reason, rental.log_tail)
    exits = ContainerRun.objects.filter(rental=rental).values_list("exit_code", flat=True)
    assert sorted(exits) == [0, 0]
