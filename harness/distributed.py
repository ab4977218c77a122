"""Process-group setup, rank agreement, and the local multi-process launcher.

The harness runs as one process per GPU. Launched by ``torchrun`` (or by ``--nproc``, below) it
reads ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` and joins a process group: NCCL for CUDA tensors,
gloo on CPU. Control decisions (stop after SIGTERM, a time-based checkpoint is due) travel over a
gloo group on the CPU, so agreeing on them costs one tiny host-side all-reduce per step and never
synchronises the CUDA stream. Without those variables it is a plain single process.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from harness.config import ConfigError

log = logging.getLogger("harness")

# Seconds the launcher lets workers finish their step and checkpoint after forwarding SIGTERM or
# after a sibling failed, before it kills them.
LAUNCHER_GRACE_S = float(os.environ.get("HARNESS_LAUNCHER_GRACE_S", "120"))


@dataclass(frozen=True)
class DistContext:
    """Where this process sits in the job."""

    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    control_group: Any = None

    @property
    def is_primary(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def init_distributed(device_request: str) -> DistContext:
    """Join the process group named by the torchrun environment, or run alone."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = device_request == "cuda" or (device_request == "auto" and torch.cuda.is_available())
    if use_cuda and not torch.cuda.is_available():
        raise ConfigError([("train.device", "'cuda' requested but no CUDA device is visible")])
    if use_cuda:
        if local_rank >= torch.cuda.device_count():
            raise ConfigError(
                [
                    (
                        "train.device",
                        f"local rank {local_rank} has no GPU "
                        f"({torch.cuda.device_count()} visible); start fewer processes",
                    )
                ]
            )
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world_size == 1:
        return DistContext(0, 0, 1, device)
    backend = "nccl" if use_cuda else "gloo"
    dist.init_process_group(backend=backend, device_id=device if use_cuda else None)
    control_group = dist.new_group(backend="gloo") if backend == "nccl" else dist.group.WORLD
    return DistContext(rank, local_rank, world_size, device, control_group)


def shutdown_distributed() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def agree_any(ctx: DistContext, flags: list[bool]) -> list[bool]:
    """Element-wise OR of boolean flags over all ranks (each flag true if any rank set it)."""
    if not ctx.distributed:
        return flags
    tensor = torch.tensor([int(f) for f in flags], dtype=torch.int32)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=ctx.control_group)
    return [bool(v) for v in tensor.tolist()]


def gather_to_primary(ctx: DistContext, obj: Any) -> list[Any] | None:
    """Every rank's ``obj`` on rank 0 (None elsewhere), sent over the CPU control group."""
    if not ctx.distributed:
        return [obj]
    gathered: list[Any] | None = [None] * ctx.world_size if ctx.is_primary else None
    dist.gather_object(obj, gathered, dst=0, group=ctx.control_group)
    return gathered


def broadcast_from_primary(ctx: DistContext, obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank."""
    if not ctx.distributed:
        return obj
    box = [obj if ctx.is_primary else None]
    dist.broadcast_object_list(box, src=0, group=ctx.control_group)
    return box[0]


def visible_gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


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
    while True:
        codes = [worker.poll() for worker in workers]
        if all(code is not None for code in codes):
            break
        if failure is None:
            failed = [code for code in codes if code not in (None, 0)]
            if failed:
                failure = _exit_status(failed[0])
                log.error("launcher: a worker exited with status %d; stopping the others", failure)
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
    if failure is not None:
        return failure
    statuses = [_exit_status(worker.returncode) for worker in workers]
    return next((status for status in statuses if status != 0), 0)
