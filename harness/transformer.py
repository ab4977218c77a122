"""A Llama-like decoder-only transformer built from a ``harness.presets.TransformerShape``.

Pre-norm blocks (RMSNorm), causal self-attention with grouped-query heads, a SwiGLU MLP, rotary
or learned positions, optionally tied input/output embeddings; no biases. The layout code
(``harness.parallel``) relies on three properties of this module:

* ``layers`` is a ModuleDict keyed by the layer's index, and a pipeline stage is this same class
  with the modules of other stages set to None, so every parameter keeps one fully qualified name
  (``layers.3.attention.wq.weight``) whatever the layout: sharded checkpoints written by one
  layout load into another.
* Attention infers its local head count from the projections' outputs, so it runs unchanged
  when tensor parallelism gives each rank a slice of the heads.
* Weights are initialised per parameter name from the seed (``init_weights``), on whatever
  slice of the parameter a rank holds, so every layout starts from the same model without
  ever materialising the whole model in one process.
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from harness.presets import TransformerShape

ROPE_THETA = 10000.0
NORM_EPS = 1e-5
INIT_STD = 0.02


def rope_tables(head_dim: int, seq_len: int, device: torch.device | None = None) -> Tensor:
    """cos and sin of the rotary angles, stacked: shape (2, seq_len, head_dim / 2), fp32."""
    inv_freq = 1.0 / ROPE_THETA ** (
        torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim
    )
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    return torch.stack([angles.cos(), angles.sin()])


def apply_rope(x: Tensor, rope: Tensor) -> Tensor:
    """Rotate (batch, seq, heads, head_dim) by the angles of its positions (the two halves of
    head_dim as the pairs, as GPT-NeoX does), computed in fp32."""
    cos, sin = rope[0][None, :, None, :], rope[1][None, :, None, :]
    first, second = x.float().chunk(2, dim=-1)
    rotated = torch.cat([first * cos - second * sin, first * sin + second * cos], dim=-1)
    return rotated.type_as(x)


class Attention(nn.Module):
    """Causal self-attention through ``scaled_dot_product_attention``; ``kv_heads`` < ``heads``
    shares each key/value head between ``heads / kv_heads`` query heads."""

    def __init__(self, shape: TransformerShape, dropout: float) -> None:
        super().__init__()
        self.head_dim = shape.head_dim
        self.wq = nn.Linear(shape.hidden, shape.heads * self.head_dim, bias=False)
        self.wk = nn.Linear(shape.hidden, shape.kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(shape.hidden, shape.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(shape.heads * self.head_dim, shape.hidden, bias=False)
        self.dropout = dropout
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor, rope: Tensor | None) -> Tensor:
        batch, seq, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds a slice of them.
        q = self.wq(x).view(batch, seq, -1, self.head_dim)
        k = self.wk(x).view(batch, seq, -1, self.head_dim)
        v = self.wv(x).view(batch, seq, -1, self.head_dim)
        if rope is not None:
            q, k = apply_rope(q, rope), apply_rope(k, rope)
        groups = q.shape[2] // k.shape[2]
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=2), v.repeat_interleave(groups, dim=2)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            dropout_p=self.dropout if self.training else 0.0,
            is_causal=True,
        )
        return self.resid_dropout(self.wo(y.transpose(1, 2).reshape(batch, seq, -1)))


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, shape: TransformerShape, dropout: float) -> None:
        super().__init__()
        self.w1 = nn.Linear(shape.hidden, shape.ffn_hidden, bias=False)
        self.w2 = nn.Linear(shape.ffn_hidden, shape.hidden, bias=False)
        self.w3 = nn.Linear(shape.hidden, shape.ffn_hidden, bias=False)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.w2(F.silu(self.w1(x)) * self.w3(x)))


class Block(nn.Module):
    """Pre-norm residual block. ``recompute`` (set by the layout) chooses what the backward pass
    recomputes instead of keeping: ``full`` the whole block (only its input is kept),
    ``selective`` the attention half (norm, projections, attention; its activations grow with
    heads x sequence while the MLP's are cheap to keep relative to their recompute cost), or
    ``none``."""

    def __init__(self, shape: TransformerShape, dropout: float) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(shape.hidden, eps=NORM_EPS)
        self.attention = Attention(shape, dropout)
        self.ffn_norm = nn.RMSNorm(shape.hidden, eps=NORM_EPS)
        self.feed_forward = FeedForward(shape, dropout)
        self.recompute = "none"

    def _attend(self, x: Tensor, rope: Tensor | None) -> Tensor:
        return self.attention(self.attention_norm(x), rope)

    def _block(self, x: Tensor, rope: Tensor | None) -> Tensor:
        h = x + self._attend(x, rope)
        return h + self.feed_forward(self.ffn_norm(h))

    def forward(self, x: Tensor, rope: Tensor | None) -> Tensor:
        if self.recompute == "none" or not (self.training and torch.is_grad_enabled()):
            return self._block(x, rope)
        if self.recompute == "full":
            return checkpoint(self._block, x, rope, use_reentrant=False)
        h = x + checkpoint(self._attend, x, rope, use_reentrant=False)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """The decoder: token ids (batch, seq) to logits (batch, seq, vocab). A pipeline stage has
    some of ``tok_embeddings``, ``pos_embeddings``, ``norm``, ``output`` set to None and fewer
    ``layers``: the first stage takes token ids, the others hidden states; the last returns
    logits, the others hidden states."""

    def __init__(self, shape: TransformerShape, dropout: float = 0.0) -> None:
        super().__init__()
        self.shape = shape
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(shape.vocab_size, shape.hidden)
        self.pos_embeddings: nn.Embedding | None = (
            nn.Embedding(shape.seq_len, shape.hidden) if shape.positions == "learned" else None
        )
        self.drop = nn.Dropout(dropout)
        self.layers = nn.ModuleDict({str(i): Block(shape, dropout) for i in range(shape.layers)})
        self.norm: nn.RMSNorm | None = nn.RMSNorm(shape.hidden, eps=NORM_EPS)
        self.output: nn.Linear | None = nn.Linear(shape.hidden, shape.vocab_size, bias=False)
        if shape.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        rope = rope_tables(shape.head_dim, shape.seq_len) if shape.positions == "rope" else None
        self.register_buffer("rope", rope, persistent=False)

    def reset_buffers(self, device: torch.device) -> None:
        """Recompute the RoPE tables (after ``to_empty`` left them uninitialised)."""
        if self.shape.positions == "rope":
            self.rope = rope_tables(self.shape.head_dim, self.shape.seq_len, device)

    def forward(self, x: Tensor) -> Tensor:
        seq = x.shape[1]
        if self.tok_embeddings is not None:
            h = self.tok_embeddings(x)
            if self.pos_embeddings is not None:
                h = h + self.pos_embeddings(torch.arange(seq, device=x.device))
            x = self.drop(h)
        rope = self.rope[:, :seq] if self.rope is not None else None
        for layer in self.layers.values():
            x = layer(x, rope)
        if self.norm is not None:
            x = self.norm(x)
        if self.output is not None:
            x = self.output(x)
        return x


def _init_std(name: str, layers: int) -> float | None:
    """The normal std of a parameter by its name; None for norm gains (ones)."""
    if name.endswith("norm.weight"):
        return None
    # GPT-2's scaling of the projections that write into the residual stream, so its variance
    # does not grow with depth.
    if name.endswith("attention.wo.weight") or name.endswith("feed_forward.w2.weight"):
        return INIT_STD / math.sqrt(2 * layers)
    return INIT_STD


def _generator(seed: int, name: str) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))


@torch.no_grad()
def init_weights(model: Transformer, seed: int, device: torch.device) -> None:
    """Initialise every parameter this rank holds from ``seed`` and the parameter's name.

    Each parameter's full value is drawn on the CPU from its own generator and this rank keeps
    its slice (a DTensor's local shard under FSDP or tensor parallelism): the weights are the same
    for every layout and pipeline split, at the price of each rank drawing every full parameter
    it holds a slice of, one at a time."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    model.reset_buffers(device)
    for name, param in model.named_parameters():
        std = _init_std(name, model.shape.layers)
        if std is None:
            full = torch.ones(param.shape)
        else:
            full = torch.empty(param.shape).normal_(0.0, std, generator=_generator(seed, name))
        full = full.to(device=device, dtype=param.dtype)
        if isinstance(param, DTensor):
            # src_data_rank=None: every rank drew the same values, so no rank sends any.
            param.copy_(
                distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
            )
        else:
            param.copy_(full)


def build_transformer(shape: TransformerShape, *, dropout: float = 0.0) -> Transformer:
    """The model on the meta device (no memory): parallelise it, ``to_empty`` it onto the
    training device, then ``init_weights``."""
    with torch.device("meta"):
        return Transformer(shape, dropout)
