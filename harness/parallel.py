"""The transformer's layouts, composed from PyTorch's own parallelism building blocks.

The job's ranks form a ``pp x dp x tp`` DeviceMesh (``tp`` innermost, so a tensor-parallel group
is consecutive ranks on one node). A layout is applied to the meta-device model in the order
torchtitan uses:

1. pipeline parallelism (``torch.distributed.pipelining``): each pp rank keeps its stage's
   layers (the first stage also the embeddings, the last the final norm and output) and runs a
   GPipe or 1F1B schedule over ``layout.pp_microbatches`` slices of each micro-batch;
2. tensor parallelism (``parallelize_module``): per block, query/key/value and the MLP's gate and
   up projections column-wise, the attention output and MLP down projections row-wise, so each
   block costs one all-reduce forward and one backward; embeddings, norms and the output
   projection stay replicated (their gradients are identical on every tp rank);
3. activation recomputation: each block's ``recompute`` (harness.transformer.Block);
4. data parallelism over ``dp``: FSDP2 ``fully_shard`` per block and at the root for ``zero2``
   (``reshard_after_forward=False``: parameters stay gathered from forward to backward, gradients
   and optimizer state sharded) and ``zero3`` (``True``: parameters resharded after forward and
   gathered again in backward); with ``shard: none``, DDP when dp is the only dimension, else one
   all-reduce of the gradients over the dp group per optimizer step.

Mixed precision stays the harness's autocast in every layout (FSDP2's own policy is not used),
so a layout changes where the numbers are computed, not which ones.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from harness.config import LayoutConfig, ResolvedLayout
from harness.transformer import Transformer, build_transformer, init_weights

log = logging.getLogger("harness")

MESH_DIMS = ("pp", "dp", "tp")


@dataclass
class ParallelModel:
    """The model as this rank runs it, and the groups it talks to."""

    model: Transformer  # this rank's stage (the whole model without pp), parallelised
    train_model: nn.Module  # what the forward pass calls (DDP wrapper or the model)
    layout: ResolvedLayout
    config: LayoutConfig
    mesh: DeviceMesh | None
    dp_rank: int
    pp_rank: int
    ddp: nn.Module | None = None
    schedule: Any = None  # the pipeline schedule when pp > 1

    @property
    def first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def last_stage(self) -> bool:
        return self.pp_rank == self.layout.pp - 1

    def group(self, dim: str) -> Any:
        """The process group of one mesh dimension (None without a mesh)."""
        return self.mesh[dim].get_group() if self.mesh is not None else None

    def sync_context(self, last_micro: bool) -> Any:
        """DDP's no_sync for the micro-steps before the last (others sync in their own way)."""
        if self.ddp is not None and not last_micro:
            return self.ddp.no_sync()
        return None

    def after_backward(self) -> None:
        """Once per optimizer step, after the last backward: plain data parallelism beside tp or
        pp averages gradients over the dp group here."""
        if self.ddp is not None or self.config.shard != "none" or self.layout.dp == 1:
            return
        group, size = self.group("dp"), self.layout.dp
        for param in self.model.parameters():
            if param.grad is not None:
                grad = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
                dist.all_reduce(grad, group=group)
                grad.div_(size)


def stage_layers(layers: int, pp: int, split: list[int] | None) -> list[range]:
    """The layer indices of each pipeline stage."""
    sizes = split if split is not None else [layers // pp] * pp
    bounds = [sum(sizes[:i]) for i in range(pp + 1)]
    return [range(bounds[i], bounds[i + 1]) for i in range(pp)]


def _keep_stage(model: Transformer, stage: int, stages: list[range]) -> None:
    keep = {str(i) for i in stages[stage]}
    for name in list(model.layers):
        if name not in keep:
            del model.layers[name]
    if stage > 0:
        model.tok_embeddings = None
        model.pos_embeddings = None
    if stage < len(stages) - 1:
        model.norm = None
        model.output = None


def _apply_tp(model: Transformer, tp_mesh: DeviceMesh) -> None:
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    plan = {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(),
    }
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, plan)


def _apply_fsdp(model: Transformer, dp_mesh: DeviceMesh, shard: str) -> None:
    from torch.distributed.fsdp import fully_shard

    reshard = shard == "zero3"
    for block in model.layers.values():
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard)


