"""Helpers for the harness tests: real ``python -m harness`` subprocesses and event filters."""

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

REPO_ROOT = Path(__file__).resolve().parents[2]

# Variables that would make a child think it is part of someone else's job or change its output.
_SCRUBBED = (
    "WORLD_SIZE",
    "RANK",
    "LOCAL_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "NNODES",
    "NODE_RANK",
    "NPROC_PER_NODE",
    "HARNESS_PEAK_TFLOPS",
    "HARNESS_CHECKPOINT_DIR",
    "GPUMARKET_WORKSPACE",
    "GPUMARKET_DATA_DIR",
    "GPUMARKET_SIMULATED_GPUS",
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
        env = dict(env or harness_env())
        # The run's output (final model, logs) goes to the test's directory, not the checkout.
        env.setdefault("GPUMARKET_WORKSPACE", str(tmp_path / "workspace"))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "harness", *args],
            cwd=REPO_ROOT,
            env=env,
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
        if not self._stderr.closed:
            self._stderr.flush()
        return self.stderr_path.read_text()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._stderr.close()


def losses(events: list[dict[str, Any]]) -> list[float]:
    return [e["loss"] for e in events if e["event"] == "step"]


def of_kind(events: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [e for e in events if e["event"] == kind]
