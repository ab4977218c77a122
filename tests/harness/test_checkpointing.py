"""Checkpoints: atomic files, retention, and resuming with an identical loss sequence."""

from __future__ import annotations

import pytest
import torch

from harness.checkpoint import (
    list_checkpoints,
    load_latest,
    remove_stale_temporaries,
    save_checkpoint,
)
from harness.config import ConfigError
from tests.harness.helpers import losses, of_kind

pytestmark = pytest.mark.timeout(120)

RESUME_CASES = {
    # dropout draws random masks every step: the RNG state must come back exactly
    "cnn-dropout-fp32": {
        "model": {"name": "mnist_cnn", "dropout": True},
        "data": {"name": "digits", "batch_size": 32},
        "train": {"warmup_steps": 2},
    },
    # bf16 autocast, two micro-steps per step, cosine schedule mid-way
    "gpt-bf16-accum": {
        "model": {"name": "gpt", "layers": 1, "width": 32, "heads": 2, "dropout": 0.1},
        "data": {"name": "text", "batch_size": 4, "seq_len": 16},
        "train": {"precision": "bf16", "grad_accum": 2},
    },
    # fp16 with the GradScaler, whose scale and growth tracker are restored
    "resnet-fp16": {
        "model": {"name": "resnet", "widths": [8, 16], "blocks_per_stage": 1},
        "data": {"name": "synthetic", "image_size": 8, "num_samples": 128, "batch_size": 8},
        "train": {"precision": "fp16"},
    },
}


def with_checkpoints(case: dict, directory, steps: int) -> dict:
    return {
        **case,
        "train": {**case["train"], "steps": steps, "log_every": 1},
        "checkpoint": {"dir": str(directory), "every_seconds": 0},
    }


@pytest.mark.parametrize("case", RESUME_CASES.values(), ids=RESUME_CASES.keys())
def test_stop_and_resume_gives_the_identical_loss_sequence(run_trainer, tmp_path, case):
    total = 8
    # given run A: all steps straight through
    straight = run_trainer(with_checkpoints(case, tmp_path / "a", total))
    # and run B: stopped after step 4 (the SIGTERM path), then started again
    config = with_checkpoints(case, tmp_path / "b", total)
    first = run_trainer(config, stop_after=3)
    second = run_trainer(config)
    # then B stopped cleanly at step 4 with a checkpoint, and resumed from it
    assert first[-1]["exit_reason"] == "requested" and first[-1]["steps"] == 4
    assert of_kind(first, "checkpoint")[-1]["step"] == 4
    assert second[0]["start_step"] == 4
    assert second[0]["resumed_from"].endswith("step_000000004.pt")
    assert [e["step"] for e in of_kind(second, "step")] == [5, 6, 7, 8]
    # and the two halves are bit-for-bit the straight run
    assert losses(first) + losses(second) == losses(straight)
    assert second[-1]["final_loss"] == straight[-1]["final_loss"]
    # down to the final weights and the loss scaler's state (its growth tracker counts steps)
    end_a = torch.load(tmp_path / "a" / "step_000000008.pt", weights_only=True)
    end_b = torch.load(tmp_path / "b" / "step_000000008.pt", weights_only=True)
    assert end_b["scaler"] == end_a["scaler"]
    for name, tensor in end_a["model"].items():
        assert torch.equal(end_b["model"][name], tensor), name


def test_a_finished_run_started_again_does_nothing(run_trainer, tmp_path):
    config = {"train": {"steps": 3}, "checkpoint": {"dir": str(tmp_path)}}
    run_trainer(config)
    again = run_trainer(config)
    assert again[0]["start_step"] == 3
    assert of_kind(again, "step") == []
    assert again[-1]["exit_reason"] == "completed" and again[-1]["steps_this_run"] == 0
    assert [step for step, _ in list_checkpoints(tmp_path)] == [3]


def test_periodic_checkpoints_keep_the_newest_k(run_trainer, tmp_path):
    # given a checkpoint every 2 steps, keeping 2, over 9 steps
    events = run_trainer(
        {
            "train": {"steps": 9},
            "checkpoint": {"dir": str(tmp_path), "every_steps": 2, "keep": 2},
        }
    )
    # then steps 2, 4, 6, 8 and the final 9 were written, and only the last two remain
    assert [e["step"] for e in of_kind(events, "checkpoint")] == [2, 4, 6, 8, 9]
    assert [step for step, _ in list_checkpoints(tmp_path)] == [8, 9]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000000008.pt", "step_000000009.pt"]
    assert events[-1]["checkpoint"] == str(tmp_path / "step_000000009.pt")


def test_time_based_checkpoints(run_trainer, tmp_path):
    # every_seconds smaller than a step: every step is due
    events = run_trainer(
        {
            "train": {"steps": 3},
            "checkpoint": {"dir": str(tmp_path), "every_seconds": 1e-9, "keep": 5},
        }
    )
    assert [e["step"] for e in of_kind(events, "checkpoint")] == [1, 2, 3]


def test_save_is_atomic_and_cleans_up_stale_temporaries(tmp_path):
    # given a temporary left by a writer that was killed mid-write
    stale = tmp_path / ".step_abc.tmp"
    stale.write_bytes(b"half a checkpoint")
    assert list_checkpoints(tmp_path) == []
    remove_stale_temporaries(tmp_path)
    assert not stale.exists()
    # when a checkpoint is saved, only the final name appears
    path = save_checkpoint({"step": 5, "weights": torch.ones(3)}, tmp_path, 5, keep=3)
    assert [p.name for p in tmp_path.iterdir()] == ["step_000000005.pt"]
    state, found = load_latest(tmp_path)
    assert found == path and state["step"] == 5 and torch.equal(state["weights"], torch.ones(3))


def test_an_unreadable_latest_checkpoint_falls_back_to_the_previous(run_trainer, tmp_path):
    run_trainer({"train": {"steps": 2}, "checkpoint": {"dir": str(tmp_path)}})
    # a newer file that is not a checkpoint (e.g. truncated by a full disk)
    (tmp_path / "step_000000099.pt").write_bytes(b"\x00garbage")
    events = run_trainer({"train": {"steps": 4}, "checkpoint": {"dir": str(tmp_path)}})
    assert events[0]["start_step"] == 2
    assert [e["step"] for e in of_kind(events, "step")] == [4]


def test_a_checkpoint_of_another_model_is_refused(run_trainer, tmp_path):
    run_trainer({"train": {"steps": 1}, "checkpoint": {"dir": str(tmp_path)}})
    with pytest.raises(ConfigError, match=r"checkpoint\.dir: .* was written for model"):
        run_trainer(
            {
                "model": {"name": "resnet", "widths": [8]},
                "train": {"steps": 2},
                "checkpoint": {"dir": str(tmp_path)},
            }
        )


def test_checkpoint_contents(run_trainer, tmp_path):
    run_trainer({"train": {"steps": 2, "seed": 3}, "checkpoint": {"dir": str(tmp_path)}})
    state = torch.load(tmp_path / "step_000000002.pt", weights_only=True)
    assert state["format_version"] == 1
    assert state["step"] == 2 and state["world_size"] == 1
    assert set(state) >= {"model", "optimizer", "scheduler", "scaler", "rng", "data", "config"}
    assert state["data"] == {"data_step": 2, "global_batch": 64, "steps_per_epoch": 22}
    assert state["config"]["train"]["seed"] == 3
    assert len(state["rng"]) == 1 and state["rng"][0]["torch"].dtype == torch.uint8
