"""Benchmark mode: one JSON line with every figure, as a command and as a function."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from harness import benchmark
from tests.harness.helpers import REPO_ROOT

pytestmark = pytest.mark.timeout(120)

FIGURES = ("matmul_tflops", "mem_bandwidth_gbs", "train_samples_per_s", "train_tokens_per_s")
KEYS = {"event", "device", "device_name", "precision", "h2d_gbs", *FIGURES}


def test_quick_benchmark_command_prints_one_json_line(run_harness):
    code, events, stderr = run_harness(["benchmark", "--quick"])
    assert code == 0, stderr
    (event,) = events
    assert set(event) >= KEYS
    assert event["event"] == "benchmark" and event["device"] == "cpu" and event["quick"]
    assert event["precision"] == "fp32"  # auto on a CPU
    for key in FIGURES:
        assert isinstance(event[key], float) and event[key] > 0, key
    # There is no device to copy to on a CPU: null, with the reason alongside.
    assert event["h2d_gbs"] is None
    assert "host-to-device" in event["notes"]["h2d_gbs"]
    # tokens = samples x the reference model's sequence length
    seq_len = event["reference_model"]["seq_len"]
    assert event["train_tokens_per_s"] == pytest.approx(event["train_samples_per_s"] * seq_len)


def test_benchmark_function_in_bf16():
    result = benchmark.run(precision="bf16", quick=True, device="cpu")
    assert result["precision"] == "bf16"
    assert set(result) >= KEYS
    assert all(result[key] > 0 for key in FIGURES)


@pytest.mark.parametrize(
    ("name", "tflops"),
    [
        ("NVIDIA H200", 989.0),
        ("NVIDIA H100 80GB HBM3", 989.0),
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA A100 80GB PCIe", 312.0),
        ("NVIDIA A10", 125.0),
        ("NVIDIA L40S", 362.0),
        ("NVIDIA RTX A6000", 154.8),
        ("NVIDIA GeForce RTX 4090", 165.2),
        ("Tesla V100-PCIE-32GB", 112.0),
        ("Tesla V100-SXM2-16GB", 125.0),
        ("Tesla T4", 65.0),
        ("NVIDIA GeForce RTX 3090", None),  # not a datasheet figure in the catalog notes
    ],
)
def test_published_peaks_match_device_names(name, tflops):
    assert benchmark.published_peak_tflops(name) == tflops


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_gpu_check_fails_clearly_without_cuda(clean_env):
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "bench" / "gpu_check.py")],
        cwd=REPO_ROOT,
        env=clean_env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    assert json.loads(result.stdout) == {
        "event": "gpu_check",
        "ok": False,
        "error": "no CUDA device visible to torch (CPU build, no driver, or no GPU)",
    }
    assert "cannot run" in result.stderr
