"""Fixtures for the runtime drivers: a real Docker Engine and the offline harness image.

Nothing is mocked and nothing skips: when no engine answers, deploy/docker-engine.sh installs and
starts one; when the image is missing, deploy/harness/build-offline.sh builds it (no registry).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import textwrap
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import docker
import pytest

from nodeagent.runtime.base import ContainerSpec, RuntimeDriver
from nodeagent.runtime.docker import DockerDriver, DockerDriverConfig
from nodeagent.runtime.process import LocalProcessDriver, ProcessDriverConfig

REPO = Path(__file__).resolve().parents[3]
IMAGE = os.environ.get("GPUMARKET_HARNESS_IMAGE", "gpumarket/harness:dev")


@pytest.fixture(scope="session")
def docker_host() -> str:
    """The engine's address; it is started (and installed) here when none answers."""
    proc = subprocess.run(
        [str(REPO / "deploy" / "docker-engine.sh")],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert proc.returncode == 0, f"docker-engine.sh failed:\n{proc.stderr}"
    host = proc.stdout.strip().splitlines()[-1]
    # The SDK clients built by the drivers and by these tests, and the docker CLI, read it.
    os.environ["DOCKER_HOST"] = host
    return host


@pytest.fixture(scope="session")
def harness_image(docker_host: str) -> str:
    proc = subprocess.run(
        [str(REPO / "deploy" / "harness" / "build-offline.sh")],
        capture_output=True,
        text=True,
        timeout=1800,
        env={**os.environ, "GPUMARKET_HARNESS_IMAGE": IMAGE},
        check=False,
    )
    assert proc.returncode == 0, f"build-offline.sh failed:\n{proc.stderr}"
    return IMAGE


@pytest.fixture(scope="session")
def docker_client(docker_host: str) -> Iterator[docker.DockerClient]:
    client = docker.from_env(version="auto", timeout=60)
    yield client
    client.close()


@pytest.fixture(scope="session")
def node_id() -> str:
    """A node id of this test session: the drivers only list what carries it."""
    return f"test-node-{uuid.uuid4().hex[:8]}"


@pytest.fixture(params=[pytest.param("docker", marks=pytest.mark.docker), "process"])
def driver_kind(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def make_driver(
    driver_kind: str, request: pytest.FixtureRequest, tmp_path: Path, node_id: str
) -> Callable[..., RuntimeDriver]:
    """A driver factory; a second call is a fresh driver over the same runtime, which is what an
    agent restart looks like."""
    if driver_kind == "docker":
        request.getfixturevalue("harness_image")
    state_dir = tmp_path / "state"

    def make(**overrides: Any) -> RuntimeDriver:
        if driver_kind == "docker":
            options = {"gpu_mode": "none", "node_id": node_id, "pull_policy": "never"}
            return DockerDriver(DockerDriverConfig(**{**options, **overrides}))
        options = {"state_dir": str(state_dir), "node_id": node_id}
        return LocalProcessDriver(ProcessDriverConfig(**{**options, **overrides}))

    return make


@pytest.fixture
def driver(make_driver: Callable[..., RuntimeDriver]) -> Iterator[RuntimeDriver]:
    instance = make_driver()
    yield instance
    for state in instance.list_managed():
        instance.remove(state.run_id)


@pytest.fixture
def docker_driver(harness_image: str, node_id: str) -> Iterator[DockerDriver]:
    instance = DockerDriver(
        DockerDriverConfig(gpu_mode="none", node_id=node_id, pull_policy="never")
    )
    yield instance
    for state in instance.list_managed():
        instance.remove(state.run_id)


@pytest.fixture(scope="session")
def volume_root() -> Iterator[Path]:
    """Where runs' workspaces go: a directory every uid can traverse (pytest's own temporary
    directories are 0700), as a real volume root is, so a command run as an unprivileged uid
    reaches its workspace by its path."""
    root = Path(tempfile.mkdtemp(prefix="gpumarket-volumes-"))
    root.chmod(0o711)
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def make_spec(volume_root: Path, node_id: str) -> Callable[..., ContainerSpec]:
    """A spec running a Python script (in the harness image, or on the host for the process
    driver: the same `python -c` works in both)."""

    def make(script: str = "print('hello')", **overrides: Any) -> ContainerSpec:
        run_id = overrides.pop("run_id", f"t-{uuid.uuid4().hex[:12]}")
        fields: dict[str, Any] = {
            "rental_id": str(uuid.uuid4()),
            "run_id": run_id,
            "node_id": node_id,
            "image": IMAGE,
            "command": ("python", "-c", textwrap.dedent(script)),
            "env": {},
            "gpu_indices": (0, 2),
            "gpu_uuids": (),
            "cpu_limit": 1.5,
            "memory_limit_mb": 256,
            "ports": (),
            "volume_dir": str(volume_root / f"vol-{run_id}"),
            "stop_grace_s": 5,
        }
        fields.update(overrides)
        return ContainerSpec(**fields)

    return make


def wait_for(predicate: Callable[[], Any], timeout_s: float = 30, what: str = "condition") -> Any:
    """Poll until predicate() is truthy and return its value."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.1)


def wait_exited(driver: RuntimeDriver, run_id: str, timeout_s: float = 30) -> Any:
    return wait_for(
        lambda: (state := driver.state(run_id)).status == "exited" and state,
        timeout_s,
        f"run {run_id} to exit",
    )


def collect_output(
    driver: RuntimeDriver, run_id: str, cursor: str | None, count: int, timeout_s: float = 30
) -> tuple[list[str], str]:
    """Call output_since until `count` lines arrived in total; returns them and the cursor."""
    lines: list[str] = []
    deadline = time.monotonic() + timeout_s
    while len(lines) < count:
        new, cursor = driver.output_since(run_id, cursor)
        lines.extend(new)
        if time.monotonic() > deadline:
            raise AssertionError(f"got only {lines!r} of {count} lines")
        if len(lines) < count:
            time.sleep(0.1)
    return lines, cursor
