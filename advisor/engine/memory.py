"""Memory per GPU of a training run, by component.

Model states follow the ZeRO paper (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward
Training Trillion Parameter Models", Section 3.1 and Figure 1): mixed-precision Adam keeps 2 bytes
of 16-bit weights, 2 of 16-bit gradients and K = 12 of optimizer states (fp32 master weights and
two moments) per parameter; stage 1 shards the optimizer states over the data-parallel ranks,
stage 2 the gradients as well, stage 3 the weights too. Tensor and pipeline parallelism split the
parameters each GPU holds before ZeRO shards them.

Activations follow Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models" (Section 4, Table 2): per transformer layer and micro-batch, with sequence s,
micro-batch b, width h and a heads, sbh(34 + 5as/h) bytes in 16-bit without recomputation; with
tensor parallelism t and sequence parallelism everything divides by t; selective recomputation
(the attention core) keeps sbh x 34 / t; full recomputation keeps the 2sbh/t layer inputs, plus
one layer's full set while it is recomputed. With the 1F1B pipeline schedule the first stage
holds p micro-batches of L/p layers: L layers' worth whatever p (Section 4.2.3). The logits for
the loss add 4sbv/t bytes (fp32). 32-bit training doubles every activation.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from advisor.engine.presets import Kind, ModelShape

GB = 1e9
# The share of a card's memory a run can use: the CUDA context, the allocator's fragmentation
# and the communication buffers take the rest (approximate).
USABLE_SHARE = 0.9


class Precision(StrEnum):
    BF16 = "bf16"
    FP16 = "fp16"
    FP32 = "fp32"


class Optimizer(StrEnum):
    ADAMW = "adamw"
    SGD = "sgd"  # with momentum
    ADAFACTOR = "adafactor"


class Checkpointing(StrEnum):
    NONE = "none"
    SELECTIVE = "selective"
    FULL = "full"


@dataclass(frozen=True, slots=True, kw_only=True)
class Layout:
    """How a run is split over its GPUs."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    zero_stage: int = 0
    micro_batch: int = 1
    checkpointing: Checkpointing = Checkpointing.NONE

    @property
    def gpus(self) -> int:
        return self.dp * self.tp * self.pp

    def to_dict(self) -> dict:
        return {
            "dp": self.dp,
            "tp": self.tp,
            "pp": self.pp,
            "zero_stage": self.zero_stage,
            "micro_batch": self.micro_batch,
            "checkpointing": str(self.checkpointing),
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class Memory:
    """Bytes per GPU, by component."""

    params: float
    grads: float
    optimizer: float
    activations: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations

    def gb(self) -> dict[str, float]:
        return {
            "params": round(self.params / GB, 2),
            "grads": round(self.grads / GB, 2),
            "optimizer": round(self.optimizer / GB, 2),
            "activations": round(self.activations / GB, 2),
            "total": round(self.total / GB, 2),
        }


def state_bytes_per_param(
    precision: Precision, optimizer: Optimizer, hidden: int
) -> tuple[float, float, float]:
    """(weights, gradients, optimizer states) in bytes per parameter."""
    mixed = precision != Precision.FP32
    weights = grads = 2.0 if mixed else 4.0
    master = 4.0 if mixed else 0.0
    if optimizer == Optimizer.ADAMW:
        states = 8.0  # two fp32 moments
    elif optimizer == Optimizer.SGD:
        states = 4.0  # one fp32 momentum
    else:
        # Adafactor (Shazeer and Stern 2018) keeps a row and a column factor of the second
        # moment, fp32, per weight matrix: about 2 / width values per parameter, no momentum.
        states = 4.0 * 2.0 / max(hidden, 1)
    return weights, grads, master + states


def model_states(
    *, params: float, precision: Precision, optimizer: Optimizer, layout: Layout, hidden: int = 1
) -> tuple[float, float, float]:
    """Bytes per GPU of weights, gradients and optimizer states (ZeRO paper, Section 3.1)."""
    local = params / (layout.tp * layout.pp)
    w, g, o = state_bytes_per_param(precision, optimizer, hidden)
    dp, stage = layout.dp, layout.zero_stage
    return (
        local * w / (dp if stage >= 3 else 1),
        local * g / (dp if stage >= 2 else 1),
        local * o / (dp if stage >= 1 else 1),
    )


def activations(*, shape: ModelShape, precision: Precision, layout: Layout) -> float:
    """Activation bytes per GPU at the peak (first pipeline stage)."""
    scale = 2.0 if precision == Precision.FP32 else 1.0
    b = layout.micro_batch
    if shape.kind == Kind.CNN:
        per_batch = shape.activation_bytes_per_sample * b
        # Full recomputation keeps about the square root of the blocks' activations
        # (Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost"); ResNet-50 has 16.
        if layout.checkpointing == Checkpointing.FULL:
            per_batch /= 4
        return per_batch * scale
    s, h, a, t, L = shape.seq_len, shape.hidden, shape.heads, layout.tp, shape.layers
    sbh = s * b * h
    full_layer = sbh * (34 / t + 5 * a * s / (h * t))
    if layout.checkpointing == Checkpointing.NONE:
        layers = L * full_layer
    elif layout.checkpointing == Checkpointing.SELECTIVE:
        layers = L * sbh * 34 / t
    else:
        layers = L * 2 * sbh / t + full_layer
    logits = 4 * s * b * shape.vocab / t
    return (layers + logits) * scale


def per_gpu(
    *, shape: ModelShape, precision: Precision, optimizer: Optimizer, layout: Layout
) -> Memory:
    p, g, o = model_states(
        params=shape.params,
        precision=precision,
        optimizer=optimizer,
        layout=layout,
        hidden=shape.hidden,
    )
    return Memory(
        params=p,
        grads=g,
        optimizer=o,
        activations=activations(shape=shape, precision=precision, layout=layout),
    )


def fits(memory: Memory, card_memory_gb: float) -> bool:
    return memory.total <= card_memory_gb * GB * USABLE_SHARE
