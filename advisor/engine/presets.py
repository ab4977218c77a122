"""Model shapes the advisor knows by name, and the shape of any decoder from its size.

Figures are the published ones: GPT-2 (Radford et al. 2019, Table 2: layers and width; batch 512
of 1024 tokens), Llama 2 (Touvron et al. 2023, Table 1 and Section 2.2: 4 k context, global batch
of 4 M tokens; 70B uses grouped-query attention with 8 key/value heads), Llama 3 (Grattafiori
et al. 2024, Table 3: 8B has 32 layers, width 4096, 8 KV heads, 128 k vocabulary, 8 k context),
ResNet-50 (He et al. 2016, Table 1: 3.8 G multiply-adds per 224 x 224 image, 25.6 M parameters).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from enum import StrEnum


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

    @property
    def tokens_per_sample(self) -> int:
        return self.seq_len if self.kind == Kind.DECODER else 1

    def training_flops_per_sample(self) -> float:
        """Model FLOPs (forward + backward) per sample: 6 x params per token for a decoder
        (Kaplan et al. 2020), the counted figure for a CNN. Recomputation is not model work."""
        if self.kind == Kind.CNN:
            return self.flops_per_sample
        return 6.0 * self.params * self.seq_len


def _decoder(name, params, layers, hidden, heads, seq_len, vocab, global_batch, micro_batch=1):
    return ModelShape(
        name=name,
        params=params,
        layers=layers,
        hidden=hidden,
        heads=heads,
        seq_len=seq_len,
        vocab=vocab,
        global_batch=global_batch,
        micro_batch=micro_batch,
    )


PRESETS: dict[str, ModelShape] = {
    p.name: p
    for p in (
        _decoder("gpt2-124m", 124e6, 12, 768, 12, 1024, 50257, 512, 8),
        _decoder("gpt2-1.5b", 1.558e9, 48, 1600, 25, 1024, 50257, 512, 8),
        _decoder("llama2-7b", 6.74e9, 32, 4096, 32, 4096, 32000, 1024),
        _decoder("llama2-13b", 13.02e9, 40, 5120, 40, 4096, 32000, 1024),
        _decoder("llama2-70b", 68.98e9, 80, 8192, 64, 4096, 32000, 1024),
        _decoder("llama3-8b", 8.03e9, 32, 4096, 32, 8192, 128256, 512),
        ModelShape(
            name="resnet50",
            params=25.6e6,
            kind=Kind.CNN,
            global_batch=256,
            micro_batch=64,
            # 3.8 G multiply-adds forward = 7.7 GFLOPs; backward doubles it: x3 for training.
            flops_per_sample=3 * 7.7e9,
            # About 30 M activation values kept per 224 x 224 image for the backward pass
            # (approximate), 2 bytes each in 16-bit precision.
            activation_bytes_per_sample=60e6,
        ),
    )
}

# A decoder's width is close to 128 x its depth in both GPT-3 (Brown et al. 2020, Table 2.1:
# 96 layers x 12288) and Llama 2 7B (32 x 4096); its parameters are about 12 x layers x width^2.
_WIDTH_PER_LAYER = 128


def decoder_shape(
    *,
    params: float,
    layers: int | None = None,
    hidden: int | None = None,
    heads: int | None = None,
    seq_len: int = 2048,
    vocab: int = 32000,
    global_batch: int | None = None,
    micro_batch: int = 1,
) -> ModelShape:
    """Any decoder from its size; layers, width and heads not given follow the usual aspect."""
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
    if global_batch is None:
        # About 4 M tokens per step, the Llama 2 batch, and never less than one micro-batch.
        global_batch = max(micro_batch, (4 * 2**20) // seq_len)
    return _decoder(
        "custom", params, layers, hidden, heads, seq_len, vocab, global_batch, micro_batch
    )


def with_run(shape: ModelShape, **changes) -> ModelShape:
    """The shape with the run's own sequence length or batch sizes."""
    return replace(shape, **{k: v for k, v in changes.items() if v is not None})
