"""The model shapes the advisor plans for: the harness's presets (``harness.presets``, one
definition for both), and any decoder from its size, shaped as the harness builds it.

The shapes come from the harness; what only the advisor needs is kept here, keyed by the same
names: the batch a run of the model trains with and, where published, how many tokens it was
trained on. GPT-2 (Radford et al. 2019, Table 2: batch 512 of 1024 tokens); Llama 2 (Touvron
et al. 2023, Section 2.2: global batch of 4 M tokens of 4 k context, 2 T tokens).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from enum import StrEnum

from harness.presets import PRESETS as HARNESS_PRESETS
from harness.presets import TransformerShape, default_ffn_hidden


class Kind(StrEnum):
    DECODER = "decoder"
    CNN = "cnn"


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelShape:
    """What the memory and time models need to know about a network."""

    name: str
    params: float
    kind: Kind = Kind.DECODER
    layers: int = 1
    hidden: int = 1
    heads: int = 1
    seq_len: int = 1
    vocab: int = 0
    # Sequences (images for a CNN) per optimizer step over all GPUs, and per GPU per pass.
    global_batch: int = 1
    micro_batch: int = 1
    # CNN only: training FLOPs per image and 16-bit activation bytes per image.
    flops_per_sample: float = 0.0
    activation_bytes_per_sample: float = 0.0
    # The model the harness builds for this shape (None: one the harness cannot build).
    transformer: TransformerShape | None = None

    @property
    def tokens_per_sample(self) -> int:
        return self.seq_len if self.kind == Kind.DECODER else 1

    @property
    def preset(self) -> str | None:
        """The harness preset this shape is, unchanged; None for any other shape."""
        if self.name in HARNESS_PRESETS and HARNESS_PRESETS[self.name] == self.transformer:
            return self.name
        return None

    def training_flops_per_sample(self) -> float:
        """Model FLOPs (forward + backward) per sample: 6 x params per token for a decoder
        (Kaplan et al. 2020), the counted figure for a CNN. Recomputation is not model work."""
        if self.kind == Kind.CNN:
            return self.flops_per_sample
        return 6.0 * self.params * self.seq_len


@dataclass(frozen=True, slots=True, kw_only=True)
class Training:
    """What the advisor knows of a preset beyond its shape."""

    global_batch: int  # sequences per optimizer step
    micro_batch: int = 1
    published_tokens: float | None = None


TRAINING: dict[str, Training] = {
    "tiny": Training(global_batch=32, micro_batch=8),
    "gpt2-124m": Training(global_batch=512, micro_batch=8),
    "gpt2-350m": Training(global_batch=512, micro_batch=8),
    "gpt2-774m": Training(global_batch=512, micro_batch=8),
    "gpt2-1.5b": Training(global_batch=512, micro_batch=8),
    "llama2-7b": Training(global_batch=1024, published_tokens=2e12),
    "llama2-13b": Training(global_batch=1024, published_tokens=2e12),
    "llama2-70b": Training(global_batch=1024, published_tokens=2e12),
}


def from_transformer(
    name: str,
    shape: TransformerShape,
    *,
    global_batch: int,
    micro_batch: int = 1,
    params: float | None = None,
) -> ModelShape:
    """The advisor's view of a harness shape (its parameter count unless one is given)."""
    return ModelShape(
        name=name,
        params=float(shape.param_count() if params is None else params),
        layers=shape.layers,
        hidden=shape.hidden,
        heads=shape.heads,
        seq_len=shape.seq_len,
        vocab=shape.vocab_size,
        global_batch=global_batch,
        micro_batch=micro_batch,
        transformer=shape,
    )


PRESETS: dict[str, ModelShape] = {
    name: from_transformer(
        name,
        HARNESS_PRESETS[name],
        global_batch=training.global_batch,
        micro_batch=training.micro_batch,
    )
    for name, training in TRAINING.items()
}

# A decoder's width is close to 128 x its depth in both GPT-3 (Brown et al. 2020, Table 2.1:
# 96 layers x 12288) and Llama 2 7B (32 x 4096); its parameters are about 12 x layers x width^2.
_WIDTH_PER_LAYER = 128
# The MLP widths a decoder of a given size is shaped with, in multiples of its width: from 2x up to
# 4x (GPT-3's GELU MLP; Llama 2 70B's SwiGLU is 3.5x).
FFN_RANGE = (2.0, 4.0)
FFN_MULTIPLE = 64
# How far a stated parameter count may be from the count of the shape it is given with.
PARAMS_TOLERANCE = 0.10


