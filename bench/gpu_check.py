"""One prepared check for a machine with NVIDIA GPUs: NVML telemetry, layouts of a 1B decoder
beside the advisor's estimate, one job over two "nodes" of the host, the harness on CUDA, and
benchmark mode. Meant for one short session with a GPU (about 7 minutes on one H100 or H200;
``--budget-s`` bounds it, default 450 s).

    .venv/bin/python bench/gpu_check.py [--steps 60] [--skip-compile] [--quick] [--only PARTS]
    .venv/bin/python bench/gpu_check.py --cpu-rehearsal   # the same flow on CPU, tiny sizes

``--cpu-rehearsal`` exercises everything but NVML on a machine without a GPU (gloo ranks, the
tiny transformer and GPT, quick benchmark), so the script itself is known to work before GPU time
is spent. It prints its plan first (the parts and about how long each should take); a part that
would not end within the budget is skipped and says so.

1. NVML (``pynvml`` from nvidia-ml-py): driver, per-GPU name, utilisation, memory, power,
   temperature, ECC mode and error counts; then sampled every 0.5 s while the harness trains, to
   show that utilisation and power rise under load.
2. ``layouts``: a 1.04 B-parameter decoder (``ONE_B``) in bf16, 16 steps per layout (the first 4
   left out), with each layout the advisor plans: on one GPU plain, micro-batches 2, 4 and 8,
   selective and full recomputation; with two GPUs or more also DDP, ZeRO-2, ZeRO-3, tp 2 and
   pp 2 over two. Each layout's harness config is the advisor's own
   (``advisor.engine.runs.harness_config``); its estimate is ``advisor.engine.layouts.estimate``
   for the same shape, batch and layout on the catalog card this device is (``DEVICE_CARDS``).
   Printed side by side: median step time, MFU and peak memory, measured / estimated; a layout
   that runs out of memory is "does not fit", beside the advisor's memory verdict.
3. ``gang``: with two GPUs or more, two launchers with the variables a two-node rental's members
   get (NNODES=2, NODE_RANK, MASTER_ADDR=127.0.0.1, NPROC_PER_NODE=1), a GPU each, NCCL kept off
   its same-host paths so that it uses its network transport: one job, whose losses must be
   those of one launcher's two processes. With one GPU it is skipped (NCCL wants a GPU per rank).
4. ``train``: the harness on every visible GPU (``--nproc auto``: DDP over NCCL) in bf16 with the
   GPT-2-small-shaped reference model: throughput, MFU against the card's datasheet peak, peak
   memory, a periodic checkpoint; then SIGTERM mid-run (must exit 0 with a checkpoint) and a
   resumed run that must continue from it.
5. ``fp32``: the same model in fp32 (TF32 matmuls) on one GPU, for the bf16 speed-up.
6. ``benchmark``: ``python -m harness benchmark --precision bf16`` (full size).
7. ``compile``: torch.compile of the MNIST-example CNN on CUDA: gradients must match eager mode
   (inductor's layout optimisation zeroes them on CPU in torch 2.13; the harness turns it off for
   that model).

Prints progress on stderr and one JSON line on stdout: ``{"event": "gpu_check", "ok": ..,
"checks": {name: bool}, "layouts": [...], "gang": {...}, ...figures}``. Exit status 0 when every
check passed, 1 otherwise, 2 when there is no CUDA device (nothing was run).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
# Ahead of bench/ (first on sys.path when run as a script), where bench/harness.py would shadow
# the harness package.
sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402

from advisor.engine.compute import Card  # noqa: E402
from advisor.engine.layouts import Estimate, Run, default_topology, estimate  # noqa: E402
from advisor.engine.memory import Checkpointing, Layout, Precision  # noqa: E402
from advisor.engine.presets import PRESETS as ADVISOR_PRESETS  # noqa: E402
from advisor.engine.presets import from_transformer  # noqa: E402
from advisor.engine.runs import harness_config, harness_problems  # noqa: E402
from harness.benchmark import published_peak_tflops  # noqa: E402
from harness.presets import PRESETS as HARNESS_PRESETS  # noqa: E402
from harness.presets import TransformerShape, default_ffn_hidden  # noqa: E402

GPT_CONFIG = {
    "model": {"name": "gpt", "layers": 12, "width": 768, "heads": 12},
    "data": {
        "name": "synthetic",
        "seq_len": 1024,
        "vocab_size": 50304,
        "batch_size": 16,
        "num_samples": 16384,
    },
    "train": {"precision": "bf16", "lr": 6e-4, "warmup_steps": 5, "log_every": 10},
}
REHEARSAL_CONFIG = {
    "model": {"name": "gpt", "layers": 2, "width": 64, "heads": 4},
    "data": {"name": "synthetic", "seq_len": 64, "batch_size": 8, "num_samples": 2048},
    "train": {"precision": "fp32", "device": "cpu", "log_every": 5},
}


def log(message: str) -> None:
    print(f"gpu_check: {message}", file=sys.stderr, flush=True)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class Nvml:
    """Thin reader over pynvml: one dict per GPU, None for what the card does not support."""

    def __init__(self) -> None:
        import pynvml

        self.nvml = pynvml
        pynvml.nvmlInit()
        count = pynvml.nvmlDeviceGetCount()
        self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]

    def _read(self, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except self.nvml.NVMLError:
            return None

    def system(self) -> dict[str, Any]:
        cuda = self._read(self.nvml.nvmlSystemGetCudaDriverVersion)
        return {
            "driver_version": _text(self._read(self.nvml.nvmlSystemGetDriverVersion)),
            "cuda_driver_version": f"{cuda // 1000}.{cuda % 1000 // 10}" if cuda else None,
            "gpu_count": len(self.handles),
        }

    def sample(self, handle: Any) -> dict[str, Any]:
        nvml = self.nvml
        util = self._read(nvml.nvmlDeviceGetUtilizationRates, handle)
        memory = self._read(nvml.nvmlDeviceGetMemoryInfo, handle)
        power = self._read(nvml.nvmlDeviceGetPowerUsage, handle)
        return {
            "util_gpu_pct": util.gpu if util else None,
            "util_mem_pct": util.memory if util else None,
            "mem_used_bytes": memory.used if memory else None,
            "power_w": power / 1000 if power is not None else None,
            "temp_c": self._read(nvml.nvmlDeviceGetTemperature, handle, nvml.NVML_TEMPERATURE_GPU),
        }

    def describe(self, handle: Any) -> dict[str, Any]:
        nvml = self.nvml
        memory = self._read(nvml.nvmlDeviceGetMemoryInfo, handle)
        limit = self._read(nvml.nvmlDeviceGetEnforcedPowerLimit, handle)
        ecc_mode = self._read(nvml.nvmlDeviceGetEccMode, handle)

        def ecc(kind: int) -> int | None:
            return self._read(
                nvml.nvmlDeviceGetTotalEccErrors, handle, kind, nvml.NVML_VOLATILE_ECC
            )

        return {
            "name": _text(self._read(nvml.nvmlDeviceGetName, handle)),
            "uuid": _text(self._read(nvml.nvmlDeviceGetUUID, handle)),
            "mem_total_bytes": memory.total if memory else None,
            "power_limit_w": limit / 1000 if limit is not None else None,
            "ecc_enabled": bool(ecc_mode[0]) if ecc_mode else None,
            "ecc_corrected_volatile": ecc(nvml.NVML_MEMORY_ERROR_TYPE_CORRECTED),
            "ecc_uncorrected_volatile": ecc(nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED),
            **self.sample(handle),
        }


class Sampler(threading.Thread):
    """Keeps the per-GPU maximum of each NVML reading while a workload runs."""

    def __init__(self, nvml: Nvml) -> None:
        super().__init__(daemon=True)
        self.nvml = nvml
        self.peaks: list[dict[str, float]] = [{} for _ in nvml.handles]
        self.samples = 0
        self._stop = threading.Event()

    def run(self) -> None:
        while not self._stop.wait(0.5):
            for peak, handle in zip(self.peaks, self.nvml.handles, strict=True):
                for key, value in self.nvml.sample(handle).items():
                    if value is not None:
                        peak[key] = max(peak.get(key, value), value)
            self.samples += 1

    def stop(self) -> list[dict[str, float]]:
        self._stop.set()
        self.join()
        return self.peaks


def _kill_group(process: subprocess.Popen) -> None:
    """SIGKILL the process and what it started (a launcher's ranks): it leads its own group."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)


def run_harness(
    args: list[str], env: dict[str, str], timeout: float, stop_after_step: int | None = None
) -> tuple[int, list[dict[str, Any]]]:
    """Run ``python -m harness ARGS``; with ``stop_after_step``, send SIGTERM once that step's
    event is out. Returns the exit status and the JSON events."""
    process = subprocess.Popen(
        [sys.executable, "-m", "harness", *args],
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    events: list[dict[str, Any]] = []
    killer = threading.Timer(timeout, _kill_group, (process,))
    killer.start()
    try:
        assert process.stdout is not None
        for line in process.stdout:
            event = json.loads(line)
            events.append(event)
            if (
                stop_after_step is not None
                and event["event"] == "step"
                and event["step"] >= stop_after_step
            ):
                process.send_signal(signal.SIGTERM)
                stop_after_step = None
        return process.wait(), events
    finally:
        killer.cancel()


def _kind(events: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [e for e in events if e["event"] == kind]


def check_training(
    nvml: Nvml | None,
    base_config: dict,
    steps: int,
    env: dict[str, str],
    workdir: Path,
    budget: Budget,
) -> tuple[dict[str, Any], dict[str, bool]]:
    config_path = workdir / "gpt.json"
    config = {
        **base_config,
        "train": {**base_config["train"], "steps": 1_000_000, "lr_schedule": "constant"},
        "checkpoint": {"dir": str(workdir / "ckpt"), "every_steps": steps // 2, "keep": 1},
    }
    config_path.write_text(json.dumps(config))
    nproc = "auto" if nvml is not None else "2"
    base = ["--config", str(config_path), "--nproc", nproc]

    log(f"training the reference GPT on all GPUs (--nproc {nproc}), SIGTERM after step {steps}")
    sampler = Sampler(nvml) if nvml is not None else None
    if sampler is not None:
        sampler.start()
    started = time.monotonic()
    code, events = run_harness(base, env, timeout=min(240, budget.left()), stop_after_step=steps)
    peaks = sampler.stop() if sampler is not None else []
    steps_events = _kind(events, "step")
    summary = (_kind(events, "summary") or [{}])[-1]
    stopped_at = summary.get("steps")
    steady = steps_events[-1] if steps_events else {}
    figures = {
        "train_world_size": events[0].get("world_size") if events else None,
        "train_bf16_tokens_per_s": steady.get("tokens_per_s"),
        "train_bf16_mfu": steady.get("mfu"),
        "train_peak_mem_bytes": steady.get("peak_mem_bytes"),
        "train_checkpoints": len(_kind(events, "checkpoint")),
        "train_seconds": round(time.monotonic() - started, 1),
        "telemetry_under_load": peaks,
        "telemetry_samples": sampler.samples if sampler is not None else 0,
    }
    checks = {
        "sigterm_exit_0": code == 0,
        "sigterm_summary": summary.get("exit_reason") == "sigterm",
        "sigterm_checkpoint": bool(_kind(events, "checkpoint"))
        and _kind(events, "checkpoint")[-1]["step"] == stopped_at,
        "loss_finite": all(e["loss"] is not None for e in steps_events),
    }
    if sampler is not None:
        checks["utilisation_seen"] = all(p.get("util_gpu_pct", 0) > 0 for p in peaks)

    if stopped_at is not None:
        log(f"resuming from step {stopped_at} for 10 more steps")
        more = ["--set", f"train.steps={stopped_at + 10}", "--set", "train.log_every=5"]
        code, resumed = run_harness([*base, *more], env, timeout=min(180, max(budget.left(), 30)))
        checks["resume_exit_0"] = code == 0
        checks["resume_continues"] = bool(resumed) and resumed[0].get("start_step") == stopped_at
        checks["resume_completes"] = (_kind(resumed, "summary") or [{}])[-1].get(
            "exit_reason"
        ) == "completed"
    return figures, checks


def check_fp32(
    base_config: dict,
    steps: int,
    env: dict[str, str],
    workdir: Path,
    bf16: float | None,
    budget: Budget,
) -> dict:
    config_path = workdir / "gpt_fp32.json"
    config = {
        **base_config,
        "train": {**base_config["train"], "precision": "fp32", "steps": steps},
        "checkpoint": {"enabled": False},
    }
    config_path.write_text(json.dumps(config))
    log("training the reference GPT in fp32 (TF32) on one GPU")
    code, events = run_harness(["--config", str(config_path)], env, timeout=min(180, budget.left()))
    steady = (_kind(events, "step") or [{}])[-1]
    fp32 = steady.get("tokens_per_s")
    return {
        "fp32_exit_0": code == 0,
        "train_fp32_tokens_per_s": fp32,
        # bf16 ran on all GPUs: compare per GPU
        "bf16_speedup_per_gpu": (bf16 / max(torch.cuda.device_count(), 1) / fp32)
        if bf16 and fp32
        else None,
    }


def check_benchmark(env: dict[str, str], rehearsal: bool, budget: Budget) -> dict[str, Any]:
    mode = ["--quick", "--device", "cpu"] if rehearsal else []
    log(f"benchmark mode, bf16 {'quick, CPU' if rehearsal else 'full size'}")
    try:
        process = subprocess.run(
            [sys.executable, "-m", "harness", "benchmark", "--precision", "bf16", *mode],
            cwd=REPO_ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=min(240, budget.left()),
            check=False,
        )
    except subprocess.TimeoutExpired:
        return {"exit_0": False, "result": None}
    lines = [json.loads(line) for line in process.stdout.splitlines() if line.strip()]
    return {"exit_0": process.returncode == 0, "result": lines[-1] if lines else None}


def check_compile(device: torch.device) -> dict[str, Any]:
    """Compiled and eager gradients of the MNIST-example CNN, with the harness's compile options
    for it, and with inductor's defaults (to see whether the CPU bug exists on CUDA too)."""
    import torch.nn.functional as F

    from harness.models import MnistCnn

    log(f"torch.compile of the CNN on {device.type} versus eager")
    inputs = torch.rand(32, 1, 28, 28, device=device)
    targets = torch.randint(10, (32,), device=device)

    def grads(options: dict[str, Any] | None) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = MnistCnn(in_channels=1, image_size=28, num_classes=10, dropout=False).to(device)
        run = model if options is None else torch.compile(model, options=options)
        F.cross_entropy(run(inputs), targets).backward()
        return [p.grad.detach().clone() for p in model.parameters()]

    eager = grads(None)

    def worst(other: list[torch.Tensor]) -> float:
        return max(
            float((a - b).abs().max() / (b.abs().max() + 1e-12))
            for a, b in zip(other, eager, strict=True)
        )

    harness_options = worst(grads({"layout_optimization": False}))
    torch._dynamo.reset()
    inductor_defaults = worst(grads({}))
    return {
        "compile_grad_rel_error_harness_options": harness_options,
        "compile_grad_rel_error_inductor_defaults": inductor_defaults,
        "compile_matches_eager": harness_options < 1e-3,
    }


# --- the catalog's cards ------------------------------------------------------------------------

# The catalog rows (marketplace/migrations/0002_gpu_catalog.py) of the cards a device name can
# name, as the advisor takes them (marketplace.selectors.catalog_card): this script runs where
# there is no database. tests/bench/test_gpu_check.py keeps them equal to the catalog's.
CARDS: dict[str, Card] = {
    card.slug: card
    for card in (
        Card(slug="v100-sxm2-16gb", name="V100 SXM2 16 GB", memory_gb=16, tensor_tflops=125.0,
             fp32_tflops=15.7, bf16=False, nvlink_gbs=300.0),
        Card(slug="v100-sxm2-32gb", name="V100 SXM2 32 GB", memory_gb=32, tensor_tflops=125.0,
             fp32_tflops=15.7, bf16=False, nvlink_gbs=300.0),
        Card(slug="v100-pcie-16gb", name="V100 PCIe 16 GB", memory_gb=16, tensor_tflops=112.0,
             fp32_tflops=14.0, bf16=False),
        Card(slug="v100-pcie-32gb", name="V100 PCIe 32 GB", memory_gb=32, tensor_tflops=112.0,
             fp32_tflops=14.0, bf16=False),
        Card(slug="a100-sxm4-40gb", name="A100 SXM4 40 GB", memory_gb=40, tensor_tflops=312.0,
             fp32_tflops=19.5, nvlink_gbs=600.0),
        Card(slug="a100-sxm4-80gb", name="A100 SXM4 80 GB", memory_gb=80, tensor_tflops=312.0,
             fp32_tflops=19.5, nvlink_gbs=600.0),
        Card(slug="a100-pcie-40gb", name="A100 PCIe 40 GB", memory_gb=40, tensor_tflops=312.0,
             fp32_tflops=19.5, nvlink_gbs=600.0, nvlink_bridge=True),
        Card(slug="a100-pcie-80gb", name="A100 PCIe 80 GB", memory_gb=80, tensor_tflops=312.0,
             fp32_tflops=19.5, nvlink_gbs=600.0, nvlink_bridge=True),
        Card(slug="h100-sxm5-80gb", name="H100 SXM5 80 GB", memory_gb=80, tensor_tflops=989.0,
             fp32_tflops=67.0, nvlink_gbs=900.0),
        Card(slug="h100-pcie-80gb", name="H100 PCIe 80 GB", memory_gb=80, tensor_tflops=756.0,
             fp32_tflops=51.0, nvlink_gbs=600.0, nvlink_bridge=True),
        Card(slug="h200-sxm-141gb", name="H200 SXM 141 GB", memory_gb=141, tensor_tflops=989.0,
             fp32_tflops=67.0, nvlink_gbs=900.0),
        Card(slug="l40s-48gb", name="L40S 48 GB", memory_gb=48, tensor_tflops=362.0,
             fp32_tflops=91.6),
        Card(slug="a10-24gb", name="A10 24 GB", memory_gb=24, tensor_tflops=125.0,
             fp32_tflops=31.2),
        Card(slug="t4-16gb", name="T4 16 GB", memory_gb=16, tensor_tflops=65.0, fp32_tflops=8.1,
             bf16=False),
        Card(slug="rtx4090-24gb", name="GeForce RTX 4090 24 GB", memory_gb=24,
             tensor_tflops=165.2, fp32_tflops=82.6, tier="consumer"),
        Card(slug="rtx3090-24gb", name="GeForce RTX 3090 24 GB", memory_gb=24, tensor_tflops=71.0,
             fp32_tflops=35.6, nvlink_gbs=112.5, nvlink_bridge=True, tier="consumer"),
        Card(slug="rtx-a6000-48gb", name="RTX A6000 48 GB", memory_gb=48, tensor_tflops=154.8,
             fp32_tflops=38.7, nvlink_gbs=112.5, nvlink_bridge=True, tier="workstation"),
    )
}  # fmt: skip
# torch.cuda.get_device_name() to a catalog slug, more specific names first; None: a card the
# catalog does not list (the NVL and Grace Hopper variants have other memory sizes and peaks).
DEVICE_CARDS: tuple[tuple[str, str | None], ...] = (
    (r"GH200|H100 NVL|H200 NVL", None),
    (r"H200", "h200-sxm-141gb"),
    (r"H100.*PCIe", "h100-pcie-80gb"),
    (r"H100", "h100-sxm5-80gb"),
    (r"A100.*SXM.*80", "a100-sxm4-80gb"),
    (r"A100.*SXM", "a100-sxm4-40gb"),
    (r"A100.*80", "a100-pcie-80gb"),
    (r"A100", "a100-pcie-40gb"),
    (r"L40S", "l40s-48gb"),
    (r"\bA10\b", "a10-24gb"),
    (r"\bT4\b", "t4-16gb"),
    (r"V100.*SXM2.*32", "v100-sxm2-32gb"),
    (r"V100.*SXM2", "v100-sxm2-16gb"),
    (r"V100.*32", "v100-pcie-32gb"),
    (r"V100", "v100-pcie-16gb"),
    (r"RTX 4090", "rtx4090-24gb"),
    (r"RTX 3090", "rtx3090-24gb"),
    (r"RTX A6000", "rtx-a6000-48gb"),
)


def card_slug(device_name: str) -> str | None:
    """The catalog slug of a CUDA device name, or None for a card the catalog does not list."""
    for pattern, slug in DEVICE_CARDS:
        if re.search(pattern, device_name, re.IGNORECASE):
            return slug
    return None


def device_card(
    device_name: str, memory_bytes: int, peak_tflops: float | None
) -> tuple[Card | None, str]:
    """The card the advisor should plan for on this device, and where its figures come from:
    the catalog's row, else the device's own memory and the datasheet peak (no NVLink assumed),
    else none (no estimate)."""
    slug = card_slug(device_name)
    if slug is not None:
        return CARDS[slug], "catalog"
    if not peak_tflops:
        return None, "unknown card: no estimate"
    card = Card(
        slug="unlisted",
        name=device_name,
        memory_gb=memory_bytes / 1e9,
        tensor_tflops=peak_tflops,
        fp32_tflops=peak_tflops / 15,  # unused: the layouts run bf16
    )
    return card, "not in the catalog: device memory and datasheet peak"


# --- layouts of a 1B decoder, measured beside the advisor's estimate ---------------------------

# A 1B Llama-like decoder (rotary positions, SwiGLU MLP of 8/3 x width, untied embeddings, 2,048
# context): 1.04 B parameters. No harness preset is near it (gpt2-774m and gpt2-1.5b have learned
# positions, tied embeddings that no pipeline can split, and a 1,024 context), so the harness and
# the advisor both get it by shape.
ONE_B = TransformerShape(
    layers=18,
    hidden=2048,
    heads=16,
    kv_heads=16,
    ffn_hidden=default_ffn_hidden(2048),
    vocab_size=32000,
    seq_len=2048,
)
# Sequences per optimizer step in every layout, so that their step times compare.
LAYOUT_GLOBAL_BATCH = 8
# GPU: steps per layout run, and the first step events left out (allocation, kernel selection).
LAYOUT_STEPS, LAYOUT_WARMUP = 16, 4
REHEARSAL_LAYOUT_STEPS, REHEARSAL_LAYOUT_WARMUP = 5, 2
# Seconds a layout run may take at most, and what one costs besides its steps (interpreter,
# CUDA context, drawing 1 B weights on the CPU): for the plan printed first.
LAYOUT_TIMEOUT_S = 150
LAYOUT_START_S = {"cuda": 35.0, "cpu": 15.0}


@dataclasses.dataclass(frozen=True)
class LayoutCase:
    """A layout to measure: the advisor's Layout, and micro-batches per step on each rank."""

    name: str
    layout: Layout
    micro_batches: int
    quick: bool = False  # in the --quick set

    @property
    def gpus(self) -> int:
        return self.layout.gpus


_S, _F = Checkpointing.SELECTIVE, Checkpointing.FULL
# One GPU: recomputation and micro-batch sizes (ZeRO on one rank shards nothing).
ONE_GPU_CASES = (
    LayoutCase("mb2", Layout(micro_batch=2), 4),
    LayoutCase("mb4", Layout(micro_batch=4), 2, quick=True),
    LayoutCase("mb8", Layout(micro_batch=8), 1),
    LayoutCase("selective-mb8", Layout(micro_batch=8, checkpointing=_S), 1, quick=True),
    LayoutCase("full-mb8", Layout(micro_batch=8, checkpointing=_F), 1, quick=True),
)
# Two GPUs: every kind of parallelism the harness runs.
TWO_GPU_CASES = (
    LayoutCase("dp2", Layout(dp=2, micro_batch=4), 1, quick=True),
    LayoutCase("dp2-zero2", Layout(dp=2, zero_stage=2, micro_batch=4), 1),
    LayoutCase("dp2-zero3", Layout(dp=2, zero_stage=3, micro_batch=4), 1, quick=True),
    LayoutCase("tp2", Layout(tp=2, micro_batch=8), 1, quick=True),
    # The advisor's 2 micro-batches of 4: one harness micro-batch of 8 cut into 2.
    LayoutCase("pp2", Layout(pp=2, micro_batch=4), 2, quick=True),
)


@dataclasses.dataclass(frozen=True)
class Planned:
    """A layout case as the advisor plans it and as the harness is told to run it."""

    case: LayoutCase
    config: dict[str, Any]
    estimate: Estimate | None
    problems: list[tuple[str, str]]  # what the harness would refuse in the config


def plan_layout(
    case: LayoutCase,
    model: TransformerShape,
    card: Card | None,
    *,
    precision: Precision,
    steps: int,
    device: str,
) -> Planned:
    """The advisor's estimate for this layout of ``model`` on ``case.gpus`` of ``card`` (its
    default topology of those GPUs, the layout fixed), and the harness config that runs the same
    thing: advisor.engine.runs.harness_config, with synthetic tokens (no dataset to read) and a
    step event per step."""
    global_batch = case.layout.dp * case.layout.micro_batch * case.micro_batches
    preset = next((name for name, shape in HARNESS_PRESETS.items() if shape == model), "1b")
    shape = from_transformer(
        preset, model, global_batch=global_batch, micro_batch=case.layout.micro_batch
    )
    found = None
    if card is not None:
        run = Run(shape=shape, tokens=1.0, precision=precision)
        found = estimate(run, card, default_topology(card, case.gpus), fixed=case.layout)
    config = harness_config(
        shape=shape,
        layout=case.layout,
        precision=precision,
        micro_batches=case.micro_batches,
        tokens=float(steps * global_batch * model.seq_len),
    )
    micro_batch = config["data"]["batch_size"]
    config["data"] = {
        "name": "synthetic",
        "seq_len": model.seq_len,
        "vocab_size": model.vocab_size,
        "batch_size": micro_batch,
        "eval_batch_size": micro_batch,
        "num_samples": 4 * global_batch,
    }
    config["train"] |= {
        "lr": 3e-4,
        "lr_schedule": "constant",
        "log_every": 1,
        "device": device,
        "seed": 1,
    }
    config["checkpoint"] = {"enabled": False}
    problems = harness_problems(config, world_size=case.gpus, local_world_size=case.gpus)
    return Planned(case=case, config=config, estimate=found, problems=problems)


def measured_of(events: list[dict[str, Any]], warmup: int) -> dict[str, Any] | None:
    """Median step time, tokens/s and MFU over the step events after the first ``warmup``
    (all of them when there are no more), and the peak memory of rank 0; None without steps."""
    start = (_kind(events, "start") or [None])[0]
    steps = _kind(events, "step")
    if start is None or not steps:
        return None
    steady = steps[warmup:] or steps
    rates = [e["samples_per_s"] for e in steady if e.get("samples_per_s")]
    mfus = [e["mfu"] for e in steady if e.get("mfu") is not None]
    peaks = [e["peak_mem_bytes"] for e in steps if e.get("peak_mem_bytes")]
    if not rates:
        return None
    samples_per_s = statistics.median(rates)
    seq_len = start["config"]["data"]["seq_len"]
    return {
        "steps_measured": len(steady),
        "step_s": start["global_batch_size"] / samples_per_s,
        "tokens_per_s": samples_per_s * seq_len,
        "mfu": statistics.median(mfus) if mfus else None,
        "peak_mem_gb": max(peaks) / 1e9 if peaks else None,
        "losses": [e["loss"] for e in steps],
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def compare(planned: Planned, measured: dict[str, Any] | None, status: str) -> dict[str, Any]:
    """One row: what ran, what the advisor expected, and measured / estimated. The harness's MFU
    counts 6 x matmul parameters per token and the advisor's 6 x all parameters (the input
    embedding too), so MFU is also given on the advisor's count of the same work
    (``mfu_advisor_flops``), whose ratio to the estimate is estimated / measured step time."""
    found, case = planned.estimate, planned.case
    row: dict[str, Any] = {
        "name": case.name,
        "gpus": case.gpus,
        "layout": case.layout.to_dict(),
        "harness_layout": planned.config["layout"],
        "status": status,
    }
    if found is not None:
        row["estimated"] = {
            "step_s": found.step.total,
            "tokens_per_s": found.tokens_per_s,
            "mfu": found.mfu,
            "mem_gb": found.memory.total / 1e9,
            "fits": found.fits,
        }
    if measured is not None:
        row["measured"] = {k: v for k, v in measured.items() if k != "losses"}
        if found is not None:
            peak = found.card.peak_tflops(found.precision) * 1e12
            row["measured"]["mfu_advisor_flops"] = found.step.model_flops / (
                measured["step_s"] * found.gpus * peak
            )
            row["ratio_measured_to_estimated"] = {
                "step_s": _ratio(measured["step_s"], found.step.total),
                "mfu": _ratio(row["measured"]["mfu_advisor_flops"], found.mfu),
                "mem": _ratio(measured["peak_mem_gb"], found.memory.total / 1e9),
            }
    fits = {"ok": True, "does not fit": False}.get(status)
    row["fits_measured"] = fits
    if found is not None and fits is not None:
        row["memory_verdicts_agree"] = fits == found.fits
    return row


class Budget:
    """The wall-clock time the whole check may take: parts that would not end in time are
    skipped (and say so) rather than cut off the session."""

    def __init__(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def lacks(self, what: str, needs: float) -> str | None:
        """None when ``needs`` seconds are left, else why ``what`` is skipped."""
        if self.left() >= needs:
            return None
        reason = f"skipped: time budget (needs ~{needs:.0f} s, {max(self.left(), 0):.0f} s left)"
        log(f"{what}: {reason}")
        return reason


def _out_of_memory(stderr_path: Path) -> bool:
    text = stderr_path.read_text(errors="replace") if stderr_path.exists() else ""
    return "out of memory" in text.lower() or "OutOfMemoryError" in text


def _tail(path: Path, chars: int = 600) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else ""


def run_harness_jobs(
    jobs: list[tuple[list[str], dict[str, str]]], timeout: float, workdir: Path, tag: str
) -> list[tuple[int | None, list[dict[str, Any]], Path]]:
    """Start ``python -m harness ARGS`` for every (args, env) at once (the members of a gang),
    wait for all with one timeout; per job: exit status (None: killed at the timeout), its
    stdout events and its stderr file."""
    started = []
    for index, (args, env) in enumerate(jobs):
        out = workdir / f"{tag}-{index}.out"
        err = workdir / f"{tag}-{index}.err"
        with out.open("w") as stdout, err.open("w") as stderr:
            process = subprocess.Popen(
                [sys.executable, "-m", "harness", *args],
                cwd=REPO_ROOT,
                env=env,
                stdout=stdout,
                stderr=stderr,
                start_new_session=True,
            )
        started.append((process, out, err))
    deadline = time.monotonic() + timeout
    results: list[tuple[int | None, list[dict[str, Any]], Path]] = []
    for process, out, err in started:
        try:
            code: int | None = process.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            code = None
        if code is None:
            for other, _, _ in started:
                _kill_group(other)
            process.wait()
        events = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
        results.append((code, events, err))
    return results


def _harness_env(env: dict[str, str], workdir: Path, tag: str, **extra: str) -> dict[str, str]:
    """The harness's environment for one run: its own output directory, no job of the caller's."""
    scrubbed = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "NNODES",
                "NODE_RANK", "NPROC_PER_NODE")  # fmt: skip
    clean = {k: v for k, v in env.items() if k not in scrubbed}
    return {**clean, "GPUMARKET_WORKSPACE": str(workdir / tag), **extra}


def run_layout(
    planned: Planned, env: dict[str, str], workdir: Path, budget: Budget, warmup: int
) -> dict[str, Any]:
    """Run one planned layout and compare it with its estimate."""
    case = planned.case
    if planned.problems:
        log(f"layout {case.name}: the harness would refuse the advisor's config")
        row = compare(planned, None, "refused by the harness")
        row["problems"] = [f"{key}: {reason}" for key, reason in planned.problems]
        return row
    found = planned.estimate
    steps = planned.config["train"]["steps"]
    start = LAYOUT_START_S[planned.config["train"]["device"]]
    needs = start + (steps * found.step.total * 1.5 if found and found.fits else 10.0)
    skipped = budget.lacks(f"layout {case.name}", needs)
    if skipped:
        return compare(planned, None, skipped)
    tag = f"layout-{case.name}"
    job_env = _harness_env(env, workdir, tag, HARNESS_CONFIG_JSON=json.dumps(planned.config))
    args = ["--config-env", "HARNESS_CONFIG_JSON", "--nproc", str(case.gpus)]
    log(f"layout {case.name} on {case.gpus} GPU(s): {json.dumps(planned.config['layout'])}")
    timeout = min(LAYOUT_TIMEOUT_S, budget.left())
    ((code, events, stderr),) = run_harness_jobs([(args, job_env)], timeout, workdir, tag)
    measured = measured_of(events, warmup)
    if code == 0 and measured is not None:
        status = "ok"
    elif code is not None and code != 0 and _out_of_memory(stderr):
        status, measured = "does not fit", None
    elif code is None:
        status = f"timed out after {timeout:.0f} s"
    else:
        status = f"failed (exit {code})"
    row = compare(planned, measured, status)
    if status.startswith(("failed", "timed out")):
        row["stderr_tail"] = _tail(stderr)
    return row


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _pair(measured: float | None, estimated: float | None, ratio: float | None, spec: str) -> str:
    return f"{_fmt(measured, spec)}/{_fmt(estimated, spec)} ({_fmt(ratio, '.3g')})"


def layout_table(rows: list[dict[str, Any]]) -> str:
    """Measured beside estimated, one line per layout."""
    lines = [
        f"{'layout':<14}{'gpus':>5}  {'step s meas/est (x)':<28}{'MFU meas/est (x)':<28}"
        f"{'peak GB meas/est':<18}{'fits meas/est':<15}status"
    ]
    for row in rows:
        m, e = row.get("measured") or {}, row.get("estimated") or {}
        r = row.get("ratio_measured_to_estimated") or {}
        step = _pair(m.get("step_s"), e.get("step_s"), r.get("step_s"), ".3g")
        mfu = _pair(m.get("mfu_advisor_flops"), e.get("mfu"), r.get("mfu"), ".3g")
        mem = f"{_fmt(m.get('peak_mem_gb'), '.3g')}/{_fmt(e.get('mem_gb'), '.3g')}"
        verdicts = {True: "yes", False: "no", None: "-"}
        fits = f"{verdicts[row.get('fits_measured')]}/{verdicts[e.get('fits')]}"
        lines.append(
            f"{row['name']:<14}{row['gpus']:>5}  {step:<28}{mfu:<28}{mem:<18}{fits:<15}"
            f"{row['status']}"
        )
    return "\n".join(lines)


def check_layouts(
    cases: list[LayoutCase],
    model: TransformerShape,
    card: Card | None,
    *,
    precision: Precision,
    rehearsal: bool,
    env: dict[str, str],
    workdir: Path,
    budget: Budget,
) -> tuple[list[dict[str, Any]], dict[str, bool]]:
    steps, warmup = (
        (REHEARSAL_LAYOUT_STEPS, REHEARSAL_LAYOUT_WARMUP)
        if rehearsal
        else (LAYOUT_STEPS, LAYOUT_WARMUP)
    )
    device = "cpu" if rehearsal else "cuda"
    rows = []
    for case in cases:
        planned = plan_layout(case, model, card, precision=precision, steps=steps, device=device)
        rows.append(run_layout(planned, env, workdir, budget, warmup))
    for line in layout_table(rows).splitlines():
        log(line)
    ran = [row for row in rows if not row["status"].startswith("skipped")]
    checks = {
        # every layout either trained or ran out of memory (nothing refused, crashed or hung)
        "layouts_run": bool(ran) and all(row["status"] in ("ok", "does not fit") for row in ran),
        "layouts_memory_verdicts_agree": all(row.get("memory_verdicts_agree", True) for row in ran),
    }
    if not rehearsal:
        checks["layouts_mfu_reported"] = all(
            (row.get("measured") or {}).get("mfu") is not None
            for row in ran
            if row["status"] == "ok"
        )
    return rows, checks


# --- one job over two "nodes" of one host ------------------------------------------------------

GANG_STEPS = 8
GANG_CONFIG: dict[str, Any] = {
    "model": {"name": "transformer", "preset": "gpt2-124m"},
    "data": {"name": "synthetic", "seq_len": 512, "vocab_size": 50257, "num_samples": 256},
    "train": {
        "steps": GANG_STEPS,
        "precision": "bf16",
        "lr": 3e-4,
        "lr_schedule": "constant",
        "log_every": 1,
        "seed": 1,
    },
    "checkpoint": {"enabled": False},
    "layout": {"micro_batch": 4, "grad_accum": 1},
}
REHEARSAL_GANG_CONFIG: dict[str, Any] = {
    **GANG_CONFIG,
    "model": {"name": "transformer", "preset": "tiny"},
    "data": {"name": "synthetic", "seq_len": 64, "vocab_size": 256, "num_samples": 256},
    "train": {**GANG_CONFIG["train"], "precision": "fp32", "device": "cpu"},
}
GANG_TIMEOUT_S = 150


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def nccl_transports(stderr_paths: list[Path]) -> list[str]:
    """The transports NCCL reports for its channels (``NCCL_DEBUG=INFO``): P2P, SHM, NET/..."""
    found = set()
    for path in stderr_paths:
        text = path.read_text(errors="replace") if path.exists() else ""
        found.update(re.findall(r"\bvia (NET/\S+?|P2P/\S+|SHM)(?:/\d+)?\b", text))
    return sorted(found)


def check_gang(
    *, gpus: int, rehearsal: bool, env: dict[str, str], workdir: Path, budget: Budget
) -> tuple[dict[str, Any], dict[str, bool]]:
    """Two launchers with the node agent's variables of a two-node rental (NNODES=2, NODE_RANK,
    MASTER_ADDR=127.0.0.1, MASTER_PORT, NPROC_PER_NODE=1), one GPU each, must train one job
    with the loss curve of one launcher's two processes. On GPUs NCCL is kept off its same-host
    paths (P2P, shared memory), so the gradients cross its network transport as between hosts."""
    if not rehearsal and gpus < 2:
        log("gang: skipped: one GPU (NCCL needs a GPU per rank)")
        return {"status": "skipped: one GPU"}, {}
    skipped = budget.lacks("gang", 2 * LAYOUT_START_S["cpu" if rehearsal else "cuda"])
    if skipped:
        return {"status": skipped}, {}
    config = REHEARSAL_GANG_CONFIG if rehearsal else {
        **GANG_CONFIG, "train": {**GANG_CONFIG["train"], "device": "cuda"}
    }  # fmt: skip
    base = {"HARNESS_CONFIG_JSON": json.dumps(config)}
    args = ["--config-env", "HARNESS_CONFIG_JSON"]
    log("gang: one launcher, 2 processes")
    ((code, reference, _),) = run_harness_jobs(
        [([*args, "--nproc", "2"], _harness_env(env, workdir, "gang-ref", **base))],
        min(GANG_TIMEOUT_S, budget.left()),
        workdir,
        "gang-ref",
    )
    port = _free_port()
    # A GPU each: the first two this process sees.
    visible = (env.get("CUDA_VISIBLE_DEVICES") or "0,1").split(",")
    visible = visible if len(visible) >= 2 else ["0", "1"]
    members = []
    for node in range(2):
        extra = {
            **base,
            "NNODES": "2",
            "NODE_RANK": str(node),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "NPROC_PER_NODE": "1",
            # The launcher binds gloo and NCCL to the interface of the node's given address.
            "GPUMARKET_NODE_ADDR": "127.0.0.1",
        }
        if not rehearsal:
            extra |= {
                "CUDA_VISIBLE_DEVICES": visible[node],
                "NCCL_P2P_DISABLE": "1",
                "NCCL_SHM_DISABLE": "1",
                "NCCL_DEBUG": "INFO",
            }
        members.append(
            ([*args, "--nproc", "auto"], _harness_env(env, workdir, f"node{node}", **extra))
        )
    log("gang: two launchers as nodes 0 and 1 of one job")
    results = run_harness_jobs(members, min(GANG_TIMEOUT_S, budget.left()), workdir, "gang")
    (code0, node0, err0), (code1, node1, err1) = results
    ref_losses = [e["loss"] for e in _kind(reference, "step")]
    gang_losses = [e["loss"] for e in _kind(node0, "step")]
    worst = None
    if ref_losses and len(ref_losses) == len(gang_losses):
        worst = max(
            abs(a - b) / max(abs(b), 1e-12) for a, b in zip(gang_losses, ref_losses, strict=True)
        )
    # CPU fp32 sums the same values in the same order; bf16 kernels on GPUs may not be bitwise
    # repeatable run to run.
    tolerance = 1e-5 if rehearsal else 2e-3
    gang_measured = measured_of(node0, 2)
    ref_measured = measured_of(reference, 2)
    start = (_kind(node0, "start") or [{}])[0]
    figures = {
        "status": "ran",
        "exit_codes": {"one_launcher": code, "node0": code0, "node1": code1},
        "world_size": start.get("world_size"),
        "losses_one_launcher": ref_losses,
        "losses_gang": gang_losses,
        "loss_max_rel_diff": worst,
        "step_s_one_launcher": ref_measured and ref_measured["step_s"],
        "step_s_gang": gang_measured and gang_measured["step_s"],
        "nccl_transports": nccl_transports([err0, err1]) if not rehearsal else None,
    }
    if code0 != 0 or code1 != 0:
        figures["stderr_tail"] = {"node0": _tail(err0), "node1": _tail(err1)}
    checks = {
        "gang_exit_0": code == 0 and code0 == 0 and code1 == 0,
        "gang_one_job": start.get("world_size") == 2 and not _kind(node1, "step"),
        "gang_loss_matches": worst is not None and worst <= tolerance,
    }
    if not rehearsal:
        checks["gang_over_nccl_net"] = any(t.startswith("NET/") for t in figures["nccl_transports"])
    log(f"gang: losses {gang_losses} vs {ref_losses} (max relative difference {worst})")
    return figures, checks


PARTS = ("layouts", "gang", "train", "fp32", "benchmark", "compile")
# Rough seconds per part besides the layouts (GPU, CPU rehearsal), for the plan printed first
# and the time budget.
PART_S = {
    "gang": (80.0, 60.0),
    "train": (100.0, 60.0),
    "fp32": (40.0, 20.0),
    "benchmark": (60.0, 20.0),
    "compile": (45.0, 30.0),
}


def part_s(part: str, rehearsal: bool) -> float:
    gpu, cpu = PART_S[part]
    return cpu if rehearsal else gpu


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60, help="bf16 steps before SIGTERM")
    parser.add_argument("--skip-compile", action="store_true")
    parser.add_argument("--cpu-rehearsal", action="store_true", help="the flow on CPU, no NVML")
    parser.add_argument(
        "--only",
        default=",".join(PARTS),
        help=f"comma-separated parts to run, in this order: {','.join(PARTS)} (default: all)",
    )
    parser.add_argument(
        "--layouts", default="", help="comma-separated layout names to measure (default: all)"
    )
    parser.add_argument("--quick", action="store_true", help="the shorter set of layouts")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="wall-clock seconds for the whole check (default 450 on GPU, 900 in rehearsal): "
        "parts that would not end in time are skipped and reported",
    )
    parser.add_argument("--card", default=None, help="catalog slug of the card (default: detect)")
    args = parser.parse_args()
    parts = [part.strip() for part in args.only.split(",") if part.strip()]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        parser.error(f"--only: unknown parts {', '.join(unknown)} (known: {', '.join(PARTS)})")
    if args.card is not None and args.card not in CARDS:
        parser.error(f"--card: unknown slug {args.card!r} (known: {', '.join(CARDS)})")
    if args.skip_compile and "compile" in parts:
        parts.remove("compile")

    if not torch.cuda.is_available() and not args.cpu_rehearsal:
        reason = "no CUDA device visible to torch (CPU build, no driver, or no GPU)"
        log(f"cannot run: {reason}")
        print(json.dumps({"event": "gpu_check", "ok": False, "error": reason}))
        return 2

    rehearsal = args.cpu_rehearsal
    budget = Budget(args.budget_s or (900.0 if rehearsal else 450.0))
    result: dict[str, Any] = {
        "event": "gpu_check",
        "rehearsal": rehearsal,
        "torch_version": torch.__version__,
        "parts": parts,
    }
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    checks: dict[str, bool] = {}
    nvml: Nvml | None = None
    card: Card | None
    if rehearsal:
        # No card to plan for: the advisor's figures for an H100 only exercise the pairing.
        card, source = (
            CARDS[args.card or "h100-sxm5-80gb"],
            "rehearsal: a catalog card, not this CPU",
        )
        gpus = 2
    else:
        nvml = Nvml()
        result["nvml"] = nvml.system()
        result["gpus_idle"] = [nvml.describe(handle) for handle in nvml.handles]
        name = torch.cuda.get_device_name()
        peak = os.environ.get("HARNESS_PEAK_TFLOPS") or published_peak_tflops(name)
        if peak:
            env["HARNESS_PEAK_TFLOPS"] = str(peak)
        result["peak_tflops"] = float(peak) if peak else None
        checks["nvml_sees_every_gpu"] = len(nvml.handles) == torch.cuda.device_count()
        checks["ecc_no_uncorrected"] = all(
            (g["ecc_uncorrected_volatile"] or 0) == 0 for g in result["gpus_idle"]
        )
        memory = torch.cuda.get_device_properties(0).total_memory
        if args.card:
            card, source = CARDS[args.card], "--card"
        else:
            card, source = device_card(name, memory, float(peak) if peak else None)
        gpus = torch.cuda.device_count()
    result["card"] = {"slug": card.slug if card else None, "source": source}
    log(f"card for the advisor: {result['card']}")

    model = ADVISOR_PRESETS["tiny"].transformer if rehearsal else ONE_B
    assert model is not None
    precision = Precision.FP32 if rehearsal else Precision.BF16
    cases = [c for c in (*ONE_GPU_CASES, *TWO_GPU_CASES) if c.gpus <= gpus]
    if args.quick:
        cases = [c for c in cases if c.quick]
    if args.layouts:
        wanted = {name.strip() for name in args.layouts.split(",")}
        cases = [c for c in cases if c.name in wanted]
    # The plan, with what each part should take (the layouts' steps at the advisor's pace).
    device = "cpu" if rehearsal else "cuda"
    plan: dict[str, float] = {}
    for part in parts:
        if part == "layouts":
            steps = REHEARSAL_LAYOUT_STEPS if rehearsal else LAYOUT_STEPS
            plan[part] = 0.0
            for case in cases:
                found = plan_layout(
                    case, model, card, precision=precision, steps=steps, device=device
                ).estimate
                pace = found.step.total * 1.5 if found and found.fits and not rehearsal else 0.5
                plan[part] += LAYOUT_START_S[device] + steps * pace
        elif part == "gang" and not rehearsal and gpus < 2:
            plan[part] = 0.0
        else:
            plan[part] = part_s(part, rehearsal)
    log(
        f"plan: about {sum(plan.values()):.0f} s in all, budget {budget.left():.0f} s: "
        + ", ".join(f"{part} ~{seconds:.0f} s" for part, seconds in plan.items())
    )
    result["plan_s"] = {part: round(seconds) for part, seconds in plan.items()}
    started = time.monotonic()

    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        workdir = Path(tmp)
        # The harness writes its output (final model, logs) here, not into the checkout.
        env["GPUMARKET_WORKSPACE"] = str(workdir / "workspace")
        if "layouts" in parts:
            rows, layout_checks = check_layouts(
                cases,
                model,
                card,
                precision=precision,
                rehearsal=rehearsal,
                env=env,
                workdir=workdir,
                budget=budget,
            )
            result["layouts"] = rows
            result["layouts_model"] = {**model.to_dict(), "params": model.param_count()}
            checks.update(layout_checks)
        if "gang" in parts:
            gang, gang_checks = check_gang(
                gpus=gpus, rehearsal=rehearsal, env=env, workdir=workdir, budget=budget
            )
            result["gang"] = gang
            checks.update(gang_checks)
        base_config = REHEARSAL_CONFIG if rehearsal else GPT_CONFIG
        steps = min(args.steps, 10) if rehearsal else args.steps
        bf16 = None
        if "train" in parts and not budget.lacks("train", part_s("train", rehearsal)):
            figures, train_checks = check_training(nvml, base_config, steps, env, workdir, budget)
            result.update(figures)
            checks.update(train_checks)
            bf16 = figures["train_bf16_tokens_per_s"]
        if "fp32" in parts and not budget.lacks("fp32", part_s("fp32", rehearsal)):
            fp32 = check_fp32(base_config, 30 if not rehearsal else 10, env, workdir, bf16, budget)
            checks["fp32_exit_0"] = fp32.pop("fp32_exit_0")
            result.update(fp32)
    if "benchmark" in parts and not budget.lacks("benchmark", part_s("benchmark", rehearsal)):
        bench = check_benchmark(env, rehearsal, budget)
        checks["benchmark_exit_0"] = bench["exit_0"]
        result["benchmark"] = bench["result"]
    if "compile" in parts and not budget.lacks("compile", part_s("compile", rehearsal)):
        try:
            compiled = check_compile(torch.device("cpu" if rehearsal else "cuda"))
            checks["compile_matches_eager"] = compiled.pop("compile_matches_eager")
            result.update(compiled)
        except Exception as exc:  # a compiler failure is a finding, not a crash of the check
            checks["compile_matches_eager"] = False
            result["compile_error"] = f"{type(exc).__name__}: {exc}"[:500]
    if nvml is not None:
        result["gpus_after"] = [nvml.describe(handle) for handle in nvml.handles]
    result["wall_s"] = round(time.monotonic() - started, 1)
    result["skipped"] = [
        part for part in parts if part not in ("layouts", "gang") and not _ran(part, result, checks)
    ]
    result["checks"] = checks
    result["ok"] = all(checks.values())
    print(json.dumps(result))
    return 0 if result["ok"] else 1


def _ran(part: str, result: dict[str, Any], checks: dict[str, bool]) -> bool:
    key = {
        "train": "sigterm_exit_0",
        "fp32": "fp32_exit_0",
        "benchmark": "benchmark_exit_0",
        "compile": "compile_matches_eager",
    }[part]
    return key in checks


if __name__ == "__main__":
    sys.exit(main())
