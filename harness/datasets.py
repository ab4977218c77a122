"""Datasets that need no download, and the deterministic sharded batch order.

* ``digits``: scikit-learn's bundled 8x8 digits (1797 images), 80/20 split by a fixed permutation,
  so every run and every seed evaluates on the same 360 images.
* ``synthetic``: generated from the seed; images labelled by a fixed random linear rule, or token
  sequences that are arithmetic progressions modulo the vocabulary (both learnable, so the loss
  falls and a broken training loop shows).
* ``text``: the public-domain texts in ``harness/data/`` (or the rental's own text at
  ``data.path``, a dataset mounted under /data), byte-level tokens, last 10 % for eval.
* ``tokens``: pre-tokenized flat arrays (uint16 or uint32) read through a memory map, in
  non-overlapping windows of ``seq_len + 1`` tokens (consecutive windows share one boundary
  token); the last ``eval_fraction`` of each file's windows are the eval split. Which windows a
  step reads is ``ShardedBatches``' permutation: a function of the seed, the step and the
  data-parallel rank. Without ``data.path`` it reads the bundled texts as byte tokens.

Datasets other than ``tokens`` live on the training device as whole tensors: they are small,
and indexing a device tensor avoids a host-to-device copy and a worker pool per step.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

import numpy as np
import torch
from torch import Tensor

from harness.config import (
    LANGUAGE_MODELS,
    ConfigError,
    DataConfig,
    DigitsDataConfig,
    ModelConfig,
    SyntheticDataConfig,
    TextDataConfig,
    TokensDataConfig,
)
from harness.paths import data_dir

TEXT_DIR = Path(__file__).with_name("data")
TEXT_FILES = ("gettysburg_address.txt", "declaration_of_independence.txt")
TEXT_EVAL_FRACTION = 0.1
DIGITS_TEST_SIZE = 360
DIGITS_SPLIT_SEED = 0
NUM_CLASSES = 10


class Dataset(Protocol):
    """A dataset addressable by a tensor of indices."""

    def __len__(self) -> int: ...

    def batch(self, indices: Tensor) -> tuple[Tensor, Tensor]: ...


@dataclass(frozen=True)
class TensorPairs:
    """Inputs and targets as two tensors with a common first dimension."""

    inputs: Tensor
    targets: Tensor

    def __len__(self) -> int:
        return self.inputs.shape[0]

    def batch(self, indices: Tensor) -> tuple[Tensor, Tensor]:
        return self.inputs[indices], self.targets[indices]


@dataclass(frozen=True)
class TokenWindows:
    """Every window of ``seq_len + 1`` consecutive tokens of a stream (inputs, shifted targets)."""

    tokens: Tensor
    seq_len: int

    def __len__(self) -> int:
        return max(self.tokens.numel() - self.seq_len, 0)

    def batch(self, indices: Tensor) -> tuple[Tensor, Tensor]:
        offsets = torch.arange(self.seq_len + 1, device=self.tokens.device)
        windows = self.tokens[indices[:, None] + offsets]
        return windows[:, :-1], windows[:, 1:]


class TokenFileWindows:
    """Windows of ``seq_len + 1`` tokens at multiples of ``seq_len`` in token arrays (memory
    maps), ``ranges[i]`` = (first, end) window numbers of array ``i`` that belong to this split.
    A batch is read on the host and copied to ``device``."""

    def __init__(
        self,
        arrays: list[np.ndarray],
        ranges: list[tuple[int, int]],
        *,
        seq_len: int,
        vocab_size: int,
        device: torch.device,
    ) -> None:
        self.arrays = arrays
        self.first = np.array([first for first, _ in ranges], dtype=np.int64)
        self.ends = np.cumsum([end - first for first, end in ranges], dtype=np.int64)
        self.seq_len = seq_len
        self.vocab_size = vocab_size
        self.device = device

    def __len__(self) -> int:
        return int(self.ends[-1]) if len(self.ends) else 0

    def batch(self, indices: Tensor) -> tuple[Tensor, Tensor]:
        wanted = indices.cpu().numpy()
        files = np.searchsorted(self.ends, wanted, side="right")
        windows = np.empty((len(wanted), self.seq_len + 1), dtype=np.int64)
        for row, (index, file) in enumerate(zip(wanted, files, strict=True)):
            before = self.ends[file - 1] if file else 0
            start = (self.first[file] + index - before) * self.seq_len
            windows[row] = self.arrays[file][start : start + self.seq_len + 1]
        if windows.size and windows.max() >= self.vocab_size:
            raise ValueError(
                f"token id {int(windows.max())} is outside the model's vocabulary "
                f"({self.vocab_size}): model.vocab_size must cover the token files"
            )
        tokens = torch.from_numpy(windows).to(self.device, non_blocking=True)
        return tokens[:, :-1], tokens[:, 1:]


def _token_arrays(config: TokensDataConfig) -> list[np.ndarray]:
    """The token arrays of ``data.path`` (memory maps), or the bundled texts' bytes."""
    if not config.path:
        text = np.frombuffer(load_text_corpus().encode("utf-8"), dtype=np.uint8)
        return [text.astype(np.dtype(config.dtype))]
    target = data_dir() / config.path
    if target.is_dir():
        files = sorted(p for p in target.rglob("*.bin") if p.is_file())
        if not files:
            raise ConfigError([("data.path", f"{target} holds no .bin token file")])
    elif target.is_file():
        files = [target]
    else:
        raise ConfigError([("data.path", f"{target} does not exist")])
    arrays = []
    for path in files:
        if path.stat().st_size == 0:
            continue
        try:
            arrays.append(np.memmap(path, dtype=np.dtype(config.dtype), mode="r"))
        except (OSError, ValueError) as exc:
            raise ConfigError(
                [("data.path", f"{path} is not a flat {config.dtype} array: {exc}")]
            ) from None
    return arrays


