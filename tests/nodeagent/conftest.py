"""A real HTTP server for the agent to talk to: stdlib http.server in a thread.

Each test scripts the answers per path with a function of the request; every request is
recorded (path, headers, parsed JSON body) so tests can assert what the agent sent.

The agent needs no Django, and neither do its tests: nothing under tests/nodeagent/ (nor
tests/agentprotocol/) may import Django or the server's apps. Run from the repository root with
pyproject.toml, they are part of the whole suite. On a host with only `gpumarket[agent]` and
pytest (a GPU host, the agent's CI job, tests/nodeagent/test_standalone.py), run them without
the repository's pytest settings and without tests/conftest.py, which loads Django:

    python -m pytest -c /dev/null --rootdir . --confcutdir tests/nodeagent -p no:django \
        -m "not docker and not harness and not e2e and not s3" tests/agentprotocol tests/nodeagent

(`--confcutdir` stops pytest from loading conftest.py files above tests/nodeagent/; tests
marked `docker` need a Docker Engine, `harness` ones torch, `e2e` ones are the slow
end-to-end checks, `s3` ones SeaweedFS and boto3: tests/nodeagent/s3.py.)
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest


@dataclass
class Request:
    path: str
    headers: dict[str, str]
    body: Any
    at: float = 0.0  # when it arrived (time.monotonic)
    port: int = 0  # the client's end of the connection it came on


# (status, JSON body or raw text[, seconds to wait before answering[, response headers]])
Answer = tuple[int, Any] | tuple[int, Any, float] | tuple[int, Any, float, dict[str, str]]
Responder = Callable[[Request], Answer]


@dataclass
class FakeServer:
    url: str = ""
    requests: list[Request] = field(default_factory=list)
    responders: dict[str, Responder] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    keep_alive: bool = False  # HTTP/1.1 connections kept between requests (else one each)

    def on(self, path: str, responder: Responder) -> None:
        self.responders[path] = responder

    def bodies(self, path: str) -> list[Any]:
        with self.lock:
            return [r.body for r in self.requests if r.path == path]


@pytest.fixture(autouse=True)
def agent_dirs_searchable(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """pytest's temporary directories are 0700; a root agent runs process-runtime commands as
    nobody, which must pass through them to its workspace (search only, no listing)."""
    base = tmp_path_factory.getbasetemp()
    for directory in (base.parent, base, tmp_path):
        directory.chmod(directory.stat().st_mode | 0o011)


@pytest.fixture(scope="session")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A real S3 server (SeaweedFS) for the whole session."""
    from tests.nodeagent.s3 import SeaweedS3

    server = SeaweedS3(tmp_path_factory.mktemp("seaweedfs")).start()
    yield server
    server.stop()


@pytest.fixture
def fake_server() -> Iterator[FakeServer]:
    server_state = FakeServer()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            try:
                body = json.loads(raw) if raw else None
            except ValueError:
                body = raw.decode(errors="replace")
            if server_state.keep_alive:
                self.protocol_version, self.close_connection = "HTTP/1.1", False
            request = Request(
                self.path, dict(self.headers), body, time.monotonic(), self.client_address[1]
            )
            with server_state.lock:
                server_state.requests.append(request)
            responder = server_state.responders.get(self.path)
            answer = responder(request) if responder else (404, {"detail": "not found"})
            status, payload = answer[0], answer[1]
            if len(answer) >= 3:
                time.sleep(answer[2])
            headers = answer[3] if len(answer) == 4 else {}
            data = payload.encode() if isinstance(payload, str) else json.dumps(payload).encode()
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for name, value in headers.items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client gave up (timeout tests)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    httpd.block_on_close = False  # a handler still sleeping (timeout tests) is not waited for
    server_state.url = f"http://127.0.0.1:{httpd.server_address[1]}"
    thread = threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield server_state
    httpd.shutdown()
    httpd.server_close()
