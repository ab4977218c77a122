"""Host facts for the join payload, from the standard library and /proc (no psutil on hosts)."""

from __future__ import annotations

import os
import shutil
import socket
from urllib.parse import urlsplit

_GIB = 1024**3


def cpu_cores() -> int:
    """Cores this process may use (the cgroup/affinity view, not the machine's total)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def ram_gb(meminfo: str = "/proc/meminfo") -> int:
    """Total memory in GiB, from MemTotal (kB)."""
    with open(meminfo) as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return max(1, int(line.split()[1]) * 1024 // _GIB)
    raise RuntimeError(f"no MemTotal in {meminfo}")


def disk_gb(path: str) -> int:
    """Size in GiB of the filesystem holding `path` (the nearest existing parent)."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return max(1, shutil.disk_usage(path).total // _GIB)


def source_address(server_url: str) -> str | None:
    """The local address this host's packets to the server leave from (a UDP "connect" sends
    nothing: the kernel only picks the route); None when it cannot tell."""
    parts = urlsplit(server_url)
    if not parts.hostname:
        return None
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        family, _, _, _, address = socket.getaddrinfo(parts.hostname, port, type=socket.SOCK_DGRAM)[
            0
        ]
        with socket.socket(family, socket.SOCK_DGRAM) as sock:
            sock.connect(address)
            return sock.getsockname()[0]
    except OSError:
        return None
