"""The layout of a run on a given set of GPUs, chosen to fit memory and the topology: tensor
parallelism inside an NVLink group only, pipeline and data parallelism (with a ZeRO stage) across
GPUs and nodes; the fastest layout that fits wins."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from advisor.engine.compute import (
    NETWORK_GBITS_PER_GPU_NVLINK,
    Card,
    StepTime,
    Topology,
    mfu_of,
    step_time,
)
from advisor.engine.memory import (
    Checkpointing,
    Layout,
    Memory,
    Optimizer,
    Precision,
    fits,
    per_gpu,
)
from advisor.engine.presets import Kind, ModelShape
from advisor.engine.runs import ZERO_STAGES, unrunnable

SECONDS_PER_HOUR = 3600
MAX_PIPELINE = 64


@dataclass(frozen=True, slots=True, kw_only=True)
class Run:
    """What to train and how, before choosing the GPUs."""

    shape: ModelShape
    tokens: float
    precision: Precision = Precision.BF16
    optimizer: Optimizer = Optimizer.ADAMW
    checkpointing: Checkpointing | None = None  # None: the least recomputation that fits


@dataclass(frozen=True, slots=True, kw_only=True)
class Estimate:
    """A run on a number of GPUs: layout, memory per GPU and time."""

    card: Card
    gpus: int
    topology: Topology
    layout: Layout
    precision: Precision
    memory: Memory
    fits: bool
    step: StepTime
    hours: float
    mfu: float
    prior: float

    @property
    def gpu_hours(self) -> float:
        return self.hours * self.gpus

    @property
    def tokens_per_s(self) -> float:
        return self.step.tokens / self.step.total


def default_topology(card: Card, gpus: int) -> Topology:
    """Up to 8 GPUs per node, equal shares, NVLink where the card has it; a cluster of NVLink
    nodes on the reference fabric (compute.NETWORK_GBITS_PER_GPU_NVLINK per GPU), others on the
    conservative default."""
    per_node = max(d for d in range(1, 9) if gpus % d == 0)
    nvlink = card.nvlink_gbs > 0
    return Topology(
        gpus_per_node=per_node,
        nodes=gpus // per_node,
        nvlink=nvlink,
        network_gbits=NETWORK_GBITS_PER_GPU_NVLINK * per_node if nvlink else None,
    )


def _tp_options(shape: ModelShape, card: Card, topology: Topology) -> list[int]:
    if shape.kind == Kind.CNN or not (topology.nvlink and card.nvlink_gbs > 0):
        return [1]
    group = 2 if card.nvlink_bridge else topology.gpus_per_node
    return [
        t
        for t in (1, 2, 4, 8, 16)
        if t <= group and topology.gpus_per_node % t == 0 and shape.heads % t == 0
    ]


def candidates(
    run: Run, card: Card, topology: Topology, *, fixed: Layout | None = None
) -> list[Layout]:
    """Every layout of the run on these GPUs that the harness runs (or just the fixed one),
    before memory is checked."""
    if fixed is not None:
        return [fixed]
    gpus = topology.gpus_per_node * topology.nodes
    shape = run.shape
    precision = card.precision_used(run.precision)
    checkpointing = [run.checkpointing] if run.checkpointing else list(Checkpointing)
    layouts = []
    for tp in _tp_options(shape, card, topology):
        for pp in range(1, min(shape.layers, MAX_PIPELINE, gpus // tp) + 1):
            if shape.kind == Kind.CNN and pp > 1:
                break
            if shape.layers % pp or (gpus // tp) % pp or gpus % tp:
                continue
            dp = gpus // (tp * pp)
            if dp > shape.global_batch:
                continue
            micro = max(1, min(shape.micro_batch, shape.global_batch // dp))
            for ckpt in checkpointing:
                for zero in ZERO_STAGES if dp > 1 else (0,):
                    layout = Layout(
                        dp=dp,
                        tp=tp,
                        pp=pp,
                        zero_stage=zero,
                        micro_batch=micro,
                        checkpointing=ckpt,
                    )
                    if unrunnable(shape, layout, precision) is None:
                        layouts.append(layout)
    return layouts


# Estimates a process keeps (a few kilobytes each): an answer at 10,000 nodes estimates about
# 230 topologies, and the same question comes again (the advisor's presets, a page reloaded).
ESTIMATES_KEPT = 4096


@lru_cache(maxsize=ESTIMATES_KEPT)
def estimate(
    run: Run, card: Card, topology: Topology, *, fixed: Layout | None = None
) -> Estimate | None:
    """The fastest layout that fits; if none fits, the one needing the least memory (fits False);
    None when the GPUs admit no layout at all (more replicas than the batch has sequences).

    Kept per process for its arguments: it reads nothing else, and they and the answer are
    frozen values (estimating the same topologies again was over half of an answer's CPU)."""
    precision = card.precision_used(run.precision)
    best: tuple[float, float, Layout, Memory, StepTime] | None = None
    smallest: tuple[float, Layout, Memory] | None = None
    for layout in candidates(run, card, topology, fixed=fixed):
        memory = per_gpu(
            shape=run.shape, precision=precision, optimizer=run.optimizer, layout=layout
        )
        if smallest is None or memory.total < smallest[0]:
            smallest = (memory.total, layout, memory)
        if not fits(memory, card.memory_gb):
            continue
        step = step_time(
            shape=run.shape, layout=layout, card=card, topology=topology, precision=precision
        )
        key = (step.total, memory.total)
        if best is None or key < best[:2]:
            best = (*key, layout, memory, step)
    if best is not None:
        _, _, layout, memory, step = best
        ok = True
    elif smallest is not None:
        _, layout, memory = smallest
        step = step_time(
            shape=run.shape, layout=layout, card=card, topology=topology, precision=precision
        )
        ok = False
    else:
        return None
    gpus = layout.gpus
    hours = run.tokens / step.tokens * step.total / SECONDS_PER_HOUR
    return Estimate(
        card=card,
        gpus=gpus,
        topology=topology,
        layout=layout,
        precision=precision,
        memory=memory,
        fits=ok,
        step=step,
        hours=hours,
        mfu=mfu_of(step, card=card, precision=precision, gpus=gpus),
        prior=card.prior,
    )


def fewest_fitting(run: Run, card: Card, topologies: list[Topology]) -> int | None:
    """Index of the first topology (ordered by GPU count) on which the run fits, by bisection:
    with ZeRO-3 available, more GPUs never need more memory per GPU."""
    lo, hi = 0, len(topologies)
    while lo < hi:
        mid = (lo + hi) // 2
        found = estimate(run, card, topologies[mid])
        if found is not None and found.fits:
            hi = mid
        else:
            lo = mid + 1
    return lo if lo < len(topologies) else None


def hours_bound(hours: float) -> bool:
    return math.isfinite(hours) and hours > 0
