"""A real wake server (`manage.py wake_server`) on a free port, for the tests that need one."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import requests
from django.conf import settings

from devstack.embedded import free_port

ROOT = Path(__file__).resolve().parents[2]


class WakeServer:
    """The wake server process on its own channel; `url` is its long-poll URL."""

    def __init__(self, *, log: Path, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.url = f"{self.base}/wake/v1/wait"
        self.channel = f"wake-test-{uuid.uuid4().hex[:12]}"
        self.log = log
        self.env = {
            **os.environ,
            **(env or {}),
            # The web's key: tickets the test process signs are the server's own.
            "SECRET_KEY": settings.SECRET_KEY,
            "REDIS_URL": settings.REDIS_URL,
            "WAKE_CHANNEL": self.channel,
            "PYTHONPATH": str(ROOT),
        }
        self.proc: subprocess.Popen | None = None

    def start(self) -> WakeServer:
        self.proc = subprocess.Popen(
            [sys.executable, "manage.py", "wake_server", "--port", str(self.port)],
            cwd=ROOT, env=self.env, stdout=self.log.open("ab"), stderr=subprocess.STDOUT,
        )  # fmt: skip
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"wake server exited: {self.log.read_text()[-2000:]}")
            try:
                if requests.get(f"{self.base}/wake/v1/healthz", timeout=1).status_code == 200:
                    return self
            except requests.RequestException:
                pass
            time.sleep(0.1)
        raise RuntimeError("wake server did not subscribe within 60 s")

    def health(self) -> dict:
        return requests.get(f"{self.base}/wake/v1/healthz", timeout=5).json()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