class ShapeMismatch(ValueError):
    """A parameter count that contradicts the shape it came with."""

    def __init__(self, *, params: float, shape_params: float) -> None:
        self.params = params
        self.shape_params = shape_params
        super().__init__(
            f"a decoder of this shape has {shape_params / 1e9:.3g} B parameters, not "
            f"{params / 1e9:.3g} B (more than {PARAMS_TOLERANCE:.0%} apart): give params_b or "
            "the shape that matches"
        )


def _fitted_ffn(*, params: float, base: TransformerShape) -> int:
    """The MLP width (a multiple of 64, within FFN_RANGE x hidden) closest to ``params``."""
    per_ffn_unit = 3 * base.hidden * base.layers
    rest = base.replace(ffn_hidden=0).param_count()
    wanted = (params - rest) / per_ffn_unit
    low, high = (math.ceil(r * base.hidden / FFN_MULTIPLE) * FFN_MULTIPLE for r in FFN_RANGE)
    return max(low, min(high, round(wanted / FFN_MULTIPLE) * FFN_MULTIPLE))


def decoder_shape(
    *,
    params: float,
    layers: int | None = None,
    hidden: int | None = None,
    heads: int | None = None,
    kv_heads: int | None = None,
    ffn_hidden: int | None = None,
    seq_len: int = 2048,
    vocab: int = 32000,
    global_batch: int | None = None,
    micro_batch: int = 1,
) -> ModelShape:
    """Any decoder from its size, as the harness builds it (rotary positions, SwiGLU MLP, untied
    embeddings); layers, width and heads not given follow the usual aspect, and the MLP width
    not given is the one that makes the count ``params`` (``params_mismatch`` says when the
    shape given cannot)."""
    if params <= 0 or not math.isfinite(params):
        raise ValueError("params must be a positive number")
    if layers is None:
        layers = max(1, round((params / (12 * _WIDTH_PER_LAYER**2)) ** (1 / 3)))
    if hidden is None:
        hidden = max(128, round(math.sqrt(params / (12 * layers)) / 128) * 128)
    if heads is None:
        heads = max(1, hidden // 128)
    if min(layers, hidden, heads, seq_len, micro_batch) <= 0:
        raise ValueError("layers, hidden, heads, seq_len and micro_batch must be positive")
    transformer = TransformerShape(
        layers=layers,
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads or heads,
        ffn_hidden=ffn_hidden or default_ffn_hidden(hidden),
        vocab_size=vocab,
        seq_len=seq_len,
    )
    if ffn_hidden is None:
        transformer = transformer.replace(ffn_hidden=_fitted_ffn(params=params, base=transformer))
    if global_batch is None:
        # About 4 M tokens per step, the Llama 2 batch, and never less than one micro-batch.
        global_batch = max(micro_batch, (4 * 2**20) // seq_len)
    return from_transformer(
        "custom",
        transformer,
        global_batch=global_batch,
        micro_batch=micro_batch,
        params=params,
    )


def params_mismatch(shape: ModelShape) -> ShapeMismatch | None:
    """The mismatch between a shape's stated parameter count and the count of the model the
    harness builds for it, when more than PARAMS_TOLERANCE apart."""
    if shape.transformer is None:
        return None
    counted = shape.transformer.param_count()
    if abs(counted - shape.params) > PARAMS_TOLERANCE * shape.params:
        return ShapeMismatch(params=shape.params, shape_params=counted)
    return None


def with_run(shape: ModelShape, **changes) -> ModelShape:
    """The shape with the run's own sequence length or batch sizes (a longer context than the
    model's own is a model with a larger position table or RoPE cache: the harness's shape
    follows)."""
    changes = {k: v for k, v in changes.items() if v is not None}
    if shape.transformer is not None and "seq_len" in changes:
        changes["transformer"] = shape.transformer.replace(seq_len=changes["seq_len"])
        if shape.transformer.positions == "learned":
            changes["params"] = float(changes["transformer"].param_count())
    return replace(shape, **changes)
