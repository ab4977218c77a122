"""The node benchmark the server asks for (`run_benchmark: true`): measured, not declared TFLOPS.

The benchmark is the platform's: the server's answer names the harness image, the command run
in it and the GPUs (agentprotocol.BenchmarkSpec), and nothing the host configures changes them
(`--benchmark-command` is ignored; it is still accepted so that old unit files start). On the
Docker runtime it runs `docker run --rm --network none --gpus device=... IMAGE COMMAND`; on the
local-process runtime (no image) the command runs as a host subprocess with the harness the
agent ships with, on the named GPUs (CUDA_VISIBLE_DEVICES). An older server that names no spec
gets DEFAULT_COMMAND. It runs in a background thread so heartbeats go on meanwhile, with a
timeout. The harness prints its result as one JSON line on stdout; that object is sent under
`benchmark` in the next heartbeat, and the server checks it against the card's band.

A failed run (non-zero exit, timeout, no usable JSON) is logged and not sent: the server refuses
a result without a positive `matmul_tflops`, and a refused heartbeat would hold up usage reports.
It is retried when the server asks again after a cool-down.

A node of simulated GPUs has no card to measure: its runner is given `simulated` (the simulated
telemetry's figure for its card, marked `simulated: true`) and runs no command; the server
believes such a result only from a node that joined as simulated.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from agentprotocol import BenchmarkSpec

logger = logging.getLogger(__name__)

DEFAULT_COMMAND = ("python", "-m", "harness", "benchmark", "--quick")
# The directory holding the `provisioning` and `harness` packages (a checkout or site-packages).
_PACKAGES_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def benchmark_env(*, gpu_mode: str, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The agent's environment, with the harness importable and fake GPUs hidden from CUDA."""
    env = dict(os.environ if base is None else base)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGES_ROOT, env.get("PYTHONPATH")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    if gpu_mode == "none":
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def benchmark_command(
    spec: BenchmarkSpec | None, *, runtime: str
) -> tuple[list[str], dict[str, str]]:
    """The command line that runs the platform's benchmark, and what it adds to the
    environment; built from the server's spec only."""
    command = list(spec.command if spec is not None else DEFAULT_COMMAND)
    indices = ",".join(str(i) for i in spec.gpu_indices) if spec is not None else ""
    if runtime == "docker" and spec is not None:
        gpus = f"device={indices}" if indices else "all"
        return ["docker", "run", "--rm", "--network", "none", "--gpus", gpus, spec.image,
                *command], {}  # fmt: skip
    if command and command[0] in ("python", "python3"):
        command[0] = sys.executable  # the agent's interpreter, which has the harness
    return command, ({"CUDA_VISIBLE_DEVICES": indices} if indices else {})


def parse_result(stdout: str) -> dict[str, Any]:
    """The last stdout line that is a JSON object with a positive matmul_tflops."""
    for line in reversed(stdout.splitlines()):
        try:
            result = json.loads(line)
        except ValueError:
            continue
        if isinstance(result, dict):
            tflops = result.get("matmul_tflops")
            if isinstance(tflops, int | float) and not isinstance(tflops, bool) and tflops > 0:
                return result
            raise ValueError(f"result without a positive matmul_tflops: {line[:300]}")
    raise ValueError("no JSON result line on stdout")


class BenchmarkRunner:
    """At most one benchmark at a time; its result waits until a heartbeat delivered it."""

    def __init__(
        self,
        *,
        runtime: str,
        env: Mapping[str, str],
        timeout_s: float = 900.0,
        retry_after_s: float = 1800.0,
        clock: Callable[[], float] = time.monotonic,
        simulated: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        """`simulated`: on a node of simulated GPUs, what gives its result instead of the
        command (nodeagent.telemetry.simulated.simulated_benchmark)."""
        self.runtime = runtime
        self.command: list[str] = []
        self.env = dict(env)
        self._run_env = self.env
        self.timeout_s = timeout_s
        self.retry_after_s = retry_after_s
        self._clock = clock
        self._simulated = simulated
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._result: dict[str, Any] | None = None
        self._not_before = 0.0

    def request(self, spec: BenchmarkSpec | None = None) -> bool:
        """Start the platform's benchmark (`spec`, from the server) unless one is running, a
        result is waiting, or the last one failed recently; True when one was started."""
        with self._lock:
            busy = self._thread is not None and self._thread.is_alive()
            if busy or self._result is not None or self._clock() < self._not_before:
                return False
            command, extra_env = benchmark_command(spec, runtime=self.runtime)
            self.command, self._run_env = command, {**self.env, **extra_env}
            self._thread = threading.Thread(target=self._run, name="benchmark", daemon=True)
            self._thread.start()
        what = "the simulated card's figure" if self._simulated else " ".join(self.command)
        logger.info("benchmark started", extra={"command": what})
        return True

    def result(self) -> dict[str, Any] | None:
        """The result waiting to be sent, if any."""
        with self._lock:
            return self._result

    def delivered(self) -> None:
        """The server received the result."""
        with self._lock:
            self._result = None

    def wait(self, timeout_s: float | None = None) -> None:
        """Wait for a running benchmark to finish."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout_s)

    def _run(self) -> None:
        try:
            result = self._simulated_result() if self._simulated else self._measured_result()
        except (OSError, ValueError, subprocess.TimeoutExpired) as exc:
            logger.error("benchmark failed", extra={"error": str(exc)})
            with self._lock:
                self._not_before = self._clock() + self.retry_after_s
            return
        logger.info(
            "benchmark finished",
            extra={"matmul_tflops": result["matmul_tflops"], "simulated": bool(self._simulated)},
        )
        with self._lock:
            self._result = result

    def _simulated_result(self) -> dict[str, Any]:
        assert self._simulated is not None
        # Through the same check as a measured result: the server gets one shape either way.
        return parse_result(json.dumps(self._simulated()))

    def _measured_result(self) -> dict[str, Any]:
        proc = subprocess.run(
            self.command,
            capture_output=True,
            text=True,
            timeout=self.timeout_s,
            env=self._run_env,
            stdin=subprocess.DEVNULL,
            check=False,
        )
        if proc.returncode != 0:
            raise ValueError(f"exit code {proc.returncode}: {proc.stderr[-2000:]}")
        return parse_result(proc.stdout)
