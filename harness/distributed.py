"""Process-group setup and rank agreement.

The harness runs as one process per GPU. Launched by ``torchrun`` (or by ``--nproc``, see
``harness.launcher``) it
reads ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` and joins a process group: NCCL for CUDA tensors,
gloo on CPU. Control decisions (stop after SIGTERM, a time-based checkpoint is due) travel over a
gloo group on the CPU, so agreeing on them costs one tiny host-side all-reduce per step and never
synchronises the CUDA stream. Without those variables it is a plain single process.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from harness.config import ConfigError


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


def shutdown_distributed(ctx: DistContext, *, synchronize: bool) -> None:
    """Leave the process group. ``synchronize`` waits for every rank first (after a clean run),
    so no rank tears down its connections while a peer still uses them; after a failure it
    would wait for a peer that may be gone."""
    if not ctx.distributed or not dist.is_initialized():
        return
    if synchronize:
        dist.barrier(group=ctx.control_group)
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
