"""The built-in models: the MNIST-example CNN, a small ResNet and a small GPT-style decoder.

Every model maps a batch of inputs to logits and honours ``activation_checkpointing``: when set,
its repeated blocks are recomputed in the backward pass instead of keeping their activations
(``torch.utils.checkpoint``, non-reentrant), trading about one extra forward for memory.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from harness.config import GptConfig, MnistCnnConfig, ModelConfig, ResNetConfig


class HarnessModel(nn.Module):
    """Base of the built-in models: the ``activation_checkpointing`` switch and compile hints."""

    activation_checkpointing: bool = False
    # Whether torch.compile may use inductor's channels-last layout optimisation on this model.
    inductor_layout_optimization: bool = True

    def _run(self, fn: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
        if self.activation_checkpointing and self.training and torch.is_grad_enabled():
            return checkpoint(fn, x, use_reentrant=False)
        return fn(x)


class MnistCnn(HarnessModel):
    """The CNN of the PyTorch MNIST example (pytorch/examples, mnist/main.py).

    Two 3x3 convolutions, max-pooling, dropout, two linear layers. The example hard-codes 9216
    inputs to ``fc1`` for 28x28 images; here it follows from the image size, so 8x8 digits work.
    It returns logits (the example returns log-softmax and uses NLL, which is the same loss as
    cross-entropy on logits).
    """

    # torch 2.13's inductor, with its layout optimisation on, returns all-zero gradients for
    # the convolutions ahead of this max-pool (reproduced on CPU with conv-relu-conv-relu-
    # maxpool-linear-relu-linear); compiled without it, the gradients match eager mode.
    inductor_layout_optimization = False

    def __init__(
        self, *, in_channels: int, image_size: int, num_classes: int, dropout: bool = True
    ) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25 if dropout else 0.0)
        self.dropout2 = nn.Dropout(0.5 if dropout else 0.0)
        pooled = (image_size - 4) // 2
        self.fc1 = nn.Linear(64 * pooled * pooled, 128)
        self.fc2 = nn.Linear(128, num_classes)

    def _features(self, x: Tensor) -> Tensor:
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.max_pool2d(x, 2)
        return torch.flatten(self.dropout1(x), 1)

    def forward(self, x: Tensor) -> Tensor:
        x = self._run(self._features, x)
        x = self.dropout2(F.relu(self.fc1(x)))
        return self.fc2(x)


def _group_norm(channels: int) -> nn.GroupNorm:
    # GroupNorm rather than BatchNorm: its output does not depend on the batch, so N DDP ranks
    # with batch B train exactly like one process with batch N x B (BatchNorm would need
    # SyncBatchNorm, which is CUDA-only).
    groups = math.gcd(channels, 8)
    return nn.GroupNorm(groups, channels)


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with a residual connection (He et al., 2015)."""

    def __init__(self, in_channels: int, out_channels: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride, 1, bias=False)
        self.norm1 = _group_norm(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, 1, 1, bias=False)
        self.norm2 = _group_norm(out_channels)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride, bias=False),
                _group_norm(out_channels),
            )

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.norm1(self.conv1(x)))
        out = self.norm2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet(HarnessModel):
    """A small ResNet for small images: a 3x3 stem, stages of basic blocks, global pooling."""

    def __init__(
        self, *, in_channels: int, num_classes: int, widths: list[int], blocks_per_stage: int
    ) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, widths[0], 3, 1, 1, bias=False),
            _group_norm(widths[0]),
            nn.ReLU(),
        )
        blocks = []
        channels = widths[0]
        for stage, width in enumerate(widths):
            for index in range(blocks_per_stage):
                stride = 2 if stage > 0 and index == 0 else 1
                blocks.append(BasicBlock(channels, width, stride))
                channels = width
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(channels, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = self._run(block, x)
        return self.head(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention through ``scaled_dot_product_attention`` (flash or
    memory-efficient kernels where the device has them)."""

    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.dropout = dropout
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        batch, seq, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        q, k, v = (t.view(batch, seq, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).contiguous().view(batch, seq, width)
        return self.resid_dropout(self.proj(y))


class GptBlock(nn.Module):
    """Pre-norm transformer block: attention and a 4x GELU MLP, each around a residual."""

    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads, dropout)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width),
            nn.GELU(),
            nn.Linear(4 * width, width),
            nn.Dropout(dropout),
        )

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Gpt(HarnessModel):
    """A small GPT-2-style decoder with learned positions and tied input/output embeddings."""

    def __init__(
        self, *, vocab_size: int, seq_len: int, layers: int, width: int, heads: int, dropout: float
    ) -> None:
        super().__init__()
        self.seq_len = seq_len
        self.tok_emb = nn.Embedding(vocab_size, width)
        self.pos_emb = nn.Embedding(seq_len, width)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(GptBlock(width, heads, dropout) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab_size, bias=False)
        self.lm_head.weight = self.tok_emb.weight
        self.apply(self._init_weights)
        # GPT-2 scales the residual output projections by 1/sqrt(2 x layers) so the residual
        # stream's variance does not grow with depth.
        for name, param in self.named_parameters():
            if name.endswith("attn.proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * layers))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: Tensor) -> Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(positions))
        for block in self.blocks:
            x = self._run(block, x)
        return self.lm_head(self.ln_f(x))

    def flops_params(self) -> int:
        """Parameters that cost matmul FLOPs per token: all but the position table (a lookup).
        The tied token embedding counts once, as the output projection."""
        return sum(p.numel() for p in self.parameters()) - self.pos_emb.weight.numel()


def build_model(
    config: ModelConfig,
    *,
    num_classes: int = 10,
    in_channels: int = 1,
    image_size: int = 28,
    vocab_size: int = 256,
    seq_len: int = 128,
) -> nn.Module:
    """Instantiate the model a config names, with the shapes the dataset dictates."""
    if isinstance(config, MnistCnnConfig):
        return MnistCnn(
            in_channels=in_channels,
            image_size=image_size,
            num_classes=num_classes,
            dropout=config.dropout,
        )
    if isinstance(config, ResNetConfig):
        return ResNet(
            in_channels=in_channels,
            num_classes=num_classes,
            widths=list(config.widths),
            blocks_per_stage=config.blocks_per_stage,
        )
    if isinstance(config, GptConfig):
        return Gpt(
            vocab_size=vocab_size,
            seq_len=seq_len,
            layers=config.layers,
            width=config.width,
            heads=config.heads,
            dropout=config.dropout,
        )
    raise TypeError(f"unknown model config {config!r}")
