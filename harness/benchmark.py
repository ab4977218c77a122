"""Benchmark mode: a fixed workload that characterises the card a rental landed on.

Four figures, each timed after a warm-up call by doubling the repetitions until one timed batch
lasts ``min_seconds`` (so the clock's resolution and launch latency do not dominate):

* ``matmul_tflops``: dense square matmul in the chosen precision, 2 n^3 FLOPs per product;
* ``mem_bandwidth_gbs``: a large on-device tensor copy, counting bytes read plus bytes written
  (the STREAM "copy" convention); on CPU this is host memory bandwidth;
* ``h2d_gbs``: host-to-device copy from pinned memory; null on CPU, where there is no device to
  copy to (``notes`` says so);
* ``train_samples_per_s`` / ``train_tokens_per_s``: the harness's own training loop on a fixed
  reference GPT with synthetic tokens, measured over the second half of the steps; ``train_mfu``
  against ``HARNESS_PEAK_TFLOPS`` or, on a known CUDA card, its datasheet peak (else null).
"""

from __future__ import annotations

import platform
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from harness.config import ConfigError, load_config_dict
from harness.metrics import peak_tflops_from_env
from harness.precision import resolve_precision


@dataclass(frozen=True)
class _Workload:
    matmul_n: int
    copy_bytes: int
    min_seconds: float
    gpt: dict[str, int]
    batch_size: int
    seq_len: int
    vocab_size: int
    interval_steps: int


_WORKLOADS = {
    # GPT-2 small shape (124M parameters) with the 50304-token padded vocabulary.
    ("cuda", False): _Workload(
        8192, 1 << 30, 1.0, {"layers": 12, "width": 768, "heads": 12}, 8, 1024, 50304, 10
    ),
    ("cuda", True): _Workload(
        4096, 256 << 20, 0.2, {"layers": 4, "width": 512, "heads": 8}, 8, 512, 50304, 5
    ),
    ("cpu", False): _Workload(
        1024, 256 << 20, 0.5, {"layers": 4, "width": 128, "heads": 4}, 16, 128, 256, 5
    ),
    ("cpu", True): _Workload(
        256, 32 << 20, 0.1, {"layers": 2, "width": 64, "heads": 4}, 8, 64, 256, 3
    ),
}


# Dense BF16/FP16 tensor peaks per GPU (TFLOPS, FP32 accumulation) from the vendors' datasheets,
# the figures the catalog holds; more specific names first. Benchmark mode falls back on them when
# HARNESS_PEAK_TFLOPS is not set. Training never guesses: without the variable its MFU is null.
_PUBLISHED_PEAKS = (
    (r"H200", 989.0),
    (r"H100.*PCIe", 756.0),
    (r"H100", 989.0),
    (r"A100", 312.0),
    (r"L40S", 362.0),
    (r"RTX A6000", 154.8),
    (r"\bA10\b", 125.0),
    (r"RTX 4090", 165.2),
    (r"V100.*PCIe", 112.0),
    (r"V100", 125.0),
    (r"\bT4\b", 65.0),
)


def published_peak_tflops(device_name: str) -> float | None:
    """The datasheet dense tensor peak of a CUDA device name, or None if the card is not known."""
    for pattern, tflops in _PUBLISHED_PEAKS:
        if re.search(pattern, device_name, re.IGNORECASE):
            return tflops
    return None


def _seconds_per_call(fn: Callable[[], Any], sync: Callable[[], None], min_seconds: float) -> float:
    fn()
    sync()
    reps = 1
    while True:
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        sync()
        elapsed = time.perf_counter() - start
        if elapsed >= min_seconds:
            return elapsed / reps
        reps *= 2


def _matmul_tflops(
    work: _Workload, dev: torch.device, dtype: torch.dtype, sync: Callable[[], None]
) -> float:
    n = work.matmul_n
    a = torch.randn(n, n, device=dev, dtype=dtype)
    b = torch.randn(n, n, device=dev, dtype=dtype)
    out = torch.empty(n, n, device=dev, dtype=dtype)
    seconds = _seconds_per_call(lambda: torch.mm(a, b, out=out), sync, work.min_seconds)
    return 2 * n**3 / seconds / 1e12


