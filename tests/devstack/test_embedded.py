"""The embedded servers end with the process that started them, however it ends."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from devstack.embedded import stop_process

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is gone for our purpose: it only waits to be reaped by init.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def test_redis_stops_when_the_process_that_started_it_is_killed(tmp_path):
    script = textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        sys.path.insert(0, {str(ROOT)!r})
        from devstack.embedded import start_redis
        url, proc = start_redis(Path({str(tmp_path)!r}))
        print(proc.pid, flush=True)
        time.sleep(600)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        redis_pid = int(parent.stdout.readline())
        assert _alive(redis_pid)
        # When the starter is SIGKILLed (no cleanup of its own runs)
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        # Then its Redis is sent SIGTERM and exits: it holds no port or folder for the next one.
        deadline = time.monotonic() + 15
        while _alive(redis_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(redis_pid)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(10)


def test_a_started_server_runs_on_while_its_starter_lives(tmp_path):
    from devstack.embedded import start_redis

    _url, proc = start_redis(tmp_path)
    try:
        time.sleep(0.5)
        assert proc.poll() is None
    finally:
        stop_process(proc)


def test_a_throwaway_store_starts_empty_and_a_durable_one_keeps_its_data(tmp_path):
    """The test command's store (not durable) starts empty each run: every run's bucket took
    volumes of their own, and after about ten runs on one checkout every upload answered 500."""
    from devstack.embedded import s3_client, start_seaweedfs

    def run(bucket: str, *, durable: bool) -> list[str]:
        env, proc = start_seaweedfs(tmp_path / "s3", bucket=bucket, durable=durable)
        try:
            client = s3_client(env)
            client.put_object(Bucket=bucket, Key="k", Body=b"x")
            return sorted(b["Name"] for b in client.list_buckets()["Buckets"])
        finally:
            stop_process(proc, timeout=2)

    assert run("first", durable=True) == ["first"]
    assert run("second", durable=True) == ["first", "second"]  # kept across starts
    assert run("third", durable=False) == ["third"]  # what earlier runs stored is gone
