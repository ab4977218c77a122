"""The training loop in this process: learning, precision paths, accumulation, metrics."""

from __future__ import annotations

import math

import pytest
import torch

from harness.models import Gpt
from harness.precision import resolve_precision
from tests.harness.helpers import losses, of_kind

pytestmark = pytest.mark.timeout(120)

TINY_GPT = {"name": "gpt", "layers": 1, "width": 32, "heads": 2}
TINY_TEXT = {"name": "text", "batch_size": 4, "seq_len": 16}


def test_cnn_reaches_90_percent_test_accuracy_on_digits(run_trainer):
    # given the MNIST-example CNN (dropout on) and the digits data
    config = {
        "model": {"name": "mnist_cnn"},
        "data": {"name": "digits", "batch_size": 64},
        "train": {"steps": 200, "lr": 3e-3, "eval_every": 100, "log_every": 50},
    }
    # when it trains for 200 steps (about 9 epochs of the 1437 training images)
    events = run_trainer(config)
    # then accuracy on the 360 held-out images is at least 90 %
    evals = of_kind(events, "eval")
    assert [e["step"] for e in evals] == [100, 200]
    assert evals[-1]["samples"] == 360
    assert evals[-1]["accuracy"] >= 0.90, evals
    steps = losses(events)
    assert steps[-1] < steps[0] / 3
    summary = events[-1]
    assert summary["event"] == "summary" and summary["exit_reason"] == "completed"
    assert summary["eval"] == {k: v for k, v in evals[-1].items() if k != "event"}


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_half_precision_paths_train_on_cpu(run_trainer, tmp_path, precision):
    # given a tiny GPT in bf16 (autocast) or fp16 (autocast + GradScaler, CPU-capable in torch
    # 2.13); half-precision matmuls are slow on CPUs without matrix extensions, hence tiny
    config = {
        "model": TINY_GPT,
        "data": TINY_TEXT,
        "train": {"steps": 4, "log_every": 1, "precision": precision},
        "checkpoint": {"dir": str(tmp_path)},
    }
    events = run_trainer(config)
    assert events[0]["precision"] == precision
    assert len(losses(events)) == 4 and all(math.isfinite(x) for x in losses(events))
    state = torch.load(tmp_path / "step_000000004.pt", weights_only=True)
    if precision == "fp16":
        # the loss scaler ran and its state is part of the checkpoint
        assert [e["loss_scale"] for e in of_kind(events, "step")] == [65536.0] * 4
        assert state["scaler"]["scale"] == 65536.0
    else:
        assert "loss_scale" not in of_kind(events, "step")[0]
        assert state["scaler"] is None


@pytest.mark.parametrize(
    ("requested", "dtype"), [("bf16", torch.bfloat16), ("fp16", torch.float16), ("fp32", None)]
)
def test_precision_plan_autocasts_matmuls(requested, dtype):
    plan = resolve_precision(requested, torch.device("cpu"))
    layer = torch.nn.Linear(4, 4)
    with plan.autocast():
        out = layer(torch.ones(2, 4))
    assert out.dtype == (dtype or torch.float32)
    assert (plan.grad_scaler() is not None) == (requested == "fp16")


def test_auto_precision_is_fp32_on_cpu():
    assert resolve_precision("auto", torch.device("cpu")).name == "fp32"


def test_gradient_accumulation_matches_the_larger_batch(run_trainer):
    # given the same 32 samples per optimizer step, as one batch or as two micro-batches of 16
    base = {
        "model": {"name": "mnist_cnn", "dropout": False},
        "train": {"steps": 6, "log_every": 1},
    }
    whole = run_trainer({**base, "data": {"name": "digits", "batch_size": 32}})
    accumulated = run_trainer(
        {
            **base,
            "data": {"name": "digits", "batch_size": 16},
            "train": {**base["train"], "grad_accum": 2},
        }
    )
    assert whole[0]["global_batch_size"] == accumulated[0]["global_batch_size"] == 32
    # then the loss curves agree up to fp32 summation order (mean of two means vs one mean)
    assert losses(accumulated) == pytest.approx(losses(whole), rel=1e-5)


