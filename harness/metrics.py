"""JSON-line metrics, FLOP estimates and model FLOPs utilisation (MFU).

Events go to stdout, one JSON object per line, flushed, from rank 0 only; the node agent forwards
them and billing parses them, so non-finite floats (a diverged loss) are written as ``null`` to
keep every line valid JSON. Human-readable logs go to stderr.

MFU is model FLOPs per second divided by the cards' dense tensor peak (``HARNESS_PEAK_TFLOPS``,
per GPU, set by the node agent from the catalog). Model FLOPs are:

* GPT: 6 x N x tokens, the usual approximation for a forward plus backward pass of a decoder
  with N matmul parameters (Kaplan et al. 2020, "Scaling Laws for Neural Language Models"; it
  leaves out the attention score FLOPs, about 12 x layers x width x seq_len per token). By the
  definition of MFU, activation recomputation is not counted as useful work.
* image models: counted once at start by ``torch.utils.flop_counter.FlopCounterMode`` on a
  forward and backward pass of a meta-device copy (no memory, no compute).

Without a peak there is no MFU, and the FLOPs are not computed at all.
"""

from __future__ import annotations

import json
import math
import os
import resource
import sys
import time
from collections.abc import Callable
from typing import IO, Any

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from harness.config import ModelConfig
from harness.datasets import DatasetInfo
from harness.models import Gpt, build_model

Emit = Callable[[dict[str, Any]], None]


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_finite(item) for item in value]
    return value


class JsonLines:
    """Writes events as JSON lines with a ``time`` (Unix seconds) to a stream, flushing each."""

    def __init__(self, stream: IO[str] | None = None) -> None:
        self.stream = stream

    def __call__(self, event: dict[str, Any]) -> None:
        stream = self.stream or sys.stdout
        record = {**event, "time": round(time.time(), 3)}
        stream.write(json.dumps(_finite(record), allow_nan=False) + "\n")
        stream.flush()


def peak_tflops_from_env() -> float | None:
    """``HARNESS_PEAK_TFLOPS`` as a positive float, or None when absent or unusable."""
    raw = os.environ.get("HARNESS_PEAK_TFLOPS", "").strip()
    try:
        value = float(raw)
    except ValueError:
        return None
    return value if value > 0 and math.isfinite(value) else None


def flops_per_sample(model_config: ModelConfig, info: DatasetInfo, model: torch.nn.Module) -> int:
    """Training FLOPs (forward + backward) for one sample of the given model and data."""
    if isinstance(model, Gpt):
        return 6 * model.flops_params() * info.seq_len
    with torch.device("meta"):
        shadow = build_model(
            model_config,
            num_classes=info.num_classes,
            in_channels=info.in_channels,
            image_size=info.image_size,
        )
        inputs = torch.empty(1, info.in_channels, info.image_size, info.image_size)
        targets = torch.zeros(1, dtype=torch.long)
    counter = FlopCounterMode(display=False)
    with counter:
        F.cross_entropy(shadow(inputs), targets).backward()
    return int(counter.get_total_flops())


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory: allocated device memory on CUDA; on CPU the process's peak resident set."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    # ru_maxrss is in KiB on Linux.
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def mfu(
    flops_per_sample: int | None, samples_per_s: float, world_size: int, peak_tflops: float | None
) -> float | None:
    if not peak_tflops or not flops_per_sample:
        return None
    return flops_per_sample * samples_per_s / (world_size * peak_tflops * 1e12)
