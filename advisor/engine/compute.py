"""Time of one training step of a layout on a card and an interconnect, from first principles:
compute at the share of the dense peak that matrices of that size reach, plus the communication
each kind of parallelism needs over the link it runs on, plus the pipeline bubble.

docs/advisor-model.md states the model and the sources of every constant; in short:

- Compute: 6 x params per token (Kaplan et al. 2020) plus causal attention, 6 x layers x width
  x sequence per token (PaLM, Chowdhery et al. 2022, Appendix B, halved for the causal mask that
  fused attention kernels skip); recomputation adds one forward pass (full) or the attention
  core's forward (selective; Korthikanti et al. 2022, Section 5). It runs at the card's prior (the
  share of the dense peak that large matrix products of a whole training step reach) times a
  matrix-size curve: efficiency.matmul_share.
- Tensor parallelism: 2 all-reduces of the layer's activations forward and 2 backward per layer
  and micro-batch (3 + 3 with full recomputation), exposed (Shoeybi et al. 2019, Section 3).
- Pipeline: the 1F1B bubble, (p - 1) / (m + p - 1) of the step with m micro-batches
  (Narayanan et al. 2021, Section 2.2; divided by v with v interleaved stages per rank), and the
  activations sent and received between stages on every micro-batch, exposed, over the slowest
  link between two stages.
- Data parallelism: gradient all-reduce (ring: 2 (n - 1) / n of the bytes), ZeRO-2's
  reduce-scatter on every micro-batch and one all-gather, ZeRO-3's two parameter all-gathers and
  one reduce-scatter per micro-batch, over the slowest link the group spans, partly hidden under
  the backward pass (comm.exposed).
"""

from __future__ import annotations

from dataclasses import dataclass

from advisor.engine.comm import Links, exposed, pipeline_seconds, ring_seconds
from advisor.engine.efficiency import matmul_share
from advisor.engine.memory import Checkpointing, Layout, Precision
from advisor.engine.presets import Kind, ModelShape

# The card's prior: the share of the dense peak a whole training step's matrix products reach on
# matrices too large to lose anything to their size (efficiency.matmul_share scales it down for
# smaller ones). Fitted once, with the curve, to the published runs of
# tests/advisor/engine/test_published_runs.py (docs/advisor-model.md); calibration by measured
# runs replaces it per card.
MFU_NVLINK_DATACENTER = 0.55
MFU_DATACENTER = 0.50
MFU_CONSUMER = 0.45
# All-reduce bus bandwidth between GPUs of one node without NVLink (PCIe 4.0 x16 through the
# host bridge, about half of its 25 GB/s one way in practice).
PCIE_GBS = 12.0
# A node's fabric when nothing says what it is: one ordinary 25 Gb/s Ethernet port, the
# conservative case (an NVLink cluster's InfiniBand is passed in by who knows it).
NETWORK_GBITS_DEFAULT_NODE = 25.0
# The reference fabric of an NVLink cluster: one 200 Gb/s InfiniBand port per GPU, as on the
# clusters of the published runs (Llama 2's RSC, Megatron-LM's Selene); what default_topology
# assumes for a hypothetical cluster of NVLink cards.
NETWORK_GBITS_PER_GPU_NVLINK = 200.0
# Activations and gradients cross the links in 16 bits with mixed precision, 32 without.
BYTES_16, BYTES_32 = 2.0, 4.0


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
    """Where the GPUs are: equal shares on each node, and the fabric between nodes."""

    gpus_per_node: int
    nodes: int = 1
    nvlink: bool = False
    network_gbits: float | None = None  # per node; None: unknown, the conservative default

    def network_gbs(self) -> float:
        """The node's fabric in GB/s, one direction."""
        return (self.network_gbits or NETWORK_GBITS_DEFAULT_NODE) / 8

    def intra_gbs(self, card: Card) -> float:
        # NVLink figures are both directions together; a ring uses one.
        return card.nvlink_gbs / 2 if self.nvlink and card.nvlink_gbs > 0 else PCIE_GBS

    def links(self, card: Card) -> Links:
        return Links(
            gpus_per_node=self.gpus_per_node,
            nodes=self.nodes,
            intra_gbs=self.intra_gbs(card),
            node_gbs=self.network_gbs(),
        )


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
    pp_comm: float = 0.0
    matmul_share: float = 1.0

    @property
    def total(self) -> float:
        return self.compute + self.bubble + self.tp_comm + self.pp_comm + self.dp_comm


