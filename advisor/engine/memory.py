"""Memory per GPU of a training run, by component. Decoder transformers use the model the
harness checks its configs with (``harness.memory``: the ZeRO paper's model states and Korthikanti
et al.'s activations), so a plan that fits is a config the harness starts; CNNs keep their
measured per-sample figure here.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from advisor.engine.presets import Kind, ModelShape
from harness import memory as harness_memory

GB = harness_memory.GB
USABLE_SHARE = harness_memory.USABLE_SHARE


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
    return harness_memory.state_bytes_per_param(
        mixed=precision != Precision.FP32, optimizer=str(optimizer), hidden=hidden
    )


def model_states(
    *, params: float, precision: Precision, optimizer: Optimizer, layout: Layout, hidden: int = 1
) -> tuple[float, float, float]:
    """Bytes per GPU of weights, gradients and optimizer states (ZeRO paper, Section 3.1)."""
    return harness_memory.model_state_bytes(
        params=params,
        mixed=precision != Precision.FP32,
        optimizer=str(optimizer),
        hidden=hidden,
        dp=layout.dp,
        tp=layout.tp,
        pp=layout.pp,
        zero_stage=layout.zero_stage,
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
    return harness_memory.decoder_activation_bytes(
        seq_len=shape.seq_len,
        micro_batch=b,
        hidden=shape.hidden,
        heads=shape.heads,
        layers=shape.layers,
        vocab=shape.vocab,
        tp=layout.tp,
        recompute=str(layout.checkpointing),
        fp32=precision == Precision.FP32,
    )


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
