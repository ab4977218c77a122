"""The agent stands alone: `gpumarket[agent]` in a fresh virtualenv, without Django.

It installs the project (a copy of its packages, not editable) with only the agent's extra,
checks that Django is not there, that `gpumarket-agent --help` works, and runs the agent's and
the protocol's unit tests with that environment's pytest (see tests/nodeagent/conftest.py for
the invocation).
"""

from __future__ import annotations

import shutil
import subprocess
import venv
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("agentprotocol", "nodeagent", "config", "marketplace", "scheduler", "provisioning",
            "billing", "harness")  # fmt: skip


def run(*args: str | Path, cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(a) for a in args], cwd=cwd, capture_output=True, text=True, timeout=timeout,
        check=False,
    )  # fmt: skip


@pytest.mark.e2e
def test_the_agent_installs_and_runs_without_django(tmp_path):
    # given the project's source (copied: building in place would leave build/ in the checkout)
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    for package in PACKAGES:
        shutil.copytree(
            REPO / package, source / package, ignore=shutil.ignore_patterns("__pycache__")
        )
    # when it is installed with only the agent's extra into a fresh virtualenv
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = env_dir / "bin" / "python"
    install = run(
        python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
        f"{source}[agent]", "pytest", "hypothesis",
        cwd=tmp_path, timeout=600,
    )  # fmt: skip
    assert install.returncode == 0, install.stderr
    # then Django is not there
    django = run(python, "-c", "import django", cwd=tmp_path, timeout=60)
    assert django.returncode != 0 and "No module named 'django'" in django.stderr
    # and the agent's command works
    usage = run(env_dir / "bin" / "gpumarket-agent", "--help", cwd=tmp_path, timeout=60)
    assert usage.returncode == 0, usage.stderr
    assert usage.stdout.startswith("usage: gpumarket-agent")
    # and the agent's and the protocol's unit tests pass there
    tests = run(
        python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c", "/dev/null",
        "--rootdir", ".", "--confcutdir", "tests/nodeagent", "-p", "no:django",
        "-m", "not docker and not harness and not e2e and not s3",
        "-W", "ignore::pytest.PytestUnknownMarkWarning",  # markers are pyproject.toml's
        "tests/agentprotocol", "tests/nodeagent",
        cwd=REPO, timeout=600,
    )  # fmt: skip
    assert tests.returncode == 0, tests.stdout[-5000:] + tests.stderr[-2000:]
    assert " passed" in tests.stdout and " failed" not in tests.stdout
