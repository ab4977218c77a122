"""What a run leaves in its output directory (synced as the rental's artifacts), and its MFU on a
simulated node."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from harness.config import load_config_dict
from harness.models import build_model
from harness.trainer import Trainer
from tests.harness.helpers import harness_env, of_kind

pytestmark = pytest.mark.timeout(180)


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def test_the_default_run_leaves_checkpoint_final_model_and_logs_in_its_workspace(
    run_harness, tmp_path
):
    # given the default config as the agent passes it (a few steps, on the CPU), and only the
    # runtime's workspace variable to say where the output goes
    workspace = tmp_path / "rental-volume"
    env = harness_env(HARNESS_CONFIG_JSON="{}", GPUMARKET_WORKSPACE=str(workspace))
    args = ["--config-env", "HARNESS_CONFIG_JSON", "--nproc", "auto"]
    # when it runs to completion
    code, events, stderr = run_harness([*args, "--set", "train.steps=12"], env=env)
    # then the workspace holds its checkpoint, its final model and its logs
    assert code == 0, stderr
    assert _files(workspace) == [
        "checkpoints/step_000000012.pt",
        "final/config.json",
        "final/model.pt",
        "logs/harness.log",
        "logs/metrics.jsonl",
    ]
    summary = events[-1]
    assert summary["final_model"] == str(workspace / "final" / "model.pt")
    # the log is the metrics stream, line for line
    logged = [json.loads(x) for x in (workspace / "logs" / "metrics.jsonl").read_text().split("\n")
              if x]  # fmt: skip
    assert logged == events
    assert "final model written" in (workspace / "logs" / "harness.log").read_text()
    # and the final model loads, weights only, into the model its config.json describes
    described = json.loads((workspace / "final" / "config.json").read_text())
    assert described["step"] == 12 and described["config"]["model"]["name"] == "mnist_cnn"
    state = torch.load(workspace / "final" / "model.pt", weights_only=True)
    model = build_model(load_config_dict(described["config"]).model, num_classes=10,
                        in_channels=1, image_size=8)  # fmt: skip
    model.load_state_dict(state)


def test_a_stopped_run_writes_no_final_model(tmp_path):
    # given a run that is asked to stop after its second step
    config = load_config_dict(
        {"train": {"steps": 50, "device": "cpu", "log_every": 1},
         "checkpoint": {"dir": str(tmp_path / "checkpoints")}}
    )  # fmt: skip
    events: list[dict] = []

    def emit(event: dict) -> None:
        events.append(event)
        if event["event"] == "step" and event["step"] == 2:
            trainer.request_stop()

    trainer = Trainer(config, emit=emit, output_dir=tmp_path)
    # when it stops
    summary = trainer.run()
    # then its checkpoint holds the weights, and nothing claims to be the final model
    assert summary["exit_reason"] == "requested" and summary["final_model"] is None
    assert not (tmp_path / "final").exists()
    [checkpoint] = _files(tmp_path)
    assert checkpoint == f"checkpoints/step_{summary['steps']:09d}.pt"


def test_mfu_on_a_simulated_node_is_against_the_cpu_it_runs_on(monkeypatch):
    # given a rental of a simulated H100 (the agent names the GPUs and passes the card's peak)
    monkeypatch.setenv("GPUMARKET_SIMULATED_GPUS", "0")
    monkeypatch.setenv("HARNESS_PEAK_TFLOPS", "989")
    config = load_config_dict(
        {"train": {"steps": 4, "device": "cpu", "log_every": 2}, "checkpoint": {"enabled": False}}
    )
    events: list[dict] = []
    # when it trains on the host's CPU
    Trainer(config, emit=events.append).run()
    # then MFU is against the CPU's measured matmul rate, not the card's 989 TFLOPS, so it is
    # a real share, not 0.0 %
    start = events[0]
    assert start["peak_tflops_source"] == "cpu-measured"
    assert start["simulated_card_peak_tflops"] == 989.0
    peak = start["peak_tflops"]
    assert 0 < peak < 50
    for step in of_kind(events, "step"):
        assert step["mfu"] == pytest.approx(
            start["flops_per_sample"] * step["samples_per_s"] / (peak * 1e12)
        )
        assert step["mfu"] > 0.001


def test_a_real_card_keeps_its_datasheet_peak(monkeypatch):
    # given a run that is no simulated rental
    monkeypatch.delenv("GPUMARKET_SIMULATED_GPUS", raising=False)
    monkeypatch.setenv("HARNESS_PEAK_TFLOPS", "989")
    config = load_config_dict(
        {"train": {"steps": 2, "device": "cpu"}, "checkpoint": {"enabled": False}}
    )
    events: list[dict] = []
    Trainer(config, emit=events.append).run()
    # then the peak is the card's, as before
    assert (events[0]["peak_tflops"], events[0]["peak_tflops_source"]) == (989.0, "env")
    assert events[0]["simulated_card_peak_tflops"] is None
