"""The whole stack as `dev.py up` runs it, for tests that kill its parts: gunicorn, a Celery
worker, Celery beat and one node agent under the real supervisor, on the test database and a
Redis of their own (so a test can restart it without touching the suite's)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import requests

from devstack.embedded import free_port, start_redis
from devstack.supervisor import Supervisor
from tests.e2e.conftest import ROOT, wait_for

BIN = Path(sys.executable).parent
# The application_name settings give each database connection.
_PID = re.compile(r"\bgpumarket pid=(\d+)")


class Stack:
    """web + worker + beat + agent under a Supervisor polled by a background thread."""

    def __init__(
        self,
        *,
        env: dict[str, str],
        tmp: Path,
        join_token: str | None,
        agent: list[str] | None,
        agents: dict[str, list[str]] | None = None,
        binds: tuple[str, ...] = (),
        workers: int = 1,
    ):
        """`agent` joins with `join_token` on loopback; `agents` (also settable until start) are
        whole commands with their own server URL and token; gunicorn also listens on `binds`;
        `workers` Celery worker processes ("worker", "worker-2", ...) share the broker."""
        self.tmp = tmp
        self.redis_dir = tmp / "redis"
        self.redis_port = free_port()
        self.redis: subprocess.Popen | None = None
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {**env, "BEAT_MAX_INTERVAL_S": "1", "NODE_SILENCE_TIMEOUT_S": "10"}
        self.messages: list[str] = []
        self.supervisor = Supervisor(
            env=self.env, cwd=ROOT, say=self.messages.append, backoff_initial=0.5
        )
        self._join_token = join_token
        self._agent = agent
        self.agents = dict(agents or {})
        self._binds = binds
        self.workers = ["worker", *(f"worker-{i}" for i in range(2, workers + 1))]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._supervise, daemon=True)

    def start_redis(self) -> None:
        url, self.redis = start_redis(self.redis_dir, port=self.redis_port)
        self.env.update(REDIS_URL=url, CELERY_BROKER_URL=url)

    def stop_redis(self) -> None:
        assert self.redis is not None
        self.redis.terminate()
        self.redis.wait(15)

    def start(self) -> Stack:
        self.start_redis()
        celery = str(BIN / "celery")
        subprocess.run(
            [celery, "-A", "config", "purge", "-f"], env=self.env, cwd=ROOT, check=False,
            capture_output=True, timeout=60,
        )  # fmt: skip
        logs = self.tmp / "logs"
        binds = [arg for host in self._binds for arg in ("--bind", f"{host}:{self.port}")]
        commands = {
            "web": [
                str(BIN / "gunicorn"), "config.wsgi", "--bind", f"127.0.0.1:{self.port}",
                *binds, "--workers", "1", "--threads", "4",
            ],
            **{
                name: [celery, "-A", "config", "worker", "-l", "info", "-c", "1",
                       "-n", f"{name}@%h"]
                for name in self.workers
            },
            "beat": [
                celery, "-A", "config", "beat", "-l", "info",
                "-s", str(self.tmp / "celerybeat-schedule"),
            ],
        }  # fmt: skip
        if self._agent is not None:
            assert self._join_token is not None
            commands["agent"] = [
                *self._agent, "--server", self.url, "--join-token", self._join_token
            ]  # fmt: skip
        commands.update(self.agents)
        for name, cmd in commands.items():
            self.supervisor.add(name, cmd, logs / f"{name}.log")
        self.supervisor.start_all()
        self._thread.start()
        wait_for(self._web_answers, 60, "gunicorn to answer")
        for name in self.workers:
            wait_for(lambda n=name: b"ready" in self.log_bytes(n), 90, f"the Celery {name}")
        return self

    def send_task(self, name: str, *args) -> bool:
        """Queue a task on this stack's broker, as the web process would; False when the broker
        is unreachable (the message is lost, as a create's is while Redis is down)."""
        from celery import Celery

        # Not made the current app: the suite's own tasks (queued through `current_app` after
        # each commit) must keep going to the suite's broker, not this stack's.
        app = Celery(
            "stack-client", broker=self.env["CELERY_BROKER_URL"], set_as_current=False,
            broker_transport_options={"socket_timeout": 2, "socket_connect_timeout": 2},
        )  # fmt: skip
        try:
            app.send_task(name, args=list(args), retry=False)
        except Exception:
            return False
        finally:
            app.close()
        return True

    def kill_lock_holder(self, lock: str) -> str | None:
        """SIGKILL the worker whose process holds the named advisory lock right now (its pool
        process, mid-task, and its main process), as a host that dies would; returns the
        worker's name, or None when no worker of this stack holds it."""
        import psutil
        from django.db import connection

        from core.locks import advisory_key

        key = advisory_key(lock) & (2**64 - 1)
        with connection.cursor() as cursor:
            cursor.execute(
                """
                SELECT a.application_name FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
                WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
                  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
                  AND l.classid::bigint = %s AND l.objid::bigint = %s
                """,
                [key >> 32, key & 0xFFFFFFFF],
            )
            # Settings name each connection after the process that loaded them: a worker's
            # main process, whose pool processes inherit the name (works over a Unix socket too).
            holders = {int(m[1]) for (name,) in cursor.fetchall() if (m := _PID.search(name or ""))}
        for name in self.workers:
            main = psutil.Process(self.pid(name))
            if main.pid not in holders:
                continue
            with contextlib.suppress(psutil.Error):
                for proc in [*main.children(recursive=True), main]:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(proc.pid, signal.SIGKILL)
            return name
        return None

    def _web_answers(self) -> bool:
        try:
            return requests.get(f"{self.url}/api/schema/", timeout=5).status_code == 200
        except requests.RequestException:
            return False

    def _supervise(self) -> None:
        while not self._stop.is_set():
            self.supervisor.poll()
            time.sleep(0.2)

    def pid(self, name: str) -> int:
        return wait_for(lambda: self.supervisor.children[name].pid, 60, f"{name} to run")

    def log_bytes(self, name: str) -> bytes:
        path = self.tmp / "logs" / f"{name}.log"
        return path.read_bytes() if path.exists() else b""

    def log(self, name: str) -> str:
        return self.log_bytes(name).decode(errors="replace")

    def stop(self) -> None:
        self._stop.set()
        with contextlib.suppress(RuntimeError):
            self._thread.join(10)
        self.supervisor.stop()
        if self.redis is not None and self.redis.poll() is None:
            self.stop_redis()
        self._kill_runs()

    def _kill_runs(self) -> None:
        """The local-process runtime's runs outlive their agent by design (a restarted agent
        adopts them): end the ones this stack started."""
        import psutil

        for proc in psutil.process_iter(["pid", "cmdline"]):
            cmdline = " ".join(proc.info["cmdline"] or [])
            if "_process_wrapper.py" in cmdline and str(self.tmp) in cmdline:
                with contextlib.suppress(psutil.Error, ProcessLookupError):
                    os.killpg(proc.info["pid"], signal.SIGKILL)


def agent_command(*, state: Path, runtime: str, gpus: int, hostname: str) -> list[str]:
    """The node agent as a provider runs it, with simulated GPUs and no real device access."""
    return [
        sys.executable, "-m", "nodeagent",
        "--runtime", runtime, "--gpu-mode", "none", "--telemetry", "simulated",
        "--simulate-gpus", f"rtx4090-24gb:{gpus}", "--hostname", hostname,
        "--state-dir", str(state / "state"), "--volume-root", str(state / "volumes"),
        "--process-dir", str(state / "runs"), "--interval", "1",
    ]  # fmt: skip


class JoinAnswerLosingProxy:
    """An HTTP/1.1 forwarder in front of the web server that loses each host's first join
    answer: the server gets the join and answers it, the agent never hears (the connection is
    held past the agent's timeout, then dropped), as a busy machine made it happen. Everything
    else passes through. `lost` maps each hostname to the status the server gave it."""

    JOIN = b"POST /api/agent/v1/join/ "

    def __init__(self, target_port: int, *, hold_s: float) -> None:
        import socket

        self.target_port = target_port
        self.hold_s = hold_s
        self.lost: dict[str, int] = {}
        self._lock = threading.Lock()
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(128)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client) -> None:
        import socket

        try:
            client_file = client.makefile("rb")
            while True:
                request = _read_message(client_file)
                if request is None:
                    return
                # A connection to the server per request: the client's connection stays
                # usable however long it idles, as it would with the server itself.
                with socket.create_connection(("127.0.0.1", self.target_port), 10) as upstream:
                    upstream.sendall(request)
                    answer = _read_message(upstream.makefile("rb"), until_close=True)
                if answer is None:
                    return
                host = self._first_join_of(request)
                if host is not None:
                    with self._lock:
                        self.lost[host] = int(answer.split(b" ", 2)[1])
                    time.sleep(self.hold_s)
                    return
                client.sendall(answer)
        except OSError:
            return
        finally:
            with contextlib.suppress(OSError):
                client.close()

    def _first_join_of(self, request: bytes) -> str | None:
        import json

        if not request.startswith(self.JOIN):
            return None
        try:
            host = json.loads(request.split(b"\r\n\r\n", 1)[1])["hostname"]
        except (ValueError, KeyError, IndexError, TypeError):
            return None
        with self._lock:
            return None if host in self.lost else host


def _read_message(stream, *, until_close: bool = False) -> bytes | None:
    """One HTTP/1.1 message (head and a Content-Length body) from a buffered socket file; a
    response without a length is read to the end of the connection."""
    head = b""
    while not head.endswith(b"\r\n\r\n"):
        line = stream.readline(65537)
        if not line:
            return None
        head += line
    length = None
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value.strip())
    if length is not None:
        return head + stream.read(length)
    if until_close and not head.split(b" ", 2)[1].startswith((b"1", b"204", b"304")):
        return head + stream.read()
    return head
