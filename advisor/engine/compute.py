"""Time of a training step: compute at a share of the card's dense peak, plus communication and
the pipeline bubble.

- Compute: model FLOPs (6 x params x tokens, Kaplan et al. 2020) plus the recomputed share (a
  whole forward pass, 2 x params x tokens, with full recomputation; the attention core's
  4 x layers x seq x width per token with selective, Korthikanti et al. 2022 Section 5) over the
  card's dense peak in the precision used, times the card's MFU prior. The prior is the share of
  the peak the matmuls reach; MFU is then reported on model FLOPs only, so recomputation counts
  once, as time, never as useful work.
- Priors from published large runs: Narayanan et al. 2021 ("Efficient Large-Scale Language Model
  Training on GPU Clusters Using Megatron-LM", Table 1) sustain 44-52 % of the A100 peak from 1.7 B
  to 1 T parameters on up to 3,072 GPUs; the Llama 2 paper's GPU-hours (Touvron et al. 2023,
  Table 2) imply 38-43 % MFU on A100-80GB; the Llama 3 paper reports 38-43 % BF16 MFU on H100s.
  No such runs are published on PCIe and consumer cards: a lower prior there, which calibration
  by measured runs replaces.
- Communication: the data-parallel gradient all-reduce (or ZeRO's reduce-scatter and all-gather)
  moves 2 (n - 1) / n of the gradient bytes per GPU by ring, overlapped with the backward pass of
  the last micro-batch; tensor parallelism moves 4 all-reduces of the layer's activations per layer
  and micro-batch (Megatron-LM, Shoeybi et al. 2019, Section 3), over NVLink only and not
  overlapped; across nodes each GPU gets its share of the node's network.
- Pipeline: the 1F1B bubble is (p - 1) / (m + p - 1) of the step with m micro-batches
  (Narayanan et al. 2021, Section 2.2.1).
"""

from __future__ import annotations

from dataclasses import dataclass

from advisor.engine.memory import Checkpointing, Layout, Precision
from advisor.engine.presets import Kind, ModelShape

MFU_NVLINK_DATACENTER = 0.45
MFU_DATACENTER = 0.40
MFU_CONSUMER = 0.35
# All-reduce bus bandwidth between GPUs of one node without NVLink (PCIe 4.0 x16 through the
# host bridge, about half of its 25 GB/s one way in practice).
PCIE_GBS = 12.0
# A datacenter NVLink cluster has one 200 Gb/s InfiniBand port per GPU (the Llama 2 RSC and
# Megatron-LM's Selene clusters); elsewhere a node's Ethernet, when it reports none.
NETWORK_GBITS_PER_GPU_NVLINK = 200.0
NETWORK_GBITS_DEFAULT_NODE = 25.0
# The last gradient bucket's all-reduce cannot overlap anything.
DP_UNHIDDEN_SHARE = 0.1


@dataclass(frozen=True, slots=True, kw_only=True)
class Card:
    """A catalog card as the advisor needs it."""

    slug: str
    name: str = ""
    memory_gb: float
    tensor_tflops: float
    fp32_tflops: float
    bf16: bool = True
    nvlink_gbs: float = 0.0
    nvlink_bridge: bool = False  # a bridge joins pairs of cards only
    tier: str = "datacenter"
    mfu_prior: float | None = None

    def peak_tflops(self, precision: Precision) -> float:
        return self.fp32_tflops if precision == Precision.FP32 else self.tensor_tflops

    def precision_used(self, precision: Precision) -> Precision:
        """bf16 runs as fp16 with loss scaling on cards without bf16 (same tensor rate)."""
        return Precision.FP16 if precision == Precision.BF16 and not self.bf16 else precision

    @property
    def prior(self) -> float:
        if self.mfu_prior is not None:
            return self.mfu_prior
        if self.tier == "consumer":
            return MFU_CONSUMER
        return MFU_NVLINK_DATACENTER if self.nvlink_gbs > 0 else MFU_DATACENTER


@dataclass(frozen=True, slots=True, kw_only=True)
class Topology:
    """Where the GPUs are: equal shares on each node."""

    gpus_per_node: int
    nodes: int = 1
    nvlink: bool = False
    network_gbits: float | None = None  # per node; None: the default for the card

    def network_gbs_per_gpu(self, card: Card) -> float:
        if self.network_gbits:
            return self.network_gbits / 8 / self.gpus_per_node
        if self.nvlink and card.nvlink_gbs > 0:
            return NETWORK_GBITS_PER_GPU_NVLINK / 8
        return NETWORK_GBITS_DEFAULT_NODE / 8 / self.gpus_per_node

    def intra_gbs(self, card: Card) -> float:
        # NVLink figures are both directions together; a ring uses one.
        return card.nvlink_gbs / 2 if self.nvlink and card.nvlink_gbs > 0 else PCIE_GBS


