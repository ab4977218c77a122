"""One prepared check for a machine with NVIDIA GPUs: NVML telemetry, the harness on CUDA, and
benchmark mode. Meant for a short session with a GPU (under 5 minutes on one H200).

    .venv/bin/python bench/gpu_check.py [--steps 60] [--skip-compile]
    .venv/bin/python bench/gpu_check.py --cpu-rehearsal   # the same flow on CPU, tiny sizes

``--cpu-rehearsal`` exercises everything but NVML on a machine without a GPU (two gloo ranks,
a tiny GPT, quick benchmark), so the script itself is known to work before GPU time is spent.

1. NVML (``pynvml`` from nvidia-ml-py): driver, per-GPU name, utilisation, memory, power,
   temperature, ECC mode and error counts; then sampled every 0.5 s while the harness trains, to
   show that utilisation and power rise under load.
2. The harness on every visible GPU (``--nproc auto``: DDP over NCCL) in bf16 with the
   GPT-2-small-shaped reference model: throughput, MFU against the card's datasheet peak, peak
   memory, a periodic checkpoint; then SIGTERM mid-run (must exit 0 with a checkpoint) and a
   resumed run that must continue from it.
3. The same model in fp32 (TF32 matmuls) on one GPU, for the bf16 speed-up.
4. ``python -m harness benchmark --precision bf16`` (full size).
5. torch.compile of the MNIST-example CNN on CUDA: gradients must match eager mode (inductor's
   layout optimisation zeroes them on CPU in torch 2.13; the harness turns it off for that model).

Prints progress on stderr and one JSON line on stdout: ``{"event": "gpu_check", "ok": ..,
"checks": {name: bool}, ...figures}``. Exit status 0 when every check passed, 1 otherwise, 2 when
there is no CUDA device (nothing was run).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
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

from harness.benchmark import published_peak_tflops  # noqa: E402

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
    )
    events: list[dict[str, Any]] = []
    killer = threading.Timer(timeout, process.kill)
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
    nvml: Nvml | None, base_config: dict, steps: int, env: dict[str, str], workdir: Path
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
    code, events = run_harness(base, env, timeout=240, stop_after_step=steps)
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
        code, resumed = run_harness([*base, *more], env, timeout=180)
        checks["resume_exit_0"] = code == 0
        checks["resume_continues"] = bool(resumed) and resumed[0].get("start_step") == stopped_at
        checks["resume_completes"] = (_kind(resumed, "summary") or [{}])[-1].get(
            "exit_reason"
        ) == "completed"
    return figures, checks


def check_fp32(
    base_config: dict, steps: int, env: dict[str, str], workdir: Path, bf16: float | None
) -> dict:
    config_path = workdir / "gpt_fp32.json"
    config = {
        **base_config,
        "train": {**base_config["train"], "precision": "fp32", "steps": steps},
        "checkpoint": {"enabled": False},
    }
    config_path.write_text(json.dumps(config))
    log("training the reference GPT in fp32 (TF32) on one GPU")
    code, events = run_harness(["--config", str(config_path)], env, timeout=180)
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


def check_benchmark(env: dict[str, str], rehearsal: bool) -> dict[str, Any]:
    mode = ["--quick", "--device", "cpu"] if rehearsal else []
    log(f"benchmark mode, bf16 {'quick, CPU' if rehearsal else 'full size'}")
    process = subprocess.run(
        [sys.executable, "-m", "harness", "benchmark", "--precision", "bf16", *mode],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60, help="bf16 steps before SIGTERM")
    parser.add_argument("--skip-compile", action="store_true")
    parser.add_argument("--cpu-rehearsal", action="store_true", help="the flow on CPU, no NVML")
    args = parser.parse_args()

    if not torch.cuda.is_available() and not args.cpu_rehearsal:
        reason = "no CUDA device visible to torch (CPU build, no driver, or no GPU)"
        log(f"cannot run: {reason}")
        print(json.dumps({"event": "gpu_check", "ok": False, "error": reason}))
        return 2

    rehearsal = args.cpu_rehearsal
    result: dict[str, Any] = {
        "event": "gpu_check",
        "rehearsal": rehearsal,
        "torch_version": torch.__version__,
    }
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    checks: dict[str, bool] = {}
    nvml: Nvml | None = None
    if not rehearsal:
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
    base_config = REHEARSAL_CONFIG if rehearsal else GPT_CONFIG
    steps = min(args.steps, 10) if rehearsal else args.steps

    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        workdir = Path(tmp)
        figures, train_checks = check_training(nvml, base_config, steps, env, workdir)
        result.update(figures)
        checks.update(train_checks)
        bf16 = figures["train_bf16_tokens_per_s"]
        fp32 = check_fp32(base_config, 30 if not rehearsal else 10, env, workdir, bf16)
        checks["fp32_exit_0"] = fp32.pop("fp32_exit_0")
        result.update(fp32)
    bench = check_benchmark(env, rehearsal)
    checks["benchmark_exit_0"] = bench["exit_0"]
    result["benchmark"] = bench["result"]
    if not args.skip_compile:
        try:
            compiled = check_compile(torch.device("cpu" if rehearsal else "cuda"))
            checks["compile_matches_eager"] = compiled.pop("compile_matches_eager")
            result.update(compiled)
        except Exception as exc:  # a compiler failure is a finding, not a crash of the check
            checks["compile_matches_eager"] = False
            result["compile_error"] = f"{type(exc).__name__}: {exc}"[:500]
    if nvml is not None:
        result["gpus_after"] = [nvml.describe(handle) for handle in nvml.handles]
    result["checks"] = checks
    result["ok"] = all(checks.values())
    print(json.dumps(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