def _tokens(
    config: TokensDataConfig, vocab_size: int, device: torch.device
) -> tuple[TokenFileWindows, TokenFileWindows, DatasetInfo]:
    arrays = _token_arrays(config)
    train_ranges, eval_ranges = [], []
    for array in arrays:
        windows = max((len(array) - 1) // config.seq_len, 0)
        held_out = int(windows * config.eval_fraction)
        train_ranges.append((0, windows - held_out))
        eval_ranges.append((windows - held_out, windows))
    train = TokenFileWindows(
        arrays, train_ranges, seq_len=config.seq_len, vocab_size=vocab_size, device=device
    )
    evaluation = TokenFileWindows(
        arrays, eval_ranges, seq_len=config.seq_len, vocab_size=vocab_size, device=device
    )
    if len(train) == 0:
        raise ConfigError(
            [("data.path", f"holds no training window of {config.seq_len + 1} tokens")]
        )
    info = DatasetInfo("lm", 0, 0, 0, vocab_size, config.seq_len)
    return train, evaluation, info


@dataclass(frozen=True)
class DatasetInfo:
    """What the model needs to know about the data."""

    task: Literal["classification", "lm"]
    num_classes: int
    in_channels: int
    image_size: int
    vocab_size: int
    seq_len: int


class ByteTokenizer:
    """UTF-8 bytes as tokens: a fixed vocabulary of 256, lossless for any text."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, tokens: list[int]) -> str:
        return bytes(tokens).decode("utf-8", errors="replace")


def load_text_corpus() -> str:
    """The bundled public-domain texts, concatenated with a blank line between them."""
    return "\n\n".join((TEXT_DIR / name).read_text(encoding="utf-8") for name in TEXT_FILES)


def load_text_file(path: str) -> str:
    """The text at `path` (relative: under GPUMARKET_DATA_DIR, harness.paths.data_dir): a file, or
    the *.txt files of a directory in name order with a blank line between them."""
    base = data_dir()
    target = base / path
    try:
        if target.is_dir():
            files = sorted(p for p in target.rglob("*.txt") if p.is_file())
            if not files:
                raise ConfigError([("data.path", f"{target} holds no .txt file")])
            return "\n\n".join(p.read_text(encoding="utf-8") for p in files)
        return target.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError([("data.path", f"{target} does not exist")]) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(
            [("data.path", f"{target} cannot be read as UTF-8 text: {exc}")]
        ) from None


def _digits(device: torch.device) -> tuple[TensorPairs, TensorPairs, DatasetInfo]:
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = torch.from_numpy(digits.images.astype(np.float32) / 16.0).unsqueeze(1)
    labels = torch.from_numpy(digits.target.astype(np.int64))
    order = torch.from_numpy(np.random.RandomState(DIGITS_SPLIT_SEED).permutation(len(labels)))
    test, train = order[:DIGITS_TEST_SIZE], order[DIGITS_TEST_SIZE:]
    info = DatasetInfo("classification", NUM_CLASSES, 1, 8, 0, 0)
    return (
        TensorPairs(images[train].to(device), labels[train].to(device)),
        TensorPairs(images[test].to(device), labels[test].to(device)),
        info,
    )


def _synthetic_images(
    config: SyntheticDataConfig, seed: int, device: torch.device
) -> tuple[TensorPairs, TensorPairs, DatasetInfo]:
    generator = torch.Generator().manual_seed(seed)
    shape = (config.channels, config.image_size, config.image_size)
    rule = torch.randn(int(np.prod(shape)), NUM_CLASSES, generator=generator)

    def sample(count: int) -> TensorPairs:
        images = torch.randn((count, *shape), generator=generator)
        labels = (images.flatten(1) @ rule).argmax(dim=1)
        return TensorPairs(images.to(device), labels.to(device))

    train = sample(config.num_samples)
    evaluation = sample(max(config.num_samples // 8, 1))
    info = DatasetInfo("classification", NUM_CLASSES, config.channels, config.image_size, 0, 0)
    return train, evaluation, info


def _synthetic_tokens(
    config: SyntheticDataConfig, seed: int, device: torch.device
) -> tuple[TensorPairs, TensorPairs, DatasetInfo]:
    generator = torch.Generator().manual_seed(seed)
    steps = torch.arange(config.seq_len + 1)

    def sample(count: int) -> TensorPairs:
        start = torch.randint(config.vocab_size, (count, 1), generator=generator)
        stride = torch.randint(1, config.vocab_size, (count, 1), generator=generator)
        sequences = (start + stride * steps) % config.vocab_size
        return TensorPairs(sequences[:, :-1].to(device), sequences[:, 1:].to(device))

    train = sample(config.num_samples)
    evaluation = sample(max(config.num_samples // 8, 1))
    info = DatasetInfo("lm", 0, 0, 0, config.vocab_size, config.seq_len)
    return train, evaluation, info


def _text(
    config: TextDataConfig, device: torch.device
) -> tuple[TokenWindows, TokenWindows, DatasetInfo]:
    text = load_text_file(config.path) if config.path else load_text_corpus()
    tokens = torch.tensor(ByteTokenizer().encode(text), dtype=torch.long)
    split = int(tokens.numel() * (1 - TEXT_EVAL_FRACTION))
    eval_tokens = tokens.numel() - split
    if config.seq_len >= eval_tokens:
        raise ConfigError(
            [("data.seq_len", f"must be below {eval_tokens} for 'text' (its eval split's bytes)")]
        )
    info = DatasetInfo("lm", 0, 0, 0, ByteTokenizer.vocab_size, config.seq_len)
    return (
        TokenWindows(tokens[:split].to(device), config.seq_len),
        TokenWindows(tokens[split:].to(device), config.seq_len),
        info,
    )


def build_datasets(
    data: DataConfig, model: ModelConfig, *, seed: int, device: torch.device
) -> tuple[Dataset, Dataset, DatasetInfo]:
    """The train split, the eval split and their shapes, placed on ``device``."""
    if isinstance(data, DigitsDataConfig):
        return _digits(device)
    if isinstance(data, TextDataConfig):
        return _text(data, device)
    if isinstance(data, TokensDataConfig):
        return _tokens(data, getattr(model, "vocab_size", None) or 256, device)
    if isinstance(data, SyntheticDataConfig):
        if model.name in LANGUAGE_MODELS:
            return _synthetic_tokens(data, seed, device)
        return _synthetic_images(data, seed, device)
    raise TypeError(f"unknown data config {data!r}")


class ShardedBatches:
    """The order in which every rank sees the training data, as a pure function of the step.

    Each epoch is one permutation of the dataset drawn from ``seed + epoch`` (the same convention
    as ``DistributedSampler``); optimizer step ``s`` with ``grad_accum`` micro-steps takes the next
    ``batch_size x world_size x grad_accum`` indices of it, and rank ``r`` takes every
    ``world_size``-th index of each micro-batch starting at ``r``. So N ranks with batch B see
    exactly the samples one process with batch N x B sees, the position is just the step
    (resuming needs no iterator state) and the last partial global batch of an epoch is dropped.
    """

    def __init__(
        self,
        dataset_len: int,
        *,
        batch_size: int,
        world_size: int,
        rank: int,
        grad_accum: int,
        seed: int,
        device: torch.device,
    ) -> None:
        self.batch_size = batch_size
        self.world_size = world_size
        self.rank = rank
        self.grad_accum = grad_accum
        self.seed = seed
        self.device = device
        self.global_batch = batch_size * world_size * grad_accum
        self.steps_per_epoch = dataset_len // self.global_batch
        self.dataset_len = dataset_len
        if self.steps_per_epoch < 1:
            raise ConfigError(
                [
                    (
                        "data.batch_size",
                        f"the global batch (batch_size x world_size x grad_accum = "
                        f"{self.global_batch}) exceeds the {dataset_len} training samples",
                    )
                ]
            )
        # Data step minus optimizer step: zero unless resumed with a different batch geometry.
        self._offset = 0
        self._epoch = -1
        self._perm = torch.empty(0, dtype=torch.long)

    def _permutation(self, epoch: int) -> Tensor:
        if epoch != self._epoch:
            generator = torch.Generator().manual_seed(self.seed + epoch)
            self._perm = torch.randperm(self.dataset_len, generator=generator).to(self.device)
            self._epoch = epoch
        return self._perm

    def indices(self, step: int, micro: int) -> Tensor:
        """This rank's sample indices for micro-step ``micro`` of optimizer step ``step``."""
        epoch, step_in_epoch = divmod(step + self._offset, self.steps_per_epoch)
        perm = self._permutation(epoch)
        width = self.batch_size * self.world_size
        start = (step_in_epoch * self.grad_accum + micro) * width
        return perm[start + self.rank : start + width : self.world_size]

    def state_dict(self, step: int) -> dict[str, int]:
        return {
            "data_step": step + self._offset,
            "global_batch": self.global_batch,
            "steps_per_epoch": self.steps_per_epoch,
        }

    def load_state_dict(self, state: dict[str, int], step: int) -> bool:
        """Continue from a saved position; False when the batch geometry changed, in which case
        the run continues at the same epoch and sample offset, rounded down to a whole batch."""
        if (
            state["global_batch"] == self.global_batch
            and state["steps_per_epoch"] == self.steps_per_epoch
        ):
            self._offset = state["data_step"] - step
            return True
        epoch, old_step = divmod(state["data_step"], state["steps_per_epoch"])
        new_step = min(old_step * state["global_batch"] // self.global_batch, self.steps_per_epoch)
        self._offset = epoch * self.steps_per_epoch + new_step - step
        return False


def eval_batches(
    dataset_len: int, *, batch_size: int, world_size: int, rank: int, device: torch.device
) -> Iterator[tuple[Tensor, Tensor]]:
    """This rank's share of the eval set (every ``world_size``-th sample), in batches, as
    (indices, weights). Every rank gets the same number of batches of the same sizes: a sharded
    model's forward is collective, so a rank with one sample fewer pads its last batch with
    sample 0 at weight 0."""
    shard = torch.arange(rank, dataset_len, world_size, device=device)
    per_rank = -(-dataset_len // world_size)
    weights = torch.ones(per_rank, device=device)
    if shard.numel() < per_rank:
        padding = per_rank - shard.numel()
        shard = torch.cat([shard, torch.zeros(padding, dtype=shard.dtype, device=device)])
        weights[-padding:] = 0
    yield from zip(shard.split(batch_size), weights.split(batch_size), strict=True)
