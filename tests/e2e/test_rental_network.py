"""A rental's network on an engine that really filters packets.

A GPU host in a network namespace of its own runs a Docker Engine that manages iptables (NAT,
DOCKER-USER), as a stock dockerd does; the node agent's Docker driver runs beside it, in the
same namespace, and starts real rental containers from real run specs. A second namespace is
the world the host's one link leads to: a server at 203.0.113.10 stands for the internet, the
same server answers at 10.77.0.1 and 192.168.77.1 (the provider's LAN) and at 169.254.169.254
(cloud metadata), and the host listens on all its own addresses.

Then: the agent's probe says the host can filter; a rental with `internet` reaches the internet
server and nothing else (not the host on its LAN address or its rental bridges' gateways, not
the private ranges, not the metadata address, not another rental's container on the same
host), while the host itself reaches every one of them (they are up), and a container on the
same kind of network reaches them once the agent's rules are taken away (what stops the rental
is the filter, not the engine's defaults); a rental with `internal` reaches nothing at all.
The driver runs in a subprocess entering the host's namespace (its iptables are the ones the
driver must manage), as the agent would run there; the server and the agent's reconcile loop
are not in it (tests/e2e/test_gang_docker.py drives those against per-namespace engines).

Needs root (network namespaces, a Docker Engine per namespace); the engine and namespaces are
removed even when the test fails. Names start with `gpmnet`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.e2e.conftest import HARNESS_IMAGE, ROOT, wait_for
from tests.e2e.test_gang_docker import Engine
from tests.e2e.test_multihost import _namespaces_possible

pytestmark = pytest.mark.e2e

PORT = 8080
METADATA_PORT = 80
INTERNET = "203.0.113.10"  # TEST-NET-3: stands for any public address
LAN_GATEWAY = "10.77.0.1"  # the provider's router, and a server on the LAN
LAN_OTHER = "192.168.77.1"  # another private range on the LAN
METADATA = "169.254.169.254"
HOST_LAN = "10.77.0.2"  # the GPU host's own address

# Answers every connection with the address it was made to, on each address of the namespace.
ECHO_SERVER = """
import socket, sys, threading
def serve(port):
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("0.0.0.0", port))
    listener.listen(64)
    while True:
        conn, _ = listener.accept()
        conn.sendall(conn.getsockname()[0].encode())
        conn.close()
ports = [int(p) for p in sys.argv[1:]]
for port in ports[1:]:
    threading.Thread(target=serve, args=(port,), daemon=True).start()
serve(ports[0])
"""

# Inside a rental: try each target of $TARGETS (a JSON list of [name, address, port]) and print
# one JSON line per target: whether it connected, and the error otherwise.
PROBE = """
import json, os, socket
for name, address, port in json.loads(os.environ["TARGETS"]):
    try:
        with socket.create_connection((address, port), timeout=3) as conn:
            conn.settimeout(3)
            result = {"ok": True, "answer": conn.recv(64).decode()}
    except OSError as exc:
        result = {"ok": False, "error": str(exc)}
    print(json.dumps({"target": name, "address": address, **result}), flush=True)
print(json.dumps({"done": True}), flush=True)
"""

# Run by the test inside the host's namespace, as the agent runs there: the driver's probe,
# then a listening rental, a rental with internet and one internal, each probing the targets.
DRIVER_SCRIPT = """
import json, socket, sys, time, uuid
from agentprotocol import Network
from nodeagent.runtime.base import ContainerSpec
from nodeagent.runtime.docker import (
    DockerDriver, DockerDriverConfig, container_name, internet_filter_unavailable, network_name,
)
url, image, volumes, probe, echo, port = sys.argv[1:7]
targets = json.loads(sys.argv[7])
print(json.dumps({"unavailable": internet_filter_unavailable()}), flush=True)
driver = DockerDriver(DockerDriverConfig(
    base_url=url, gpu_mode="none", node_id="gpmnet", pull_policy="never"))
client = driver._client()

def spec(name, network, command, env=None):
    run_id = f"gpmnet-{name}-{uuid.uuid4().hex[:8]}"
    return ContainerSpec(
        rental_id=str(uuid.uuid4()), run_id=run_id, node_id="gpmnet", image=image,
        command=tuple(command), env=env or {}, gpu_indices=(0,), gpu_uuids=(), cpu_limit=1,
        memory_limit_mb=256, ports=(), volume_dir=f"{volumes}/{run_id}", stop_grace_s=1,
        network=network)

