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
* transformer: ``TransformerShape.train_flops_per_token`` (harness.presets), 6 x matmul
  parameters plus the causal attention scores, 6 x layers x hidden x seq_len per token; computed
  from the shape whatever the layout, so every layout of one model reports the same MFU for the
  same throughput.
* image models: counted once at start by ``torch.utils.flop_counter.FlopCounterMode`` on a
  forward and backward pass of a meta-device copy (no memory, no compute).

Without a peak there is no MFU, and the FLOPs are not computed at all. A rental on a simulated
node runs on the host's CPU: its peak is then the CPU's measured matmul rate (the trainer's
``_peak``), not the simulated card's datasheet figure.
"""

from __future__ import annotations

import json
import logging
import math
import os
import resource
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from harness.config import ModelConfig
from harness.datasets import DatasetInfo
from harness.models import Gpt, build_model

Emit = Callable[[dict[str, Any]], None]


def json_safe(value: Any) -> Any:
    """`value` with non-finite floats (at any depth) replaced by None: valid JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: json_safe(item) for key, item in value.items()}
    if isinstance(value, list):
        return [json_safe(item) for item in value]
    return value


class JsonLines:
    """Writes events as JSON lines with a ``time`` (Unix seconds) to a stream, flushing each;
    with ``log_path``, the same lines are appended to that file too (the run's metrics log in
    its output directory, opened at the first event: only rank 0 emits)."""

    def __init__(self, stream: IO[str] | None = None, *, log_path: Path | None = None) -> None:
        self.stream = stream
        self.log_path = log_path
        self._log: IO[str] | None = None

    def __call__(self, event: dict[str, Any]) -> None:
        stream = self.stream or sys.stdout
        record = {**event, "time": round(time.time(), 3)}
        line = json.dumps(json_safe(record), allow_nan=False) + "\n"
        stream.write(line)
        stream.flush()
        if self.log_path is not None:
            try:
                if self._log is None:
                    self.log_path.parent.mkdir(parents=True, exist_ok=True)
                    self._log = open(self.log_path, "a", encoding="utf-8")  # noqa: SIM115
                self._log.write(line)
                self._log.flush()
            except OSError as exc:
                # The file is a copy of stdout: losing it must not stop the training.
                logging.getLogger("harness").warning("metrics log %s: %s", self.log_path, exc)
                self.log_path = None

    def close(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None


def peak_tflops_from_env() -> float | None:
    """``HARNESS_PEAK_TFLOPS`` as a positive float, or None when absent or unusable."""
    raw = os.environ.get("HARNESS_PEAK_TFLOPS", "").strip()
    try:
        value = float(raw)
    except ValueError:
        return None
    return value if value > 0 and math.isfinite(value) else None


def on_simulated_node() -> bool:
    """Whether the run is a rental of simulated GPUs (the node agent names them in
    ``GPUMARKET_SIMULATED_GPUS`` and hides CUDA): it runs on the host's CPU."""
    return "GPUMARKET_SIMULATED_GPUS" in os.environ


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
