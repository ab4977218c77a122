"""Every bench runs to its JSON line: `--quick` (tiny sizes) through the same code as the real
measurement, so that a bench cannot rot unseen between the sessions that run it in full. The
figures are not checked here (a test never asserts a timing); only that each script still runs
against the current schema and services, as the user running the test command, root or not."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.harness.helpers import REPO_ROOT as ROOT

# gpu_check.py has its own CPU rehearsal (tests/bench/test_gpu_check.py).
BENCHES = (
    "agents", "artifacts", "harness", "launch", "marketplace", "metering", "offers", "scheduler",
    "wake",
)  # fmt: skip


@pytest.mark.parametrize("name", BENCHES)
def test_the_bench_runs_to_its_json_line(name):
    # given the test session's own services (DATABASE_URL, REDIS_URL, S3 where set)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    # when the bench runs in its quick mode, as `python bench/NAME.py` runs it
    process = subprocess.run(
        [sys.executable, str(ROOT / "bench" / f"{name}.py"), "--quick"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    # then it ends cleanly with one JSON object of figures
    assert process.returncode == 0, (process.stdout[-2000:], process.stderr[-4000:])
    lines = [line for line in process.stdout.splitlines() if line.strip()]
    figures = json.loads(lines[-1])
    assert isinstance(figures, dict) and figures, lines[-1]
    # and said something beside it (each figure is printed before the JSON line)
    assert len(lines) > 1
