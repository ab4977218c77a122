"""A real image registry for tests: Debian's `docker-registry` (the CNCF distribution registry)
on a free port of 127.0.0.1, which the Docker Engine treats as insecure by default (plain HTTP),
with a throttling TCP proxy in front of it so that a pull lasts long enough to be watched.

No Django here: the agent's tests use it as well as the end-to-end ones.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import socket
import subprocess
import tarfile
import threading
import time
import urllib.request
from pathlib import Path

REGISTRY_BINARY = "docker-registry"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LocalRegistry:
    """`docker-registry serve` with its storage under `root`; `host` is what image names use."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.port = free_port()
        self.host = f"127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> LocalRegistry:
        binary = shutil.which(REGISTRY_BINARY)
        if binary is None:
            raise RuntimeError("no docker-registry: apt-get install -y docker-registry")
        config = self.root / "config.yml"
        config.write_text(
            "version: 0.1\n"
            "storage:\n"
            f"  filesystem:\n    rootdirectory: {self.root / 'data'}\n"
            "  delete:\n    enabled: true\n"
            f"http:\n  addr: 127.0.0.1:{self.port}\n"
        )
        log = (self.root / "registry.log").open("ab")
        self.proc = subprocess.Popen([binary, "serve", str(config)], stdout=log, stderr=log)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://{self.host}/v2/", timeout=2):
                    return self
            except OSError:
                time.sleep(0.2)
        self.stop()
        log = (self.root / "registry.log").read_text()
        raise RuntimeError(f"the registry did not answer: {log}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


class ThrottledProxy:
    """A TCP proxy to `target_port` passing at most `bytes_per_s` per connection downstream."""

    def __init__(self, target_port: int, bytes_per_s: int) -> None:
        self.target_port = target_port
        self.rate = bytes_per_s
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.host = f"127.0.0.1:{self.port}"
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.closed:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target_port), timeout=30)
            threading.Thread(target=self._pipe, args=(client, upstream, 0), daemon=True).start()
            threading.Thread(
                target=self._pipe, args=(upstream, client, self.rate), daemon=True
            ).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket, rate: int) -> None:
        chunk = 16 * 1024
        try:
            while True:
                data = src.recv(chunk)
                if not data:
                    break
                dst.sendall(data)
                if rate:
                    time.sleep(len(data) / rate)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                s.close()

    def close(self) -> None:
        self.closed = True
        self.sock.close()


def build_image(client, tag: str, *, base: str, layers_mb: tuple[int, ...]) -> None:
    """Build `tag` from `base` with one layer of random (incompressible) bytes per size given,
    so that pulling it moves about that many megabytes."""
    dockerfile = f"FROM {base}\n" + "".join(
        f"COPY blob{i} /opt/blob{i}\n" for i in range(len(layers_mb))
    )
    context = io.BytesIO()
    with tarfile.open(fileobj=context, mode="w") as tar:
        for name, data in [("Dockerfile", dockerfile.encode())] + [
            (f"blob{i}", os.urandom(size * 1024 * 1024)) for i, size in enumerate(layers_mb)
        ]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    context.seek(0)
    client.images.build(fileobj=context, custom_context=True, tag=tag, rm=True, forcerm=True)


def push_only(client, tag: str) -> None:
    """Push `tag` to its registry, then remove it from the engine: whoever runs it pulls it."""
    repository, _, version = tag.rpartition(":")
    for event in client.api.push(repository, tag=version, stream=True, decode=True):
        if event.get("error"):
            raise RuntimeError(f"push of {tag} failed: {event['error']}")
    client.images.remove(tag, force=True)
