"""Named decoder-only transformer shapes, and their parameter and FLOP counts.

One definition of each shape the product knows, shared by the harness (which builds the model,
``harness.transformer``) and the advisor (which plans layouts for it). The standard library only:
importing this module needs neither PyTorch nor Django.

The architecture is Llama-like: pre-norm blocks with RMSNorm, causal self-attention with optional
grouped-query attention (``kv_heads`` < ``heads``), a SwiGLU MLP (three bias-free matrices of
``hidden x ffn_hidden``), rotary or learned positions, and an output projection that may share
the token embedding's weights. The GPT-2 presets keep GPT-2's sizes (layers, width, heads,
vocabulary, context, learned positions, tied embeddings) with ``ffn_hidden = 8/3 x hidden``, so
that the SwiGLU MLP has as many weights as GPT-2's 4x GELU one; the counts differ from GPT-2's
published ones only by its biases and LayerNorm shifts (about 0.1 %). The Llama 2 presets match
the published checkpoints' parameter counts exactly.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

Positions = Literal["rope", "learned"]


def default_ffn_hidden(hidden: int, multiple_of: int = 64) -> int:
    """Llama's SwiGLU width: 8/3 x ``hidden``, rounded up to a multiple of ``multiple_of``."""
    width = (8 * hidden + 2) // 3
    return -(-width // multiple_of) * multiple_of


@dataclass(frozen=True)
class TransformerShape:
    """The shape of a decoder-only transformer: everything that sets its parameter count."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn_hidden: int
    vocab_size: int
    seq_len: int  # the longest context: the learned position table's size, the RoPE cache's
    positions: Positions = "rope"
    tie_embeddings: bool = False

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def problems(self) -> list[tuple[str, str]]:
        """(field, what is wrong) for a shape that cannot be built; empty when it can."""
        found: list[tuple[str, str]] = []
        for name in ("layers", "hidden", "heads", "kv_heads", "ffn_hidden", "vocab_size"):
            if getattr(self, name) < 1:
                found.append((name, "must be a positive integer"))
        if found:
            return found
        if self.hidden % self.heads:
            found.append(("hidden", f"must be divisible by heads ({self.hidden} % {self.heads})"))
        elif self.head_dim % 2 and self.positions == "rope":
            found.append(("hidden", "hidden / heads must be even for rotary positions"))
        if self.heads % self.kv_heads:
            found.append(("kv_heads", f"must divide heads ({self.heads} % {self.kv_heads} != 0)"))
        return found

    def param_count(self) -> int:
        """Parameters of the built model (shared embedding weights counted once)."""
        kv_width = self.kv_heads * self.head_dim
        attention = 2 * self.hidden * self.hidden + 2 * self.hidden * kv_width
        mlp = 3 * self.hidden * self.ffn_hidden
        norms = 2 * self.hidden
        per_layer = attention + mlp + norms
        embedding = self.vocab_size * self.hidden
        output = 0 if self.tie_embeddings else self.vocab_size * self.hidden
        positions = self.seq_len * self.hidden if self.positions == "learned" else 0
        return self.layers * per_layer + embedding + output + positions + self.hidden

    def matmul_params(self) -> int:
        """Parameters that cost matmul FLOPs per token: all but the norms and the lookup tables
        (the input embedding, learned positions); the output projection counts once."""
        norms = (2 * self.layers + 1) * self.hidden
        lookups = (0 if self.tie_embeddings else self.vocab_size * self.hidden) + (
            self.seq_len * self.hidden if self.positions == "learned" else 0
        )
        return self.param_count() - norms - lookups

    def train_flops_per_token(self, seq_len: int | None = None) -> int:
        """Training FLOPs (forward + backward) of one token at context ``seq_len``: 6 x matmul
        parameters (Kaplan et al. 2020), plus the attention scores and their weighted sum,
        6 x layers x hidden x seq_len with causal masking counted as half the square (the
        PaLM paper's appendix B counts 12 x layers x hidden x seq_len for the full square).
        Activation recomputation is not useful work and is not counted."""
        context = self.seq_len if seq_len is None else seq_len
        return 6 * self.matmul_params() + 6 * self.layers * self.hidden * context

    def replace(self, **changes: object) -> TransformerShape:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    def to_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)


def _gpt2(layers: int, hidden: int, heads: int) -> TransformerShape:
    return TransformerShape(
        layers=layers,
        hidden=hidden,
        heads=heads,
        kv_heads=heads,
        ffn_hidden=default_ffn_hidden(hidden),
        vocab_size=50257,
        seq_len=1024,
        positions="learned",
        tie_embeddings=True,
    )


def _llama2(layers: int, hidden: int, heads: int, kv_heads: int, ffn: int) -> TransformerShape:
    return TransformerShape(
        layers=layers,
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads,
        ffn_hidden=ffn,
        vocab_size=32000,
        seq_len=4096,
    )


PRESETS: dict[str, TransformerShape] = {
    # For tests and trying the harness on a CPU: byte-level vocabulary, a few thousand weights.
    "tiny": TransformerShape(
        layers=4, hidden=32, heads=4, kv_heads=2, ffn_hidden=64, vocab_size=256, seq_len=128
    ),
    "gpt2-124m": _gpt2(12, 768, 12),
    "gpt2-350m": _gpt2(24, 1024, 16),
    "gpt2-774m": _gpt2(36, 1280, 20),
    "gpt2-1.5b": _gpt2(48, 1600, 25),
    "llama2-7b": _llama2(32, 4096, 32, 32, 11008),
    "llama2-13b": _llama2(40, 5120, 40, 40, 13824),
    "llama2-70b": _llama2(80, 8192, 64, 8, 28672),
}


def preset(name: str) -> TransformerShape:
    """The shape of a named preset; KeyError naming the known ones otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        raise KeyError(f"unknown preset {name!r} (known: {', '.join(PRESETS)})") from None


def param_count(name_or_shape: str | TransformerShape) -> int:
    """Parameters of a preset (by name) or of a shape."""
    shape = preset(name_or_shape) if isinstance(name_or_shape, str) else name_or_shape
    return shape.param_count()
