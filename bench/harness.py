"""Training throughput of the harness's own loop versus a plain hand-written PyTorch loop.

    .venv/bin/python bench/harness.py [--model cnn|gpt] [--reps 7] [--steps 20] [--threads 1]
                                      [--cuda]

Both loops train the same model (the harness's model classes, same initial weights) on the same
synthetic data with the same optimizer (AdamW), in this one process, so they share threads,
allocator and caches. Repetitions alternate which loop goes first (ABBA), so drift in machine load
hits both, and the medians are compared. Each repetition runs ``steps`` warm-up steps, then times
``steps`` steps; the harness figure is its own step event for the second interval (the time from
one loss read-back to the next, which waits for the device), the plain loop is timed the same way.

On a CUDA machine (automatic, or ``--cuda``) it also trains the GPT-2-small-shaped reference
model through the harness in bf16 and in fp32 (TF32 matmuls, the harness default) and adds
``cuda_gpt_bf16_mfu`` (when the card's peak is known), the tokens/s of both and the bf16 speed-up.

Prints each figure; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

_BENCH_DIR = Path(__file__).resolve().parent
# `python bench/harness.py` puts bench/ first on sys.path, where this file would shadow the
# `harness` package: the repository root must come first instead.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _BENCH_DIR]
sys.path.insert(0, str(_BENCH_DIR.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from harness.benchmark import published_peak_tflops  # noqa: E402
from harness.config import HarnessConfig, load_config_dict  # noqa: E402
from harness.datasets import build_datasets  # noqa: E402
from harness.metrics import peak_tflops_from_env  # noqa: E402
from harness.models import build_model  # noqa: E402
from harness.trainer import Trainer  # noqa: E402

CPU_WORKLOADS: dict[str, dict[str, Any]] = {
    "cnn": {
        "model": {"name": "mnist_cnn"},
        "data": {"name": "synthetic", "image_size": 28, "batch_size": 64, "num_samples": 4096},
    },
    "gpt": {
        "model": {"name": "gpt", "layers": 2, "width": 128, "heads": 4},
        "data": {"name": "synthetic", "seq_len": 64, "batch_size": 16, "num_samples": 4096},
    },
}
CUDA_GPT = {
    "model": {"name": "gpt", "layers": 12, "width": 768, "heads": 12},
    "data": {
        "name": "synthetic",
        "seq_len": 1024,
        "vocab_size": 50304,
        "batch_size": 8,
        "num_samples": 512,
    },
}
LR = 1e-3
WEIGHT_DECAY = 0.01


def harness_config(workload: dict[str, Any], steps: int, device: str, precision: str):
    return load_config_dict(
        {
            **workload,
            "train": {
                "steps": 2 * steps,
                "log_every": steps,
                "lr": LR,
                "weight_decay": WEIGHT_DECAY,
                # the plain loop has no clipping and no schedule: the same maths
                "grad_clip": 0,
                "lr_schedule": "constant",
                "device": device,
                "precision": precision,
            },
            "checkpoint": {"enabled": False},
        }
    )


def harness_run(config: HarnessConfig, peak: float | None = None) -> dict[str, Any]:
    """The harness's steady-state step event (the second of two intervals)."""
    events: list[dict[str, Any]] = []
    Trainer(config, emit=events.append, peak_tflops=peak).run()
    return [e for e in events if e["event"] == "step"][-1]


def plain_loop(config: HarnessConfig, steps: int) -> float:
    """A hand-written loop over the same model, data and optimizer; samples per second."""
    device = torch.device("cpu")
    train, _, info = build_datasets(config.data, config.model, seed=0, device=device)
    torch.manual_seed(0)
    model = build_model(
        config.model,
        num_classes=info.num_classes,
        in_channels=info.in_channels,
        image_size=info.image_size,
        vocab_size=info.vocab_size,
        seq_len=info.seq_len,
    )
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    batch = config.data.batch_size
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(0))
    per_epoch = len(train) // batch

    def step(index: int) -> torch.Tensor:
        start = (index % per_epoch) * batch
        inputs, targets = train.batch(order[start : start + batch])
        logits = model(inputs)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        return loss

    for index in range(steps):
        loss = step(index)
    loss.item()
    started = time.perf_counter()
    for index in range(steps, 2 * steps):
        loss = step(index)
    loss.item()
    return steps * batch / (time.perf_counter() - started)