def attention_flops_per_sample(shape: ModelShape) -> float:
    """Forward and backward of the causal attention core (scores and weighted values): 6 x layers
    x width x sequence per token, which 6 x params leaves out."""
    if shape.kind != Kind.DECODER:
        return 0.0
    return 6.0 * shape.layers * shape.hidden * shape.seq_len * shape.seq_len


def model_flops_per_sample(shape: ModelShape) -> float:
    """Useful work per sample: what MFU is measured on (recomputation is not counted)."""
    return shape.training_flops_per_sample() + attention_flops_per_sample(shape)


def recompute_flops_per_sample(shape: ModelShape, checkpointing: Checkpointing) -> float:
    if checkpointing == Checkpointing.NONE:
        return 0.0
    if checkpointing == Checkpointing.FULL or shape.kind == Kind.CNN:
        return model_flops_per_sample(shape) / 3  # one more forward pass
    return attention_flops_per_sample(shape) / 3


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
    virtual_stages: int = 1,
) -> StepTime:
    """One optimizer step of the layout on these GPUs; `mfu` replaces the card's prior.
    `virtual_stages`: model chunks per pipeline rank with the interleaved 1F1B schedule
    (Narayanan et al. 2021, Section 2.2.2), which divides the bubble by that many and multiplies
    the point-to-point traffic by it."""
    gpus = layout.gpus
    m = micro_batches(shape, layout)
    samples = m * layout.dp * layout.micro_batch
    model_flops = samples * model_flops_per_sample(shape)
    work = model_flops + samples * recompute_flops_per_sample(shape, layout.checkpointing)
    share = 1.0
    if shape.kind == Kind.DECODER:
        share = matmul_share(
            width=shape.hidden / layout.tp, rows=layout.micro_batch * shape.seq_len
        )
    peak = card.peak_tflops(precision) * 1e12
    compute = work / (gpus * peak * (mfu if mfu is not None else card.prior) * share)

    links = topology.links(card)
    word = BYTES_32 if precision == Precision.FP32 else BYTES_16
    p, t = layout.pp, layout.tp
    # One micro-batch's activations at a layer boundary: sequence x micro-batch x width.
    activation = shape.seq_len * layout.micro_batch * shape.hidden * word

    tp_comm = 0.0
    if t > 1 and shape.kind == Kind.DECODER:
        collectives = 6 if layout.checkpointing == Checkpointing.FULL else 4
        per_micro = (
            collectives
            * (shape.layers / p)
            * ring_seconds(links, nbytes=activation, group=t, stride=1, factor=2.0)
        )
        tp_comm = per_micro * m

    pp_comm = 0.0
    if p > 1 and shape.kind == Kind.DECODER:
        # Each tensor-parallel rank sends its 1/t of the boundary's activations (Narayanan et al.
        # 2021, Section 4.1, the scatter/gather optimisation), forward and back.
        pp_comm = pipeline_seconds(
            links,
            nbytes=activation / t,
            stage_gpus=t * layout.dp,
            micro_batches=m * virtual_stages,
            stages=p,
        )
    # The bubble idles a stage for p - 1 micro-batch slots of compute and tensor-parallel traffic.
    bubble = (compute + tp_comm) * (p - 1) / (m * virtual_stages)

    dp_comm = 0.0
    if layout.dp > 1:
        n = layout.dp
        local = shape.params / (t * p) * word

        def ring(factor: float) -> float:
            return ring_seconds(links, nbytes=local, group=n, stride=t, factor=factor)

        backward = compute * 2 / 3
        if layout.zero_stage >= 3:
            # Per micro-batch: weights gathered for the forward and again for the backward,
            # gradients reduce-scattered; prefetched beside the whole micro-batch's compute.
            dp_comm = exposed(3 * ring(1.0) * m, window=compute)
        elif layout.zero_stage == 2:
            # Sharded gradients cannot accumulate: a reduce-scatter after every micro-batch's
            # backward, then one all-gather of the updated weights before the next step.
            dp_comm = exposed(ring(1.0) * m, window=backward) + ring(1.0)
        else:
            # DDP (and ZeRO-1, the same volume): one all-reduce, under the last backward pass.
            dp_comm = exposed(ring(2.0), window=backward / m)
    return StepTime(
        compute=compute,
        bubble=bubble,
        tp_comm=tp_comm,
        pp_comm=pp_comm,
        dp_comm=dp_comm,
        micro_batches=m,
        tokens=samples * shape.tokens_per_sample,
        model_flops=model_flops,
        matmul_share=share,
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
