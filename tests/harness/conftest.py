"""Fixtures for the harness tests.

The harness is a plain PyTorch program, so these tests need no Django settings and no database.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.harness.helpers import HarnessProcess, harness_env


@pytest.fixture
def clean_env() -> dict[str, str]:
    """The environment for a harness child process: repo importable, no inherited job."""
    return harness_env()


@pytest.fixture
def start_harness(tmp_path: Path):
    """Start ``python -m harness ARGS``; every process is killed at teardown if still running."""
    started: list[HarnessProcess] = []

    def start(args: list[str], env: dict[str, str] | None = None) -> HarnessProcess:
        process = HarnessProcess(args, tmp_path, env)
        started.append(process)
        return process

    yield start
    for process in started:
        process.kill()


@pytest.fixture
def run_harness(start_harness):
    """Run ``python -m harness ARGS`` to completion: (exit status, events, stderr)."""

    def run(args: list[str], timeout: float = 120, env: dict[str, str] | None = None):
        process = start_harness(args, env)
        code = process.finish(timeout)
        return code, process.events, process.stderr()

    return run


@pytest.fixture
def write_config(tmp_path: Path):
    """Write a config mapping to a JSON (default) or YAML file and return its path."""

    def write(config: dict[str, Any], name: str = "config.json") -> Path:
        path = tmp_path / name
        if path.suffix == ".json":
            path.write_text(json.dumps(config))
        else:
            import yaml

            path.write_text(yaml.safe_dump(config))
        return path

    return write


@pytest.fixture
def run_trainer():
    """Train a config in this process; return its events. ``stop_after`` asks the trainer to
    stop (the SIGTERM path) once the step event of that step has been emitted."""
    from harness.config import load_config_dict
    from harness.trainer import Trainer

    def run(raw: dict[str, Any], stop_after: int | None = None) -> list[dict[str, Any]]:
        raw = {"checkpoint": {"enabled": False}, **raw}
        raw["train"] = {"device": "cpu", **raw.get("train", {})}
        events: list[dict[str, Any]] = []

        def emit(event: dict[str, Any]) -> None:
            events.append(event)
            if event["event"] == "step" and event["step"] == stop_after:
                trainer.request_stop()

        trainer = Trainer(load_config_dict(raw), emit=emit)
        trainer.run()
        return events

    return run