def build_parallel_model(
    *,
    shape: Any,
    dropout: float,
    config: LayoutConfig,
    layout: ResolvedLayout,
    device: torch.device,
    seed: int,
) -> ParallelModel:
    """Build, parallelise and initialise this rank's part of the model."""
    mesh = None
    if layout.world_size > 1:
        mesh = init_device_mesh(
            device.type, (layout.pp, layout.dp, layout.tp), mesh_dim_names=MESH_DIMS
        )
    pp_rank = mesh["pp"].get_local_rank() if mesh is not None else 0
    dp_rank = mesh["dp"].get_local_rank() if mesh is not None else 0
    model = build_transformer(shape, dropout=dropout)
    if layout.pp > 1:
        _keep_stage(model, pp_rank, stage_layers(shape.layers, layout.pp, config.pp_split))
    if layout.tp > 1:
        assert mesh is not None
        _apply_tp(model, mesh["tp"])
    for block in model.layers.values():
        block.recompute = config.recompute
    if config.shard != "none" and layout.dp > 1:
        assert mesh is not None
        _apply_fsdp(model, mesh["dp"], config.shard)
    elif config.shard != "none":
        log.info("layout.shard %r with dp 1: nothing to shard", config.shard)
    model.to_empty(device=device)
    init_weights(model, seed, device)
    parallel = ParallelModel(
        model=model,
        train_model=model,
        layout=layout,
        config=config,
        mesh=mesh,
        dp_rank=dp_rank,
        pp_rank=pp_rank,
    )
    if config.shard == "none" and layout.dp > 1 and layout.tp == 1 and layout.pp == 1:
        from torch.nn.parallel import DistributedDataParallel

        parallel.ddp = DistributedDataParallel(
            model,
            device_ids=[device.index] if device.type == "cuda" else None,
            process_group=parallel.group("dp"),
        )
        parallel.train_model = parallel.ddp
    return parallel


def build_schedule(
    parallel: ParallelModel, device: torch.device, loss_fn: Callable[[Tensor, Tensor], Tensor]
) -> Any:
    """The pipeline schedule of this rank's stage. Gradients are not rescaled by the schedule
    (``scale_grads=False``: it would rescale gradients accumulated over earlier micro-steps too);
    ``loss_fn`` divides by the number of pipeline micro-batches and micro-steps instead."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    stage = PipelineStage(
        parallel.model,
        stage_index=parallel.pp_rank,
        num_stages=parallel.layout.pp,
        device=device,
        group=parallel.group("pp"),
    )
    cls = Schedule1F1B if parallel.config.pp_schedule == "1f1b" else ScheduleGPipe
    return cls(
        stage,
        n_microbatches=parallel.config.pp_microbatches or parallel.layout.pp,
        loss_fn=loss_fn,
        scale_grads=False,
    )


def _grouped(grads: list[Tensor]) -> Iterator[list[Tensor]]:
    """Gradients grouped so that each group's norm is one computation: plain tensors, and
    DTensors by mesh and placements."""
    groups: dict[Any, list[Tensor]] = {}
    for grad in grads:
        key = (grad.device_mesh, tuple(grad.placements)) if isinstance(grad, DTensor) else None
        groups.setdefault(key, []).append(grad)
    yield from groups.values()


@torch.no_grad()
def clip_grad_norm(parameters: list[nn.Parameter], max_norm: float, pp_group: Any = None) -> Tensor:
    """Clip the global gradient norm over every rank's parameters; return the norm before.

    ``nn.utils.clip_grad_norm_`` cannot mix plain and DTensor gradients (tensor parallelism
    leaves norms and embeddings replicated) and knows nothing of pipeline stages, each of which
    holds different parameters; so each group's norm is made whole (``full_tensor``), the
    squares summed, and summed again over the pp group."""
    grads = [p.grad for p in parameters if p.grad is not None]
    squares: Tensor | None = None
    for group in _grouped(grads):
        norm = nn.utils.get_total_norm(group, foreach=True)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        squares = norm.float() ** 2 if squares is None else squares + norm.float() ** 2
    if squares is None:
        squares = torch.zeros((), device=parameters[0].device)
    if pp_group is not None:
        dist.all_reduce(squares, group=pp_group)
    total = squares.sqrt()
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    # The local shards: a DTensor and a plain tensor cannot meet in one foreach call.
    local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    if local:
        torch._foreach_mul_(local, coefficient.to(local[0].device))
    return total


def lm_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean token cross-entropy, in fp32 whatever the autocast dtype of the logits."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