def gateway_and_address(s):
    net = client.networks.get(network_name(s.rental_id)).attrs
    container = client.containers.get(container_name(s.run_id)).attrs
    address = container["NetworkSettings"]["Networks"][network_name(s.rental_id)]["IPAddress"]
    return net["IPAM"]["Config"][0]["Gateway"], address

neighbour = spec("neighbour", Network.INTERNET, ["python3", "-c", echo, port])
driver.start(neighbour)
for _ in range(100):
    if driver.state(neighbour.run_id).status == "running":
        break
    time.sleep(0.1)
neighbour_gateway, neighbour_address = gateway_and_address(neighbour)
targets += [["neighbour rental", neighbour_address, int(port)],
            ["neighbour bridge gateway", neighbour_gateway, int(port)]]
answer = None
for _ in range(50):  # the host itself reaches the neighbour: it is up and listening
    try:
        with socket.create_connection((neighbour_address, int(port)), timeout=3) as conn:
            answer = conn.recv(64).decode()
            break
    except OSError:
        time.sleep(0.2)
print(json.dumps({"neighbour": neighbour_address, "from_host": answer}), flush=True)
probes = {}
for network in (Network.INTERNET, Network.INTERNAL):
    probes[network] = spec(network.value, network, ["python3", "-c", probe])
    driver.start(probes[network])
    gateway, _ = gateway_and_address(probes[network])
    own = [*targets, ["own bridge gateway", gateway, int(port)]]
    driver.remove(probes[network].run_id)
    probes[network] = spec(network.value, network, ["python3", "-c", probe],
                           env={"TARGETS": json.dumps(own)})
    driver.start(probes[network])
for network, s in probes.items():
    cursor, lines = None, []
    deadline = time.time() + 120
    while not any('"done"' in line for line in lines) and time.time() < deadline:
        new, cursor = driver.output_since(s.run_id, cursor)
        lines += new
        time.sleep(0.2)
    for line in lines:
        print(json.dumps({"network": network.value, **json.loads(line)}), flush=True)
# The control: without the agent's two jumps, a container on an internet network reaches the
# LAN, the metadata address and the host (the engine's own rules let it): the filter stops them.
import subprocess
for parent, chain in (("DOCKER-USER", "GPUMARKET-EGRESS"), ("INPUT", "GPUMARKET-HOST")):
    subprocess.run(["iptables", "-w", "5", "-D", parent, "-i", "gpm-+", "-j", chain], check=True)
control = client.containers.run(
    image, ["python3", "-c", probe], network=network_name(neighbour.rental_id), remove=True,
    user="1000:1000", environment={"TARGETS": json.dumps(targets[:5])})
for line in control.decode().splitlines():
    print(json.dumps({"network": "unfiltered", **json.loads(line)}), flush=True)
for s in (*probes.values(), neighbour):
    driver.remove(s.run_id)