def compare_loops(model: str, reps: int, steps: int) -> dict[str, float]:
    config = harness_config(CPU_WORKLOADS[model], steps, "cpu", "fp32")
    harness_figures: list[float] = []
    plain_figures: list[float] = []
    for rep in range(reps):
        order = ("harness", "plain") if rep % 2 == 0 else ("plain", "harness")
        for which in order:
            if which == "harness":
                harness_figures.append(harness_run(config)["samples_per_s"])
            else:
                plain_figures.append(plain_loop(config, steps))
    harness_median = statistics.median(harness_figures)
    plain_median = statistics.median(plain_figures)
    print(f"model: {model} on CPU, {torch.get_num_threads()} threads, {reps} reps x {steps} steps")
    print(f"harness loop: {harness_median:10.1f} samples/s  (reps: {_fmt(harness_figures)})")
    print(f"plain loop:   {plain_median:10.1f} samples/s  (reps: {_fmt(plain_figures)})")
    print(f"ratio harness/plain: {harness_median / plain_median:.3f}")
    return {
        "harness_samples_per_s": round(harness_median, 2),
        "plain_loop_samples_per_s": round(plain_median, 2),
        "ratio": round(harness_median / plain_median, 4),
    }


def cuda_figures(steps: int) -> dict[str, float]:
    name = torch.cuda.get_device_name()
    peak = peak_tflops_from_env() or published_peak_tflops(name)
    bf16 = harness_run(harness_config(CUDA_GPT, steps, "cuda", "bf16"), peak)
    fp32 = harness_run(harness_config(CUDA_GPT, steps, "cuda", "fp32"), peak)
    speedup = bf16["tokens_per_s"] / fp32["tokens_per_s"]
    print(f"CUDA {name}: GPT 124M bf16 {bf16['tokens_per_s']:.0f} tokens/s, MFU {bf16['mfu']}")
    print(f"CUDA {name}: GPT 124M fp32 (TF32) {fp32['tokens_per_s']:.0f} tokens/s")
    print(f"bf16 speed-up over fp32: {speedup:.2f}x")
    figures = {
        "cuda_gpt_bf16_tokens_per_s": round(bf16["tokens_per_s"], 1),
        "cuda_gpt_fp32_tokens_per_s": round(fp32["tokens_per_s"], 1),
        "cuda_bf16_speedup": round(speedup, 3),
    }
    if bf16["mfu"] is not None:
        figures["cuda_gpt_bf16_mfu"] = round(bf16["mfu"], 4)
    return figures


def pin_glibc_malloc() -> bool:
    """Stop glibc from handing freed large buffers back to the OS.

    With ``zero_grad(set_to_none=True)`` every step frees and reallocates the gradients (4.7 MB
    for the CNN's fc1); whether glibc unmaps or trims them, and page-faults them back in, depends
    on the heap's history, which differs between the two loops. Measured here it moved either
    loop by up to 20 % from one repetition to the next. Fixed thresholds make both loops keep
    their buffers, so the comparison measures the loops rather than the allocator.
    """
    libc_name = ctypes.util.find_library("c")
    if not libc_name:
        return False
    libc = ctypes.CDLL(libc_name)
    m_trim_threshold, m_mmap_threshold = -1, -3
    mmap_max_threshold = 32 * 1024 * 1024  # glibc's ceiling for M_MMAP_THRESHOLD on 64-bit
    return bool(
        libc.mallopt(m_trim_threshold, 1 << 30)
        and libc.mallopt(m_mmap_threshold, mmap_max_threshold)
    )


def _fmt(values: list[float]) -> str:
    return ", ".join(f"{v:.0f}" for v in values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(CPU_WORKLOADS), default="cnn")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--steps", type=int, default=20, help="warm-up and timed steps per rep")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="CPU threads for both loops (default 1: the ratio is about loop overhead, and one "
        "thread is far less disturbed by other load on a shared machine than a team of threads)",
    )
    parser.add_argument("--cuda", action="store_true", help="fail if CUDA is not available")
    # bench/_common.py's --quick, by hand: bench/ is off sys.path here (see above).
    parser.add_argument("--quick", action="store_true", help="tiny sizes: that it runs")
    args = parser.parse_args()
    if args.quick:
        args.reps, args.steps = 1, 2
    torch.set_num_threads(args.threads)
    if not pin_glibc_malloc():
        print("note: not glibc, allocator thresholds left as they are")
    if args.cuda and not torch.cuda.is_available():
        sys.exit("--cuda given but no CUDA device is visible")
    result = compare_loops(args.model, args.reps, args.steps)
    if torch.cuda.is_available():
        result.update(cuda_figures(steps=10))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
