"""Shared fixtures for the harness tests: real subprocesses of ``python -m harness``.

The harness is a plain PyTorch program, so these tests need no Django settings and no database.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]

# Variables that would make a child think it is part of someone else's job or change its output.
_SCRUBBED = (
    "WORLD_SIZE",
    "RANK",
    "LOCAL_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "HARNESS_PEAK_TFLOPS",
    "HARNESS_CHECKPOINT_DIR",
)


def harness_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _SCRUBBED}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


def parse_events(stdout: str) -> list[dict[str, Any]]:
    """Every stdout line must be one JSON object: that is the contract with the node agent."""
    return [json.loads(line) for line in stdout.splitlines() if line.strip()]


class HarnessProcess:
    """A running ``python -m harness`` whose stdout events are read on a background thread."""

    def __init__(self, args: list[str], tmp_path: Path, env: dict[str, str] | None = None) -> None:
        self.stderr_path = tmp_path / f"stderr-{time.monotonic_ns()}.log"
        self._stderr = self.stderr_path.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "harness", *args],
            cwd=REPO_ROOT,
            env=env or harness_env(),
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
        )
        self.events: list[dict[str, Any]] = []
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def wait_for(self, predicate: Callable[[dict[str, Any]], bool], timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self._lines.get(timeout=0.2)
            except queue.Empty:
                continue
            if line is None:
                break
            event = json.loads(line)
            self.events.append(event)
            if predicate(event):
                return event
        raise AssertionError(f"no matching event; stderr:\n{self.stderr()}")

    def finish(self, timeout: float) -> int:
        code = self.proc.wait(timeout=timeout)
        while (line := self._lines.get(timeout=timeout)) is not None:
            self.events.append(json.loads(line))
        self._stderr.close()
        return code

    def stderr(self) -> str:
        self._stderr.flush()
        return self.stderr_path.read_text()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._stderr.close()


@pytest.fixture
def clean_env() -> dict[str, str]:
    """The environment for a harness child process: repo importable, no inherited job."""
    return harness_env()


@pytest.fixture
def start_harness(tmp_path: Path):
    """Start ``python -m harness ARGS``; every process is killed at teardown if still running."""
    started: list[HarnessProcess] = []

    def start(args: list[str], env: dict[str, str] | None = None) -> HarnessProcess:
        process = HarnessProcess(args, tmp_path, env)
        started.append(process)
        return process

    yield start
    for process in started:
        process.kill()


@pytest.fixture
def run_harness(start_harness):
    """Run ``python -m harness ARGS`` to completion: (exit status, events, stderr)."""

    def run(args: list[str], timeout: float = 120, env: dict[str, str] | None = None):
        process = start_harness(args, env)
        code = process.finish(timeout)
        return code, process.events, process.stderr()

    return run


@pytest.fixture
def write_config(tmp_path: Path):
    """Write a config mapping to a JSON (default) or YAML file and return its path."""

    def write(config: dict[str, Any], name: str = "config.json") -> Path:
        path = tmp_path / name
        if path.suffix == ".json":
            path.write_text(json.dumps(config))
        else:
            import yaml

            path.write_text(yaml.safe_dump(config))
        return path

    return write