def test_activation_checkpointing_trains_identically(run_trainer):
    # given a GPT with dropout: recomputation must replay the same dropout masks
    config = {
        "model": {**TINY_GPT, "layers": 2, "dropout": 0.1},
        "data": TINY_TEXT,
        "train": {"steps": 4, "log_every": 1},
    }
    plain = run_trainer(config)
    recomputed = run_trainer(
        {**config, "train": {**config["train"], "activation_checkpointing": True}}
    )
    assert losses(recomputed) == pytest.approx(losses(plain), rel=1e-6)


def test_resnet_and_mfu_from_counted_flops(run_trainer, monkeypatch):
    # given a card peak, the harness counts the model's FLOPs and reports MFU
    monkeypatch.setenv("HARNESS_PEAK_TFLOPS", "0.5")
    events = run_trainer(
        {
            "model": {"name": "resnet", "widths": [8, 16], "blocks_per_stage": 1},
            "data": {"name": "synthetic", "image_size": 8, "num_samples": 256, "batch_size": 16},
            "train": {"steps": 4, "log_every": 2},
        }
    )
    start, steps = events[0], of_kind(events, "step")
    assert start["flops_per_sample"] > 0 and start["peak_tflops"] == 0.5
    for event in steps:
        expected = start["flops_per_sample"] * event["samples_per_s"] / 0.5e12
        assert event["mfu"] == pytest.approx(expected)
        assert event["peak_mem_bytes"] > 0


def test_cnn_flop_count_matches_the_layer_arithmetic(run_trainer, monkeypatch):
    monkeypatch.setenv("HARNESS_PEAK_TFLOPS", "1")
    events = run_trainer({"train": {"steps": 1}})
    # forward multiply-adds of the CNN on 8x8 digits, x2 FLOPs each
    conv1 = 2 * (32 * 6 * 6) * 9
    conv2 = 2 * (64 * 4 * 4) * (32 * 9)
    linear = 2 * (256 * 128 + 128 * 10)
    forward = conv1 + conv2 + linear
    # backward is twice the forward, less the input gradient of conv1 (inputs need none)
    assert events[0]["flops_per_sample"] == 3 * forward - conv1


def test_gpt_reports_tokens_and_uses_6_n_flops(run_trainer, monkeypatch):
    monkeypatch.setenv("HARNESS_PEAK_TFLOPS", "1")
    events = run_trainer({"model": TINY_GPT, "data": TINY_TEXT, "train": {"steps": 2}})
    model = Gpt(vocab_size=256, seq_len=16, layers=1, width=32, heads=2, dropout=0.0)
    assert events[0]["flops_per_sample"] == 6 * model.flops_params() * 16
    assert events[0]["params"] == sum(p.numel() for p in model.parameters())
    step = of_kind(events, "step")[-1]
    assert step["tokens_per_s"] == pytest.approx(step["samples_per_s"] * 16)
    assert events[-1]["tokens_per_s"] > 0


def test_mfu_is_null_without_a_peak(run_trainer, monkeypatch):
    monkeypatch.delenv("HARNESS_PEAK_TFLOPS", raising=False)
    events = run_trainer({"train": {"steps": 2, "log_every": 1}})
    assert events[0]["flops_per_sample"] is None
    assert [e["mfu"] for e in of_kind(events, "step")] == [None, None]


def test_compiled_model_trains_like_eager(run_trainer):
    # torch.compile (inductor, C++ codegen on CPU) must not change the maths
    config = {
        "model": {"name": "mnist_cnn", "dropout": False},
        "data": {"name": "digits", "batch_size": 16},
        "train": {"steps": 3, "log_every": 1},
    }
    eager = run_trainer(config)
    compiled = run_trainer({**config, "train": {**config["train"], "compile": True}})
    assert losses(compiled) == pytest.approx(losses(eager), rel=1e-4)