"""


def _ip(*args: str, ns: str | None = None) -> None:
    prefix = ["ip", "netns", "exec", ns] if ns else []
    subprocess.run([*prefix, "ip", *args], check=True, capture_output=True, timeout=30)


class Place:
    """A network namespace the test makes (`ns`), named for the Engine helper (`hostname`)."""

    def __init__(self, role: str):
        self.ns = f"gpmnet{role}{os.getpid() % 100000}"
        self.hostname = self.ns

    def run(self, *argv: str, **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(["ip", "netns", "exec", self.ns, *argv], **kwargs)


@pytest.fixture(scope="module")
def filtering_host(tmp_path_factory):
    """(host, engine, world): the GPU host with an iptables-managing engine holding the harness
    image, and the world behind its one link, serving on every address there."""
    reason = _namespaces_possible()
    if reason:
        pytest.skip(reason)
    for tool in ("dockerd", "nsenter", "iptables", "iptables-restore"):
        if shutil.which(tool) is None:
            pytest.skip(f"an engine that filters packets needs {tool}")
    host, world = Place("h"), Place("w")
    outer, inner = f"gpmnetw{os.getpid() % 100000}", f"gpmneth{os.getpid() % 100000}"
    engine = Engine(host, Path(f"/tmp/gpmnet-{os.getpid()}"), iptables=True)
    servers: list[subprocess.Popen] = []
    try:
        for place in (host, world):
            _ip("netns", "add", place.ns)
            _ip("link", "set", "lo", "up", ns=place.ns)
        _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
        _ip("link", "set", outer, "netns", world.ns)
        _ip("link", "set", inner, "netns", host.ns)
        _ip("addr", "add", f"{LAN_GATEWAY}/24", "dev", outer, ns=world.ns)
        _ip("link", "set", outer, "up", ns=world.ns)
        for address in (INTERNET, LAN_OTHER, METADATA):
            _ip("addr", "add", f"{address}/32", "dev", "lo", ns=world.ns)
        _ip("addr", "add", f"{HOST_LAN}/24", "dev", inner, ns=host.ns)
        _ip("link", "set", inner, "up", ns=host.ns)
        _ip("route", "add", "default", "via", LAN_GATEWAY, ns=host.ns)
        for place, ports in ((world, (PORT, METADATA_PORT)), (host, (PORT,))):
            argv = ["ip", "netns", "exec", place.ns, sys.executable, "-c", ECHO_SERVER]
            servers.append(
                subprocess.Popen(
                    [*argv, *map(str, ports)],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
        engine.start()
        engine.load(HARNESS_IMAGE)
        yield host, engine, world
    finally:
        for server in servers:
            server.kill()
            server.wait(10)
        engine.stop()
        for place in (host, world):
            subprocess.run(["ip", "netns", "del", place.ns], check=False, capture_output=True)


def _connects_from(place: Place, address: str, port: int) -> str | None:
    """The answer of the server at address:port seen from a namespace, or None."""
    script = textwrap.dedent(PROBE)
    done = place.run(
        sys.executable, "-c", script, capture_output=True, text=True, timeout=60, check=False,
        env={**os.environ, "TARGETS": json.dumps([["t", address, port]])},
    )  # fmt: skip
    result = json.loads(done.stdout.splitlines()[0])
    return result["answer"] if result["ok"] else None


TARGETS = [
    ["internet", INTERNET, PORT],
    ["LAN server", LAN_GATEWAY, PORT],
    ["LAN 192.168", LAN_OTHER, PORT],
    ["metadata", METADATA, METADATA_PORT],
    ["host LAN address", HOST_LAN, PORT],
]


def test_an_internet_rental_reaches_the_internet_and_nothing_else(filtering_host):
    host, engine, _ = filtering_host
    volumes = Path(f"/tmp/gpmnet-vol-{os.getpid()}")
    volumes.mkdir(mode=0o711, exist_ok=True)
    try:
        # given the targets are up: the host itself reaches each of them
        wait_for(lambda: _connects_from(host, INTERNET, PORT), 30, "the world's server")
        for _, address, port in TARGETS:
            assert _connects_from(host, address, port) == address

        # when the agent's driver, in the host's namespace, starts a listening rental and a
        # rental of each network kind probing every target
        done = subprocess.run(
            ["nsenter", f"--net=/var/run/netns/{host.ns}", sys.executable, "-c", DRIVER_SCRIPT,
             engine.url, HARNESS_IMAGE, str(volumes), textwrap.dedent(PROBE), ECHO_SERVER,
             str(PORT), json.dumps(TARGETS)],
            capture_output=True, text=True, timeout=400, cwd=ROOT, check=False,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )  # fmt: skip
    finally:
        shutil.rmtree(volumes, ignore_errors=True)
    assert done.returncode == 0, done.stderr[-3000:]
    events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]

    # then the agent's probe finds the host able to filter (what it declares at join)
    assert events[0] == {"unavailable": None}
    # and the host reaches the neighbour rental: it is up
    [neighbour] = [e for e in events if "neighbour" in e]
    assert neighbour["from_host"] == neighbour["neighbour"]
    results = {(e["network"], e["target"]): e for e in events if "network" in e and "target" in e}
    names = [name for name, _, _ in TARGETS] + [
        "neighbour rental", "neighbour bridge gateway", "own bridge gateway"
    ]  # fmt: skip
    reached = {
        network: sorted(name for name in names if results[network, name]["ok"])
        for network in ("internet", "internal")
    }
    # the internet rental reaches the internet server, and it answers at its public address
    assert reached["internet"] == ["internet"]
    assert results["internet", "internet"]["answer"] == INTERNET
    # the blocked ones are dropped (a timeout), not refused by a listener nobody runs
    for name in names[1:]:
        assert "timed out" in results["internet", name]["error"], results["internet", name]
    # while with the agent's rules taken away the same network reaches all of them
    unfiltered = {name for (network, name), e in results.items() if network == "unfiltered"}
    assert unfiltered == {name for name, _, _ in TARGETS}
    assert all(results["unfiltered", name]["ok"] for name in unfiltered)
    # the internal rental reaches nothing at all
    assert reached["internal"] == []
    assert {name for network, name in results if network == "internal"} == set(names)
