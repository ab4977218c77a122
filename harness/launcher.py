"""The local launcher behind ``--nproc N``: N ranks of the harness on this host.

It imports no torch, so the supervising process stays small; the ranks are ordinary
``python -m harness`` processes that find their place through the torchrun environment variables
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from types import FrameType

from harness.config import ConfigError

log = logging.getLogger("harness")

# Seconds the launcher lets workers finish their step and checkpoint after forwarding SIGTERM or
# after a sibling failed, before it kills them.
LAUNCHER_GRACE_S = float(os.environ.get("HARNESS_LAUNCHER_GRACE_S", "120"))


def _free_port() -> int:
    # The port is free now; a race with another process binding it before rank 0 does is possible
    # but harmless in a container that runs one job, and rank 0 would fail loudly.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _exit_status(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def launch_local(worker_args: list[str], nproc: int) -> int:
    """Run ``python -m harness <worker_args>`` as ``nproc`` ranks on this host; return the status.

    torchrun would do the rendezvous too, but its agent treats SIGTERM as a failure: it kills the
    workers after a short wait and exits non-zero. A rental that is stopped must instead let every
    rank finish its step, checkpoint and exit 0, so this launcher forwards SIGTERM/SIGINT to the
    workers and waits (up to ``LAUNCHER_GRACE_S``). If a worker fails, the others are asked to
    stop, then killed after the grace period, and the failing worker's status is returned.
    """
    if "WORLD_SIZE" in os.environ:
        raise ConfigError([("", "--nproc cannot be used inside an already launched job")])
    env_base = dict(os.environ)
    env_base.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(_free_port()),
        WORLD_SIZE=str(nproc),
        LOCAL_WORLD_SIZE=str(nproc),
        GROUP_RANK="0",
    )
    # N ranks sharing the host's cores: without this each one starts a thread per core.
    env_base.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    workers: list[subprocess.Popen] = []
    for rank in range(nproc):
        env = dict(env_base, RANK=str(rank), LOCAL_RANK=str(rank))
        workers.append(subprocess.Popen([sys.executable, "-m", "harness", *worker_args], env=env))

    stop_signal: list[int] = []

    def forward(signum: int, _frame: FrameType | None) -> None:
        if not stop_signal:
            log.info("launcher: forwarding %s to %d workers", signal.Signals(signum).name, nproc)
        stop_signal.append(signum)
        for worker in workers:
            if worker.poll() is None:
                worker.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        return _supervise(workers, stop_signal)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _supervise(workers: list[subprocess.Popen], stop_signal: list[int]) -> int:
    failure: int | None = None
    deadline: float | None = None
    while any(worker.poll() is None for worker in workers):
        if failure is None:
            failure = _first_failure(workers)
            if failure is not None:
                log.error("launcher: stopping the other workers")
                for worker in workers:
                    if worker.poll() is None:
                        worker.send_signal(signal.SIGTERM)
        if deadline is None and (failure is not None or stop_signal):
            deadline = time.monotonic() + LAUNCHER_GRACE_S
        if deadline is not None and time.monotonic() > deadline:
            log.error("launcher: workers still running after %.0f s; killing", LAUNCHER_GRACE_S)
            for worker in workers:
                if worker.poll() is None:
                    worker.kill()
            for worker in workers:
                worker.wait()
            return failure if failure is not None else 1
        time.sleep(0.1)
    if failure is None:
        failure = _first_failure(workers)
    return failure if failure is not None else 0


def _first_failure(workers: list[subprocess.Popen]) -> int | None:
    """The exit status of a failed worker, logged; None if none failed.

    When several have failed by the time we look, a worker killed by a signal (the OOM killer,
    a crash) is the likelier cause, the others' errors its consequence ("connection closed by
    peer"), so it is reported first; otherwise the lowest rank.
    """
    failed = [
        (rank, code)
        for rank, code in enumerate(worker.poll() for worker in workers)
        if code not in (None, 0)
    ]
    if not failed:
        return None
    rank, code = min(failed, key=lambda item: (item[1] >= 0, item[0]))
    status = _exit_status(code)
    log.error("launcher: rank %d exited with status %d", rank, status)
    return status