@dataclass(frozen=True, slots=True, kw_only=True)
class StepTime:
    """Seconds per optimizer step, by part."""

    compute: float
    bubble: float
    tp_comm: float
    dp_comm: float
    micro_batches: int
    tokens: float
    model_flops: float

    @property
    def total(self) -> float:
        return self.compute + self.bubble + self.tp_comm + self.dp_comm


def recompute_flops_per_sample(shape: ModelShape, checkpointing: Checkpointing) -> float:
    if checkpointing == Checkpointing.NONE:
        return 0.0
    if checkpointing == Checkpointing.FULL or shape.kind == Kind.CNN:
        return shape.training_flops_per_sample() / 3  # one more forward pass
    return 4.0 * shape.layers * shape.seq_len * shape.hidden * shape.seq_len


def micro_batches(shape: ModelShape, layout: Layout) -> int:
    """Micro-batches per optimizer step on each data-parallel rank (gradient accumulation)."""
    return max(1, round(shape.global_batch / (layout.dp * layout.micro_batch)))


def step_time(
    *,
    shape: ModelShape,
    layout: Layout,
    card: Card,
    topology: Topology,
    precision: Precision,
    mfu: float | None = None,
) -> StepTime:
    gpus = layout.gpus
    m = micro_batches(shape, layout)
    samples = m * layout.dp * layout.micro_batch
    model_flops = samples * shape.training_flops_per_sample()
    work = model_flops + samples * recompute_flops_per_sample(shape, layout.checkpointing)
    peak = card.peak_tflops(precision) * 1e12
    compute = work / (gpus * peak * (mfu if mfu is not None else card.prior))

    p = layout.pp
    bubble = compute * (p - 1) / m

    grad_bytes = 4.0 if precision == Precision.FP32 else 2.0
    tp_comm = 0.0
    if layout.tp > 1 and shape.kind == Kind.DECODER:
        t = layout.tp
        per_collective = 2 * (t - 1) / t * shape.seq_len * layout.micro_batch * shape.hidden
        collectives = 6 if layout.checkpointing == Checkpointing.FULL else 4
        volume = per_collective * grad_bytes * collectives * (shape.layers / p) * m
        tp_comm = volume / (topology.intra_gbs(card) * 1e9)

    dp_comm = 0.0
    if layout.dp > 1:
        n = layout.dp
        local_params = shape.params / (layout.tp * p)
        # A data-parallel group stays inside a node only when the whole run does.
        gbs = (
            topology.intra_gbs(card) if topology.nodes == 1 else topology.network_gbs_per_gpu(card)
        )
        ring = 2 * (n - 1) / n * local_params * grad_bytes / (gbs * 1e9)
        if layout.zero_stage >= 3:
            # Weights gathered for forward and backward, gradients reduce-scattered, on every
            # micro-batch: 1.5 x the all-reduce volume each, overlapped with all of the compute.
            volume, window = 1.5 * ring * m, compute
        else:
            volume, window = ring, compute * 2 / 3 / m
        dp_comm = max(0.0, volume - window) + DP_UNHIDDEN_SHARE * volume
    return StepTime(
        compute=compute,
        bubble=bubble,
        tp_comm=tp_comm,
        dp_comm=dp_comm,
        micro_batches=m,
        tokens=samples * shape.tokens_per_sample,
        model_flops=model_flops,
    )


def mfu_of(step: StepTime, *, card: Card, precision: Precision, gpus: int) -> float:
    """Model FLOPs utilisation of the dense peak (recomputation not counted)."""
    return step.model_flops / (step.total * gpus * card.peak_tflops(precision) * 1e12)


def observed_prior(
    step: StepTime, *, measured_step_s: float, prior: float, low: float, high: float
) -> float:
    """The prior that would have predicted the measured step: its compute part scaled by how much
    longer or shorter the measured step was, bounded (a node's report is not trusted blindly)."""
    other = step.total - step.compute
    compute_measured = max(measured_step_s - other, measured_step_s * 0.05)
    return min(high, max(low, prior * step.compute / compute_measured))
