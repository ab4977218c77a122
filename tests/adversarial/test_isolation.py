# ruff: noqa: F811 - the runtime tests' fixtures are imported, then requested by name
"""Two rentals' containers on one node, on a real Docker Engine: neither reaches the other, the
host or the LAN; a full disk is the filler's own; nobody is root.

Driven through the Docker driver with the settings the agent uses (internal network policy, a
64 MiB workspace quota); the containers run the offline harness image (it has python3).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import threading
import uuid
from collections.abc import Iterator

import pytest

from nodeagent.runtime.docker import DockerDriver, DockerDriverConfig, container_name
from tests.nodeagent.runtime.conftest import (  # noqa: F401 - fixtures of the runtime tests
    collect_output,
    docker_client,
    docker_host,
    harness_image,
    make_spec,
    node_id,
    volume_root,
    wait_exited,
)

pytestmark = pytest.mark.docker

QUOTA_MB = 64

LISTENER = """
import os, socket, time
server = socket.socket()
server.bind(("0.0.0.0", 9000))
server.listen()
print("listening", flush=True)
while not os.path.exists("/workspace/write-now"):
    time.sleep(0.1)
with open("/workspace/after-neighbour-filled", "wb") as f:
    f.write(b"x" * 4 * 1024 * 1024)
print("wrote", flush=True)
time.sleep(600)
"""

PROBER = """
import errno, json, os, socket
results = {}
for host, port in json.loads(os.environ["TARGETS"]):
    s = socket.socket()
    s.settimeout(2)
    try:
        s.connect((host, port))
        results[f"{host}:{port}"] = "connected"
    except OSError as exc:
        results[f"{host}:{port}"] = type(exc).__name__
    finally:
        s.close()
print(json.dumps(results), flush=True)
written = 0
try:
    with open("/workspace/fill", "wb") as f:
        while True:
            f.write(b"\\0" * 1024 * 1024)
            f.flush()
            os.fsync(f.fileno())
            written += 1
except OSError as exc:
    print(errno.errorcode[exc.errno], written, flush=True)
lines = open("/proc/self/status").read().splitlines()
status = dict(l.split(":\\t", 1) for l in lines if ":\\t" in l)
print(os.getuid(), status["CapEff"].strip(), flush=True)
try:
    open("/etc/written-by-tenant", "w")
    print("rootfs writable", flush=True)
except OSError as exc:
    print(errno.errorcode[exc.errno], flush=True)
"""


def host_ipv4_addresses() -> list[str]:
    out = subprocess.run(
        ["ip", "-4", "-o", "addr", "show"], capture_output=True, text=True, check=True
    ).stdout
    return [line.split()[3].split("/")[0] for line in out.splitlines()]


@pytest.fixture
def host_server() -> Iterator[int]:
    """A TCP service of the host on every address: what a tenant must never reach."""
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("0.0.0.0", 0))
    server.listen()
    server.settimeout(0.2)
    accepted: list[str] = []
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, peer = server.accept()
            except TimeoutError:
                continue
            accepted.append(peer[0])
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield server.getsockname()[1]
    stop.set()
    thread.join()
    server.close()
    assert accepted == []  # nothing connected, whatever the prober reported


@pytest.fixture
def driver(harness_image, node_id) -> Iterator[DockerDriver]:
    instance = DockerDriver(
        DockerDriverConfig(
            gpu_mode="none", node_id=node_id, pull_policy="never", disk_quota_mb=QUOTA_MB
        )
    )
    yield instance
    for state in instance.list_managed():
        instance.remove(state.run_id)


def test_two_rentals_cannot_reach_each_other_the_host_or_the_lan_and_fill_only_their_disk(
    driver, docker_client, make_spec, host_server, volume_root
):
    assert driver.enforces_disk_quota  # root, mkfs.ext4: what this suite runs with

    def workspace() -> dict:
        """A rental's workspace where the agent makes it: named after the rental (the driver
        unmounts and deletes only workspaces its agent made)."""
        rental_id = str(uuid.uuid4())
        return {"rental_id": rental_id, "volume_dir": str(volume_root / rental_id)}

    # given rental A listening on a port, on its own network
    a = make_spec(LISTENER, **workspace())
    driver.start(a)
    collect_output(driver, a.run_id, None, 1)
    attrs = docker_client.containers.get(container_name(a.run_id)).attrs
    [(_, a_net)] = attrs["NetworkSettings"]["Networks"].items()
    a_ip, a_gateway = a_net["IPAddress"], a_net["Gateway"]
    assert a_ip

    # and rental B, which tries A's listener, the host's service on each of its addresses and
    # A's gateway, the metadata address and a LAN neighbour, then fills its own disk
    targets = [(a_ip, 9000), (a_gateway, host_server), ("169.254.169.254", 80)]
    targets += [(ip, host_server) for ip in host_ipv4_addresses()]
    targets += [("192.168.1.1", 80), ("10.0.0.1", 80), ("1.1.1.1", 443)]
    b = make_spec(PROBER, env={"TARGETS": json.dumps(targets)}, **workspace())
    driver.start(b)
    state = wait_exited(driver, b.run_id, timeout_s=180)
    reached, filled, identity, rootfs = driver.output_since(b.run_id, None)[0]

    # then B reached nothing at all
    results = json.loads(reached)
    assert len(results) == len(set(targets))
    assert [t for t, outcome in results.items() if outcome == "connected"] == []
    # and its disk ended at its quota (less ext4's journal and tables), not the host's
    code, megabytes = filled.split()
    assert code == "ENOSPC"
    assert QUOTA_MB // 2 <= int(megabytes) < QUOTA_MB
    assert state.exit_code == 0
    # and it ran unprivileged on a read-only root
    uid, capabilities = identity.split()
    assert uid != "0" and capabilities == "0000000000000000"
    assert rootfs == "EROFS"

    # when A writes after its neighbour filled its disk: A's own quota is untouched
    open(os.path.join(a.volume_dir, "write-now"), "w").close()
    lines, _ = collect_output(driver, a.run_id, None, 2)
    assert lines == ["listening", "wrote"]
    assert os.path.getsize(os.path.join(a.volume_dir, "after-neighbour-filled")) == 4 << 20

    # and each rental has a network of its own, gone with its last container
    b_attrs = docker_client.containers.get(container_name(b.run_id)).attrs
    assert set(b_attrs["NetworkSettings"]["Networks"]) != set(attrs["NetworkSettings"]["Networks"])
    driver.remove(b.run_id)
    assert not os.path.ismount(b.volume_dir)
    assert os.path.ismount(a.volume_dir)
    networks = {n.name for n in docker_client.networks.list()}
    assert f"gpumarket-net-{b.rental_id}" not in networks
    assert f"gpumarket-net-{a.rental_id}" in networks
