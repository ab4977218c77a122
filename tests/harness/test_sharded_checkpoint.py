"""Sharded (DCP) checkpoints of the transformer: resumable on another world size and layout,
written on SIGTERM like file checkpoints, and complete or absent."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest

from harness import sharded_checkpoint
from tests.harness.helpers import losses, of_kind

pytestmark = pytest.mark.timeout(300)


def config(tmp_path: Path, steps: int, layout: dict[str, Any]) -> dict[str, Any]:
    return {
        "model": {"name": "transformer", "preset": "tiny"},
        "data": {"name": "text", "seq_len": 16},
        "train": {
            "steps": steps,
            "lr": 3e-3,
            # constant: a cosine schedule depends on train.steps, which the resumed run changes
            "lr_schedule": "constant",
            "log_every": 1,
            "device": "cpu",
            "precision": "fp32",
        },
        "checkpoint": {"dir": str(tmp_path / "ckpt"), "every_seconds": 0},
        "layout": layout,
    }


def test_a_checkpoint_of_4_processes_resumes_on_2_and_continues_the_curve(
    tmp_path, run_harness, write_config
):
    # given an uninterrupted single-process run of 6 steps (global batch 8)
    reference = write_config(
        {**config(tmp_path, 6, {"micro_batch": 8}), "checkpoint": {"enabled": False}},
        "reference.json",
    )
    code, uninterrupted, stderr = run_harness(["--config", str(reference)])
    assert code == 0, stderr
    # when 4 processes (dp 2 x tp 2, FSDP zero3) train 3 steps and checkpoint
    first = write_config(config(tmp_path, 3, {"tp": 2, "shard": "zero3", "micro_batch": 4}))
    code, written, stderr = run_harness(["--config", str(first), "--nproc", "4"], timeout=240)
    assert code == 0, stderr
    step_dir = tmp_path / "ckpt" / "step_000000003"
    assert of_kind(written, "checkpoint")[-1]["path"] == str(step_dir)
    names = sorted(p.name for p in step_dir.iterdir())
    shards = [f"__{rank}_0.distcp" for rank in range(4)]
    assert names == [".metadata", *shards, "harness.pt"]
    # and 2 processes in another layout (a 2-stage pipeline) resume it to step 6
    second = write_config(config(tmp_path, 6, {"pp": 2, "micro_batch": 8}), "resume.json")
    code, resumed, stderr = run_harness(["--config", str(second), "--nproc", "2"], timeout=240)
    assert code == 0, stderr
    assert resumed[0]["start_step"] == 3 and resumed[0]["resumed_from"] == str(step_dir)
    assert resumed[0]["layout"]["pp"] == 2 and resumed[0]["world_size"] == 2
    assert [e["step"] for e in of_kind(resumed, "step")] == [4, 5, 6]
    # then the two runs together follow the uninterrupted curve (tolerance as in
    # test_layouts: the layouts sum in other orders; resharding itself is exact)
    assert losses(written) + losses(resumed) == pytest.approx(
        losses(uninterrupted), rel=1e-4, abs=1e-5
    )
    assert (tmp_path / "ckpt" / "step_000000006" / ".metadata").is_file()


def test_sigterm_writes_a_sharded_checkpoint_and_exits_0(
    tmp_path, start_harness, run_harness, write_config
):
    endless = config(tmp_path, 1_000_000, {"shard": "zero2", "micro_batch": 4})
    path = write_config(endless)
    # given a sharded run in progress
    process = start_harness(["--config", str(path), "--nproc", "2"])
    process.wait_for(lambda e: e["event"] == "step" and e["step"] >= 2, timeout=120)
    # when the container is stopped
    process.proc.send_signal(signal.SIGTERM)
    code = process.finish(timeout=120)
    # then every rank finished its step, the step was checkpointed, and the job exited 0
    assert code == 0, process.stderr()
    summary = process.events[-1]
    assert summary["exit_reason"] == "sigterm"
    stopped_at = summary["steps"]
    checkpoint = of_kind(process.events, "checkpoint")[-1]
    assert checkpoint["step"] == stopped_at
    assert Path(checkpoint["path"]).name == f"step_{stopped_at:09d}"
    assert sharded_checkpoint.load_extra(Path(checkpoint["path"]))["step"] == stopped_at
    # and one process resumes it and carries on
    path = write_config(config(tmp_path, stopped_at + 2, {"micro_batch": 8}), "resume.json")
    code, events, stderr = run_harness(["--config", str(path)])
    assert code == 0, stderr
    assert events[0]["start_step"] == stopped_at
    assert [e["step"] for e in of_kind(events, "step")] == [stopped_at + 1, stopped_at + 2]


def test_only_complete_step_directories_count(tmp_path):
    directory = tmp_path / "ckpt"
    # given a completed step, a step without its harness file, and a killed write's leftover
    complete = directory / "step_000000004"
    complete.mkdir(parents=True)
    (complete / ".metadata").write_bytes(b"x")
    (complete / "harness.pt").write_bytes(b"x")
    incomplete = directory / "step_000000008"
    incomplete.mkdir()
    (incomplete / ".metadata").write_bytes(b"x")
    leftover = directory / ".step_000000009.tmp"
    leftover.mkdir()
    (leftover / "__0_0.distcp").write_bytes(b"x")
    # then only the complete one is listed, and the leftover is removed at start
    assert sharded_checkpoint.list_steps(directory) == [(4, complete)]
    sharded_checkpoint.remove_stale_temporaries(directory)
    assert not leftover.exists() and incomplete.exists()
    # and an unreadable harness file is skipped rather than resumed from
    assert sharded_checkpoint.latest_readable(directory) is None
