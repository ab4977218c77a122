"""The agent's port publisher against real containers: a host port reaches a port inside a
container on a network with no route to the host, and stops doing so when the forward ends.

Entering a container's network namespace needs root, as the agent on a GPU host has it.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import textwrap
from pathlib import Path

import pytest

from agentprotocol import ContainerStatus, DesiredRun, PublishedPort
from nodeagent.publish import (
    Forward,
    PublishConfig,
    Publisher,
    PublishError,
    Wanted,
    preferred_port,
    wanted_ports,
)
from nodeagent.runtime.base import ContainerState
from nodeagent.runtime.docker import container_name
from tests.nodeagent.runtime.conftest import wait_for

pytestmark = [
    pytest.mark.docker,
    pytest.mark.skipif(os.geteuid() != 0, reason="entering a network namespace needs root"),
]

ECHO = textwrap.dedent(
    """
    import socket, threading
    server = socket.create_server(("127.0.0.1", 7000))
    def echo(conn):
        while data := conn.recv(65536):
            conn.sendall(data)
        conn.close()
    while True:
        conn, _ = server.accept()
        threading.Thread(target=echo, args=(conn,)).start()
    """
)


def free_range(size: int = 4) -> tuple[int, int]:
    """A run of ports nothing listens on now (the kernel's pick, then the ports above it)."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            first = probe.getsockname()[1]
        if first + size >= 65536:
            continue
        socks = []
        try:
            for port in range(first, first + size):
                s = socket.socket()
                s.bind(("127.0.0.1", port))
                socks.append(s)
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
        return first, first + size - 1
    raise AssertionError("no free port range")


def config(size: int = 4) -> PublishConfig:
    first, last = free_range(size)
    return PublishConfig(address="127.0.0.1", host="node.example", first_port=first, last_port=last)


@pytest.fixture
def isolated_container(docker_client, harness_image):
    """A container with no network at all but its own loopback, running `ECHO` on port 7000."""
    container = docker_client.containers.run(
        harness_image, ["python", "-c", ECHO], network_mode="none", detach=True,
        cap_drop=["ALL"], read_only=True, user="1000:1000",
    )  # fmt: skip
    try:
        container.reload()
        yield container
    finally:
        container.remove(force=True)


def netns_pid(container) -> int:
    container.reload()
    return container.attrs["State"]["Pid"]


def test_a_host_port_reaches_the_containers_loopback_and_closes_with_the_forward(
    isolated_container,
):
    # given a forward of the container's port 7000 (its loopback only; no network at all)
    pid = netns_pid(isolated_container)
    forward = Forward(config=config(), run_id="run-1", netns_pid=pid, container_port=7000)
    try:
        # when the echo server listens, the port is reported, and bytes go in and come back
        assert forward.wait_ready(30)
        assert forward.published() == PublishedPort(
            container_port=7000, host="node.example", host_port=forward.host_port
        )
        conn = socket.create_connection(("127.0.0.1", forward.host_port), timeout=10)
        payload = os.urandom(1 << 20)
        conn.sendall(payload)
        received = b""
        while len(received) < len(payload):
            received += conn.recv(65536)
        assert received == payload
    finally:
        # when the forward is closed
        forward.close()
    # then the open connection ends and the host port refuses new ones
    conn.settimeout(10)
    assert conn.recv(1) == b""
    conn.close()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", forward.host_port), timeout=10)


def test_a_port_nothing_listens_on_is_not_reported_and_its_connections_are_closed(
    isolated_container,
):
    pid = netns_pid(isolated_container)
    publisher = Publisher(config())
    try:
        publisher.reconcile({"run-1": Wanted(netns_pid=pid, ports=(7000, 7001))})
        wait_for(lambda: publisher.published("run-1"), 30, "port 7000 to be published")
        # port 7001 has no listener inside: not reported, and a client is closed at once
        [published] = publisher.published("run-1")
        assert published.container_port == 7000
        [other] = [f for key, f in publisher._forwards.items() if key == ("run-1", 7001)]
        conn = socket.create_connection(("127.0.0.1", other.host_port), timeout=10)
        assert conn.recv(1) == b""
        conn.close()

        # when the run no longer wants ports (it stopped): everything is closed
        publisher.reconcile({})
        assert publisher.published("run-1") == ()
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", published.host_port), timeout=10)
    finally:
        publisher.close()


def test_a_process_that_is_gone_publishes_nothing():
    # a pid with no process behind it: the namespace cannot be entered
    publisher = Publisher(config())
    try:
        publisher.reconcile({"run-1": Wanted(netns_pid=2**22 + 7, ports=(22,))})
        [forward] = publisher._forwards.values()
        wait_for(lambda: forward.error, 10, "the forward to fail")
        assert publisher.published("run-1") == ()
    finally:
        publisher.close()


def test_ports_are_taken_from_the_range_and_a_full_range_is_refused():
    cfg = config(size=2)
    start = preferred_port(cfg, "run-1", 22)
    assert cfg.first_port <= start <= cfg.last_port
    assert preferred_port(cfg, "run-1", 22) == start  # the same after a restart
    held = [
        socket.create_server(("127.0.0.1", port))
        for port in range(cfg.first_port, cfg.last_port + 1)
    ]
    try:
        with pytest.raises(PublishError, match="no free port"):
            Forward(config=cfg, run_id="run-1", netns_pid=os.getpid(), container_port=22)
    finally:
        for sock in held:
            sock.close()


def test_only_running_desired_runs_with_ports_are_wanted():
    def desired(run_id: str, ports: tuple[int, ...]) -> DesiredRun:
        return DesiredRun(
            rental_id="r", run_id=run_id, image="i", command=(), env={}, gpu_indices=(0,),
            gpu_uuids=(), cpu_limit=1, memory_limit_mb=64, ports=ports,
        )  # fmt: skip

    def state(run_id: str, status: ContainerStatus, pid: int | None) -> ContainerState:
        return ContainerState(
            rental_id="r", run_id=run_id, status=status, exit_code=None, started_at=1.0,
            finished_at=None, ports={}, netns_pid=pid,
        )  # fmt: skip

    wanted = wanted_ports(
        [desired("a", (22,)), desired("b", (22,)), desired("c", ()), desired("d", (22, 8888))],
        [
            state("a", ContainerStatus.RUNNING, 100),
            state("b", ContainerStatus.EXITED, None),
            state("c", ContainerStatus.RUNNING, 300),
            state("d", ContainerStatus.RUNNING, 400),
        ],
    )
    assert wanted == {
        "a": Wanted(netns_pid=100, ports=(22,)),
        "d": Wanted(netns_pid=400, ports=(22, 8888)),
    }


# -- SSH into a run started by the Docker driver -------------------------------------------------


def ssh(key: Path, port: int, command: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["ssh", "-i", str(key), "-p", str(port), "-o", "BatchMode=yes",
         "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
         "-o", "ConnectTimeout=10", "-o", "IdentitiesOnly=yes", "harness@127.0.0.1", command],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


def keypair(path: Path) -> str:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True)
    return path.with_suffix(".pub").read_text().strip()


def test_ssh_into_a_docker_run_with_its_key_only(docker_driver, docker_client, make_spec, tmp_path):
    assert shutil.which("ssh"), "the OpenSSH client is missing: run the README's test command"
    # given a run that asks for SSH with one key, on an internal network
    allowed = keypair(tmp_path / "allowed")
    keypair(tmp_path / "other")
    spec = make_spec("import time; time.sleep(600)", ports=(22,), ssh_authorized_keys=(allowed,))
    state = docker_driver.start(spec)
    publisher = Publisher(config())
    try:
        publisher.reconcile({spec.run_id: Wanted(netns_pid=state.netns_pid, ports=(22,))})
        [published] = wait_for(lambda: publisher.published(spec.run_id), 60, "sshd to listen")

        # when the holder of the key runs a command: it runs inside the run's container
        command = "hostname; id -u; echo $GPUMARKET_RUN_ID"
        done = ssh(tmp_path / "allowed", published.host_port, command)
        container = docker_client.containers.get(container_name(spec.run_id))
        assert done.returncode == 0, done.stderr
        assert done.stdout.split() == [container.attrs["Config"]["Hostname"], "1000", spec.run_id]

        # and another key is refused
        refused = ssh(tmp_path / "other", published.host_port, "hostname")
        assert refused.returncode == 255
        assert "Permission denied (publickey)" in refused.stderr
    finally:
        publisher.close()
