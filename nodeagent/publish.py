"""Published ports: a run's container port reachable on the node's public address.

A rental's container sits on an internal network with no route to the host (see
nodeagent/runtime/docker.py), and the engine may run without iptables, so the engine cannot
publish its ports. The agent does it in user space instead: for each published port it listens
on a host port from its configured range, and a serving thread that has entered the container's
network namespace (setns(2) on /proc/<pid>/ns/net) accepts each connection on that host socket
and opens the inner one to 127.0.0.1:<container port>. A socket keeps the namespace it was made
in, so the two ends then live in different namespaces and a pipe thread copies bytes between
them. Nothing inside the container can reach the host through this: only connections made to
the host port go in, and nothing comes out but their answers.

A port is reported (`PublishedPort`) once something in the container listens on it: the serving
thread probes it until then. Stopping a forward closes its listener (new connections are
refused) and every connection it carries.

Entering another process's network namespace needs CAP_SYS_ADMIN: the agent runs as root on the
host (or with hostPID and that capability in a DaemonSet); without it nothing is published and
the log says why.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import logging
import os
import selectors
import socket
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from agentprotocol import ContainerStatus, DesiredRun, PublishedPort
from nodeagent.runtime.base import ContainerState

logger = logging.getLogger(__name__)

CLONE_NEWNET = 0x40000000
PROBE_EVERY_S = 0.5
CONNECT_TIMEOUT_S = 5.0
MAX_CONNECTIONS = 64  # per published port: each one holds a thread
CHUNK = 64 * 1024

_libc = ctypes.CDLL(None, use_errno=True)


class PublishError(OSError):
    """A port cannot be published (no free host port, no permission to enter the namespace)."""


def enter_netns(pid: int) -> None:
    """Move the calling thread (only it) into the network namespace of process `pid`."""
    fd = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        if _libc.setns(fd, CLONE_NEWNET) != 0:
            code = ctypes.get_errno()
            raise PublishError(code, f"setns into the network namespace of pid {pid}: "
                               f"{os.strerror(code)}")  # fmt: skip
    finally:
        os.close(fd)


@dataclass(frozen=True, slots=True)
class PublishConfig:
    """Where published ports listen (`address`), the name clients use (`host`), and the host
    ports they may take (`first_port`..`last_port`, inclusive)."""

    address: str
    host: str
    first_port: int
    last_port: int

    def __post_init__(self) -> None:
        if not 0 < self.first_port <= self.last_port < 65536:
            raise ValueError("the publish port range must be within 1-65535, first <= last")


def preferred_port(config: PublishConfig, run_id: str, container_port: int) -> int:
    """Where a run's port is tried first: stable across agent restarts, so a client that knew
    the port usually finds it again after one."""
    size = config.last_port - config.first_port + 1
    digest = hashlib.sha256(f"{run_id}:{container_port}".encode()).digest()
    return config.first_port + int.from_bytes(digest[:4], "big") % size


def _listen(config: PublishConfig, start: int) -> socket.socket:
    size = config.last_port - config.first_port + 1
    for offset in range(size):
        port = config.first_port + (start - config.first_port + offset) % size
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((config.address, port))
        except OSError as exc:
            sock.close()
            if exc.errno in (errno.EADDRINUSE, errno.EACCES):
                continue
            raise
        sock.listen(16)
        return sock
    raise PublishError(errno.EADDRINUSE, "no free port left in the publish range")


def _pipe(a: socket.socket, b: socket.socket, stop: threading.Event) -> None:
    """Copy bytes both ways until both directions are done (or the forward stops)."""
    sel = selectors.DefaultSelector()
    peer = {a: b, b: a}
    for sock in (a, b):
        sock.setblocking(True)
        sel.register(sock, selectors.EVENT_READ)
    open_reads = 2
    try:
        while open_reads and not stop.is_set():
            for key, _ in sel.select(timeout=PROBE_EVERY_S):
                src = key.fileobj
                try:
                    data = src.recv(CHUNK)
                except OSError:
                    return
                if not data:
                    sel.unregister(src)
                    open_reads -= 1
                    try:
                        peer[src].shutdown(socket.SHUT_WR)  # half-close: EOF travels on
                    except OSError:
                        return
                    continue
                try:
                    peer[src].sendall(data)
                except OSError:
                    return
    finally:
        sel.close()
        for sock in (a, b):
            sock.close()


class Forward:
    """One published port of one run: a host listener and the connections it carries."""

    def __init__(
        self, *, config: PublishConfig, run_id: str, netns_pid: int, container_port: int
    ) -> None:
        self.run_id = run_id
        self.netns_pid = netns_pid
        self.container_port = container_port
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._lock = threading.Lock()
        self._connections: set[socket.socket] = set()
        self._listener = _listen(config, preferred_port(config, run_id, container_port))
        self.host = config.host
        self.host_port = self._listener.getsockname()[1]
        self.error: str | None = None
        self._thread = threading.Thread(
            target=self._serve, name=f"publish-{run_id}-{container_port}", daemon=True
        )
        self._thread.start()

    @property
    def ready(self) -> bool:
        """Something in the container has been seen listening on the port."""
        return self._ready.is_set()

    def published(self) -> PublishedPort:
        return PublishedPort(
            container_port=self.container_port, host=self.host, host_port=self.host_port
        )

    def wait_ready(self, timeout: float) -> bool:
        return self._ready.wait(timeout)

    def _inner(self, timeout: float) -> socket.socket:
        # Made by the serving thread, hence in the container's namespace.
        return socket.create_connection(("127.0.0.1", self.container_port), timeout=timeout)

    def _serve(self) -> None:
        try:
            enter_netns(self.netns_pid)
        except OSError as exc:
            self.error = str(exc)
            logger.error(
                "cannot enter the run's network namespace: port not published",
                extra={"run_id": self.run_id, "port": self.container_port, "error": str(exc)},
            )
            self.close()
            return
        sel = selectors.DefaultSelector()
        sel.register(self._listener, selectors.EVENT_READ)
        try:
            while not self._stop.is_set():
                if not self._ready.is_set():
                    self._probe()
                if not sel.select(timeout=PROBE_EVERY_S):
                    continue
                try:
                    client, _ = self._listener.accept()
                except OSError:
                    continue  # closed by close(), or the client gave up
                self._accepted(client)
        finally:
            sel.close()

    def _probe(self) -> None:
        try:
            self._inner(timeout=1.0).close()
        except OSError:
            return
        self._ready.set()
        logger.info(
            "port published",
            extra={"run_id": self.run_id, "port": self.container_port, "host_port": self.host_port},
        )

    def _accepted(self, client: socket.socket) -> None:
        with self._lock:
            full = len(self._connections) >= MAX_CONNECTIONS
        if full:
            client.close()
            return
        try:
            inner = self._inner(timeout=CONNECT_TIMEOUT_S)
        except OSError:
            client.close()  # nothing listens (yet, or any more): the client sees the close
            return
        self._ready.set()
        with self._lock:
            if self._stop.is_set():
                client.close()
                inner.close()
                return
            self._connections.update((client, inner))
        threading.Thread(
            target=self._carry, args=(client, inner), name=f"pipe-{self.run_id}", daemon=True
        ).start()

    def _carry(self, client: socket.socket, inner: socket.socket) -> None:
        try:
            _pipe(client, inner, self._stop)
        finally:
            with self._lock:
                self._connections.difference_update((client, inner))

    def close(self) -> None:
        """Stop listening and end every connection; idempotent."""
        self._stop.set()
        self._listener.close()
        with self._lock:
            connections, self._connections = list(self._connections), set()
        for sock in connections:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()


@dataclass(frozen=True, slots=True)
class Wanted:
    """A run whose ports should be published: the process whose namespace they are in."""

    netns_pid: int
    ports: tuple[int, ...]


class Publisher:
    """The agent's forwards, reconciled each round with the runs that want ports."""

    def __init__(self, config: PublishConfig | None) -> None:
        self.config = config
        self._forwards: dict[tuple[str, int], Forward] = {}
        self._failed: set[tuple[str, int, int]] = set()  # logged once per (run, port, pid)

    def reconcile(self, wanted: Mapping[str, Wanted]) -> None:
        """Publish what `wanted` names, close the rest (a stopped run, a restarted container)."""
        for key, forward in list(self._forwards.items()):
            want = wanted.get(key[0])
            if want is None or key[1] not in want.ports or want.netns_pid != forward.netns_pid:
                forward.close()
                del self._forwards[key]
        self._failed = {failed for failed in self._failed if failed[0] in wanted}
        if self.config is None:
            return
        for run_id, want in wanted.items():
            for port in want.ports:
                failed = (run_id, port, want.netns_pid) in self._failed
                if failed or (run_id, port) in self._forwards:
                    continue
                try:
                    self._forwards[run_id, port] = Forward(
                        config=self.config, run_id=run_id, netns_pid=want.netns_pid,
                        container_port=port,
                    )  # fmt: skip
                except OSError as exc:
                    self._failed.add((run_id, port, want.netns_pid))
                    logger.error(
                        "port not published",
                        extra={"run_id": run_id, "port": port, "error": str(exc)},
                    )

    def published(self, run_id: str) -> tuple[PublishedPort, ...]:
        """The run's ports that are reachable now, by container port."""
        return tuple(
            forward.published()
            for (rid, _), forward in sorted(self._forwards.items())
            if rid == run_id and forward.ready and forward.error is None
        )

    def close(self) -> None:
        for forward in self._forwards.values():
            forward.close()
        self._forwards.clear()


def wanted_ports(
    desired: Iterable[DesiredRun], actual: Iterable[ContainerState]
) -> dict[str, Wanted]:
    """The desired runs with ports that run now in a namespace the agent can enter."""
    running = {
        state.run_id: state.netns_pid
        for state in actual
        if state.status == ContainerStatus.RUNNING and state.netns_pid
    }
    return {
        entry.run_id: Wanted(netns_pid=running[entry.run_id], ports=tuple(entry.ports))
        for entry in desired
        if entry.ports and entry.run_id in running
    }
