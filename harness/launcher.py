"""The launcher behind ``--nproc N``: N ranks of the harness on this host, alone or as one node
of a job across several.

It imports no torch, so the supervising process stays small; the ranks are ordinary
``python -m harness`` processes that find their place through the torchrun environment variables
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``).

Across nodes, every node runs this launcher with the same job description that torchrun takes:
``NNODES``, ``NODE_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` (rank 0's node and the port its
store listens on), set by the node agent for each member of a multi-node rental. Node r's local
rank i is global rank ``r * nproc + i``; rank 0 (on node 0) serves the store.
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


def _interface_of(address: str) -> str | None:
    """The name of the local interface holding the IPv4 `address`, or None (Linux)."""
    if not address:
        return None
    try:
        wanted = socket.inet_aton(address)
    except OSError:
        return None
    import fcntl
    import struct

    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(
                    sock.fileno(), siocgifaddr, struct.pack("256s", name[:15].encode())
                )
            except OSError:
                continue  # no IPv4 address on it
            if raw[20:24] == wanted:
                return name
    return None


def _exit_status(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


class Gang:
    """This node's place in a job across nodes (one node: the defaults)."""

    def __init__(self, nnodes: int = 1, node_rank: int = 0, master_addr: str = "", port: int = 0):
        self.nnodes, self.node_rank, self.master_addr, self.master_port = (
            nnodes, node_rank, master_addr, port,
        )  # fmt: skip

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> Gang:
        """The job across nodes the environment describes; ConfigError naming the variable."""
        env = os.environ if environ is None else environ
        problems: list[tuple[str, str]] = []

        def number(name: str, default: int, low: int) -> int:
            raw = env.get(name, "").strip()
            if not raw:
                return default
            if not raw.isdigit() or int(raw) < low:
                problems.append(("", f"{name}={raw!r} must be an integer >= {low}"))
                return default
            return int(raw)

        nnodes = number("NNODES", 1, 1)
        node_rank = number("NODE_RANK", 0, 0)
        if nnodes == 1:
            return cls() if not problems else _raise(problems)
        if node_rank >= nnodes:
            problems.append(("", f"NODE_RANK={node_rank} must be below NNODES={nnodes}"))
        addr = env.get("MASTER_ADDR", "").strip()
        if not addr:
            problems.append(("", "MASTER_ADDR is required when NNODES > 1"))
        port = number("MASTER_PORT", 0, 1)
        if not port or port > 65535:
            problems.append(("", "MASTER_PORT (1-65535) is required when NNODES > 1"))
        if problems:
            _raise(problems)
        return cls(nnodes, node_rank, addr, port)


def _raise(problems: list[tuple[str, str]]):
    raise ConfigError(problems)


def launch_local(worker_args: list[str], nproc: int, gang: Gang | None = None) -> int:
    """Run ``python -m harness <worker_args>`` as ``nproc`` ranks on this host (this node's
    share of `gang`'s job when given); return the status.

    torchrun would do the rendezvous too, but its agent treats SIGTERM as a failure: it kills the
    workers after a short wait and exits non-zero. A rental that is stopped must instead let every
    rank finish its step, checkpoint and exit 0, so this launcher forwards SIGTERM/SIGINT to the
    workers and waits (up to ``LAUNCHER_GRACE_S``). If a worker fails, the others are asked to
    stop, then killed after the grace period, and the failing worker's status is returned.
    """
    if "RANK" in os.environ:
        raise ConfigError([("", "--nproc cannot be used inside an already launched job")])
    gang = gang or Gang()
    env_base = dict(os.environ)
    env_base.update(
        MASTER_ADDR=gang.master_addr or "127.0.0.1",
        MASTER_PORT=str(gang.master_port or _free_port()),
        WORLD_SIZE=str(nproc * gang.nnodes),
        LOCAL_WORLD_SIZE=str(nproc),
        GROUP_RANK=str(gang.node_rank),
    )
    # gloo and NCCL pick their interface from the host name, which on a host with several
    # networks may resolve to one the other members cannot reach: bind them to the interface
    # that holds the address the other members were given for this node.
    interface = _interface_of(os.environ.get("GPUMARKET_NODE_ADDR", ""))
    if gang.nnodes > 1 and interface:
        env_base.setdefault("GLOO_SOCKET_IFNAME", interface)
        env_base.setdefault("NCCL_SOCKET_IFNAME", interface)
    # N ranks sharing the host's cores: without this each one starts a thread per core.
    env_base.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    workers: list[subprocess.Popen] = []
    for local in range(nproc):
        rank = gang.node_rank * nproc + local
        env = dict(env_base, RANK=str(rank), LOCAL_RANK=str(local))
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
