"""A small process supervisor for the one-command stack: a child that dies is restarted.

Each child runs in its own session, so a child killed hard does not leave its own children (a
Celery worker's pool processes) holding ports or consuming the queue: the whole group is killed
before the restart. A child that keeps crashing waits longer each time (exponential backoff up to
`backoff_max`); one that stayed up for `stable_after` seconds starts again from the shortest
wait. Only `stop()` (Ctrl-C in `dev.py up`) ends the children for good.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Child:
    """One supervised command, its log file, and its restart bookkeeping."""

    name: str
    cmd: list[str]
    log_path: Path
    proc: subprocess.Popen | None = None
    started_at: float = 0.0
    restarts: int = 0
    next_start_at: float = 0.0
    failures_in_a_row: int = 0
    exit_codes: list[int] = field(default_factory=list)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None and self.proc.poll() is None else None


class Supervisor:
    """Starts children, restarts the ones that exit, stops them all on request."""

    def __init__(
        self,
        *,
        env: dict[str, str],
        cwd: Path,
        say: Callable[[str], None] = print,
        backoff_initial: float = 1.0,
        backoff_max: float = 30.0,
        stable_after: float = 60.0,
    ) -> None:
        self.env = env
        self.cwd = cwd
        self.say = say
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        self.stable_after = stable_after
        self.children: dict[str, Child] = {}

    def add(self, name: str, cmd: list[str], log_path: Path) -> Child:
        child = Child(name=name, cmd=cmd, log_path=log_path)
        self.children[name] = child
        return child

    def start_all(self) -> None:
        for child in self.children.values():
            self._start(child)

    def _start(self, child: Child) -> None:
        child.log_path.parent.mkdir(parents=True, exist_ok=True)
        with child.log_path.open("ab") as out:
            child.proc = subprocess.Popen(
                child.cmd,
                cwd=self.cwd,
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        child.started_at = time.monotonic()

    def poll(self) -> None:
        """One supervision pass: note children that exited, restart those whose wait is over."""
        now = time.monotonic()
        for child in self.children.values():
            proc = child.proc
            if proc is not None and proc.poll() is not None:
                code = proc.returncode
                child.exit_codes.append(code)
                _kill_group(proc.pid)
                child.proc = None
                stable = now - child.started_at >= self.stable_after
                child.failures_in_a_row = 0 if stable else child.failures_in_a_row + 1
                doublings = max(0, child.failures_in_a_row - 1)
                wait = min(self.backoff_max, self.backoff_initial * 2**doublings)
                child.next_start_at = now + wait
                self.say(
                    f"{child.name} exited with code {code} after {now - child.started_at:.0f} s;"
                    f" restarting in {wait:.0f} s (log: {child.log_path})"
                )
            if child.proc is None and now >= child.next_start_at:
                child.restarts += 1
                self._start(child)
                self.say(f"{child.name} restarted (restart {child.restarts}, pid {child.pid})")

    def run(self, every: float = 0.5) -> None:
        """Supervise until interrupted (KeyboardInterrupt propagates to the caller)."""
        while True:
            self.poll()
            time.sleep(every)

    def stop(self, grace: float = 20.0) -> None:
        """SIGTERM every child's group, wait up to `grace` seconds, then SIGKILL what is left."""
        live = [c.proc for c in self.children.values() if c.proc is not None]
        for proc in live:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for proc in live:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.1, deadline - time.monotonic()))
            _kill_group(proc.pid)
        for child in self.children.values():
            child.proc = None


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