def cpu_matmul_tflops(dtype: torch.dtype, tries: int = 3) -> float:
    """The dense matmul rate of this process's CPU threads in `dtype`, measured in about half
    a second (the quick benchmark's method at a size that reaches a CPU's steady rate). A peak
    is the best of a few tries: on a shared machine one try can run slow, and a low peak gives
    an MFU above 100 % (one try of 512 x 512 under load gave 149 %)."""
    work = _Workload(1024, 0, 0.15, {}, 0, 0, 0, 0)
    return max(_matmul_tflops(work, torch.device("cpu"), dtype, lambda: None) for _ in range(tries))


def _copy_gbs(work: _Workload, dev: torch.device, sync: Callable[[], None]) -> float:
    src = torch.ones(work.copy_bytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    seconds = _seconds_per_call(lambda: dst.copy_(src), sync, work.min_seconds)
    return 2 * work.copy_bytes / seconds / 1e9


def _h2d_gbs(work: _Workload, dev: torch.device, sync: Callable[[], None]) -> float:
    host = torch.ones(work.copy_bytes, dtype=torch.uint8).pin_memory()
    target = torch.empty(work.copy_bytes, dtype=torch.uint8, device=dev)
    seconds = _seconds_per_call(
        lambda: target.copy_(host, non_blocking=True), sync, work.min_seconds
    )
    return work.copy_bytes / seconds / 1e9


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def _train_throughput(
    work: _Workload, precision: str, device: str, peak_tflops: float | None
) -> dict[str, float | None]:
    from harness.trainer import Trainer

    steps = 2 * work.interval_steps
    config = load_config_dict(
        {
            "model": {"name": "gpt", **work.gpt},
            "data": {
                "name": "synthetic",
                "batch_size": work.batch_size,
                "seq_len": work.seq_len,
                "vocab_size": work.vocab_size,
                "num_samples": work.batch_size * (steps + 1),
            },
            "train": {
                "steps": steps,
                "precision": precision,
                "device": device,
                "log_every": work.interval_steps,
                "lr_schedule": "constant",
            },
            "checkpoint": {"enabled": False},
        }
    )
    events: list[dict[str, Any]] = []
    Trainer(config, emit=events.append, peak_tflops=peak_tflops).run()
    steady = [e for e in events if e["event"] == "step"][-1]
    return {
        "train_samples_per_s": steady["samples_per_s"],
        "train_tokens_per_s": steady["tokens_per_s"],
        "train_mfu": steady["mfu"],
    }


def run(*, precision: str = "auto", quick: bool = False, device: str = "auto") -> dict[str, Any]:
    """Measure the card and return the ``benchmark`` event (without its ``time``)."""
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if use_cuda and not torch.cuda.is_available():
        raise ConfigError([("--device", "'cuda' requested but no CUDA device is visible")])
    dev = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    plan = resolve_precision(precision, dev)
    work = _WORKLOADS[(dev.type, quick)]

    def sync() -> None:
        if use_cuda:
            torch.cuda.synchronize(dev)

    if use_cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
    notes = {"mem_bandwidth_gbs": "on-device copy, bytes read + bytes written"}
    if use_cuda:
        h2d_gbs: float | None = _h2d_gbs(work, dev, sync)
        notes["h2d_gbs"] = "pinned host memory to device, bytes copied"
    else:
        h2d_gbs = None
        notes["h2d_gbs"] = "no accelerator: host-to-device bandwidth does not apply"

    result: dict[str, Any] = {
        "event": "benchmark",
        "device": dev.type,
        "device_name": torch.cuda.get_device_name(dev) if use_cuda else _cpu_name(),
        "precision": plan.name,
        "quick": quick,
        "matmul_tflops": _matmul_tflops(work, dev, plan.dtype, sync),
        "mem_bandwidth_gbs": _copy_gbs(work, dev, sync),
        "h2d_gbs": h2d_gbs,
    }
    peak, source = peak_tflops_from_env(), "HARNESS_PEAK_TFLOPS"
    if peak is None and use_cuda:
        peak, source = published_peak_tflops(result["device_name"]), "datasheet"
    result.update(_train_throughput(work, plan.name, dev.type, peak))
    result.update(
        peak_tflops=peak,
        peak_tflops_source=source if peak is not None else None,
        reference_model={
            **work.gpt,
            "seq_len": work.seq_len,
            "batch_size": work.batch_size,
            "vocab_size": work.vocab_size,
        },
        torch_version=torch.__version__,
        notes=notes,
    )
    return result
