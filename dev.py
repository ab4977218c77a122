#!/usr/bin/env python3
"""The two set-up commands, for a machine that has only Python 3.11+.

    python3 dev.py up     # the whole stack on embedded services: web, worker, beat, a local agent
    python3 dev.py test   # every check (ruff, Django checks, migrations) and the whole test suite

Both create `.venv/` and install the project into it when pyproject.toml changed, then hand over
to `devstack.stack` inside that virtualenv. DATABASE_URL / REDIS_URL, when set, are used instead of
the embedded PostgreSQL and Redis.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
PYTHON = VENV / "bin" / "python"
STAMP = VENV / ".gpumarket-installed"


# An editable install that puts the checkout on sys.path with a plain .pth line ("compat"):
# the default one imports a finder module at every interpreter start, about 13 ms of each
# `gpumarket` call here.
INSTALL = ["install", "--quiet", "--config-settings", "editable_mode=compat", "-e"]


def _install_digest() -> str:
    text = (ROOT / "pyproject.toml").read_bytes() + " ".join(INSTALL).encode()
    return hashlib.sha256(text).hexdigest()


def ensure_venv() -> None:
    if sys.version_info < (3, 11):  # noqa: UP036 - this file runs before the venv exists
        sys.exit("Python 3.11 or newer is needed")
    if not PYTHON.exists():
        print("creating .venv", flush=True)
        venv.EnvBuilder(with_pip=True).create(VENV)
    digest = _install_digest()
    if STAMP.exists() and STAMP.read_text() == digest:
        return
    log = ROOT / ".var" / "install.log"
    log.parent.mkdir(exist_ok=True)
    print(f"installing the project into .venv (minutes, the first time; log: {log})", flush=True)
    # pip's and the build backend's notices (setuptools warns about the editable mode chosen
    # below, in a box of asterisks) go to the log; it is shown when the install fails.
    with log.open("w") as out:
        for args in (
            ["install", "--quiet", "--upgrade", "pip"],
            # torch==2.13.0 is pinned: on these machines pip takes the CPU wheel from its cache.
            [*INSTALL, f"{ROOT}[harness,dev]"],
        ):
            done = subprocess.run(
                [str(PYTHON), "-m", "pip", *args], stdout=out, stderr=subprocess.STDOUT, check=False
            )
            if done.returncode != 0:
                out.flush()
                sys.stderr.write(log.read_text()[-8000:])
                sys.exit(f"installing the project failed (exit {done.returncode}); see {log}")
    STAMP.write_text(digest)


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in {"up", "test"}:
        sys.exit(__doc__)
    ensure_venv()
    os.chdir(ROOT)
    # Hand over to the venv interpreter.
    os.execv(str(PYTHON), [str(PYTHON), "-m", "devstack.stack", *sys.argv[1:]])  # noqa: S606


if __name__ == "__main__":
    main()
