"""The CLI as a customer installs it: the project's base install alone (requests, no extras) in
a fresh virtualenv, its `gpumarket` console script run against the live server through a real
forward proxy, as HTTP_PROXY / HTTPS_PROXY / NO_PROXY and a CA bundle in SSL_CERT_FILE say.

Slow (a virtualenv, a wheel of the project, an install): about a minute, once per module.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import ssl
import subprocess
import sys
import threading
import tomllib
import zipfile
from base64 import urlsafe_b64encode
from hashlib import sha256
from http.client import HTTPConnection
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import metadata
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from accounts.services import api_token_create
from marketplace.models import Rental
from tests.factories import personal_team

pytestmark = pytest.mark.django_db(transaction=True)

ROOT = Path(__file__).resolve().parents[2]
# requests and what it needs: what the base install pulls in.
BASE_DISTRIBUTIONS = ("requests", "urllib3", "idna", "certifi", "charset-normalizer")
PROXY_VARIABLES = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY")


def _run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, **kwargs)


def _project_wheel(out: Path, work: Path) -> Path:
    """A wheel of the project, built from a copy of its packages (the build writes build/ and
    egg-info next to the sources, which are shared with whoever else works in the tree)."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    source = work / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for pattern in config["tool"]["setuptools"]["packages"]["find"]["include"]:
        package = ROOT / pattern.removesuffix("*")
        if package.is_dir():
            shutil.copytree(package, source / package.name, ignore=ignore)
    built = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                  "--no-index", "-w", str(out), str(source)])  # fmt: skip
    assert built.returncode == 0, built.stdout + built.stderr
    [wheel] = out.glob("gpumarket-*.whl")
    return wheel


def _wheel_of_installed(name: str, out: Path) -> None:
    """A wheel of a distribution installed here, packed again from its RECORD (for an install
    with no package index): the same files, and the tags its WHEEL file names."""
    dist = metadata.distribution(name)
    [tag] = [line.removeprefix("Tag: ") for line in (dist.read_text("WHEEL") or "").splitlines()
             if line.startswith("Tag: ")][:1]  # fmt: skip
    stem = f"{dist.metadata['Name'].replace('-', '_')}-{dist.version}"
    files = [f for f in dist.files or [] if not str(f).startswith("..") and f.suffix != ".pyc"]
    record = []
    with zipfile.ZipFile(out / f"{stem}-{tag}.whl", "w", zipfile.ZIP_DEFLATED) as wheel:
        for file in files:
            if file.name == "RECORD":
                continue
            data = Path(dist.locate_file(file)).read_bytes()
            digest = urlsafe_b64encode(sha256(data).digest()).rstrip(b"=").decode()
            wheel.writestr(str(file), data)
            record.append(f"{file},sha256={digest},{len(data)}")
        info_dir = next(str(f.parent) for f in files if f.name == "METADATA")
        record.append(f"{info_dir}/RECORD,,")
        wheel.writestr(f"{info_dir}/RECORD", "\n".join(record) + "\n")


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    """A fresh virtualenv (no system site packages) with the project's wheel installed, no
    extras. requests comes from the package index pip is configured with; where none answers,
    from wheels of the ones installed here."""
    work = tmp_path_factory.mktemp("alone")
    wheels = work / "wheels"
    wheels.mkdir()
    wheel = _project_wheel(wheels, work)
    env = _clean_env()
    made = _run([sys.executable, "-m", "venv", str(work / "venv")], env=env)
    assert made.returncode == 0, made.stderr
    pip = [str(work / "venv" / "bin" / "python"), "-m", "pip", "install", "-q"]
    installed = _run([*pip, "--retries", "0", "--timeout", "15", str(wheel)], env=env, cwd=work)
    if installed.returncode != 0:
        for name in BASE_DISTRIBUTIONS:
            _wheel_of_installed(name, wheels)
        installed = _run(
            [*pip, "--no-index", "--find-links", str(wheels), str(wheel)], env=env, cwd=work
        )
    assert installed.returncode == 0, installed.stdout + installed.stderr
    return work / "venv"


def _clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without what would make the venv see this project or
    reach the servers another way: no PYTHONPATH, no proxy or CA variable unless given."""
    dropped = {"PYTHONPATH", "VIRTUAL_ENV", "SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE"}
    dropped |= {v for name in PROXY_VARIABLES for v in (name, name.lower())}
    env = {k: v for k, v in os.environ.items() if k not in dropped}
    return {**env, **extra}


class Proxy:
    """A forward proxy on loopback: absolute-URI requests (plain HTTP, one upstream connection
    per request) and CONNECT tunnels. Records what it forwarded: (method, target)."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str]] = []
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def _forward(self) -> None:
                proxy.seen.append((self.command, self.path))
                target = urlsplit(self.path)
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                hop = {"proxy-connection", "connection", "keep-alive", "proxy-authorization"}
                headers = {k: v for k, v in self.headers.items() if k.lower() not in hop}
                upstream = HTTPConnection(target.hostname, target.port, timeout=30)
                try:
                    path = target.path + (f"?{target.query}" if target.query else "")
                    upstream.request(self.command, path, body=body, headers=headers)
                    answer = upstream.getresponse()
                    content = answer.read()
                finally:
                    upstream.close()
                self.send_response(answer.status, answer.reason)
                for name, value in answer.getheaders():
                    if name.lower() not in hop | {"transfer-encoding", "content-length"}:
                        self.send_header(name, value)
                self.send_header("Content-Length", str(len(content)))
                self.end_headers()
                self.wfile.write(content)

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _forward

            def do_CONNECT(self) -> None:
                proxy.seen.append(("CONNECT", self.path))
                host, _, port = self.path.rpartition(":")
                upstream = socket.create_connection((host, int(port)), timeout=30)
                self.send_response(200, "Connection established")
                self.end_headers()
                _pipe(self.connection, upstream)
                self.close_connection = True

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _pipe(a: socket.socket, b: socket.socket) -> None:
    """Copy bytes both ways until either side closes."""

    def copy(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    other = threading.Thread(target=copy, args=(b, a), daemon=True)
    other.start()
    copy(a, b)
    other.join(30)


@pytest.fixture
def proxy():
    running = Proxy()
    yield running
    running.close()


@pytest.fixture
def server(live_server) -> str:
    """The live server by address: NO_PROXY=127.0.0.1 must name the same host."""
    return f"http://127.0.0.1:{urlsplit(live_server.url).port}"


@pytest.fixture
def token(user) -> str:
    return api_token_create(user=user, team=personal_team(user), name="cli")[1]


def test_the_base_install_has_the_cli_and_no_django(venv, tmp_path):
    python = str(venv / "bin" / "python")
    code = "import gpumarket_cli.main, requests; print(gpumarket_cli.__file__)"
    found = _run([python, "-c", code], env=_clean_env(), cwd=tmp_path)
    assert found.returncode == 0, found.stderr
    assert found.stdout.strip().startswith(str(venv))  # the installed copy, not this tree
    django = _run([python, "-c", "import django"], env=_clean_env(), cwd=tmp_path)
    assert django.returncode == 1 and "No module named 'django'" in django.stderr


def test_the_installed_cli_rents_through_the_proxy_http_proxy_names(
    venv, proxy, server, token, make_node, tmp_path
):
    env = _clean_env(HTTP_PROXY=proxy.url, GPUMARKET_SERVER_URL=server, GPUMARKET_TOKEN=token)

    def gpumarket(*argv: str) -> subprocess.CompletedProcess:
        return _run([str(venv / "bin" / "gpumarket"), *argv], env=env, cwd=tmp_path)

    # Given no free GPU, when the customer asks for offers, then the server's answer is shown
    done = gpumarket("offers")
    assert (done.returncode, done.stdout, done.stderr) == (0, "no free GPUs match\n", "")

    # Given a node, when they rent and list their rentals (--json), the rental is there
    make_node(card="h100-sxm5-80gb", price="2.50", hostname="fra-1")
    done = gpumarket("offers", "--gpu-family", "h100")
    assert done.returncode == 0 and "fra-1" in done.stdout
    done = gpumarket("rent", "--gpus", "1", "--image", "img", "--name", "via proxy", "--", "x")
    assert done.returncode == 0, done.stderr
    rental = Rental.objects.get()
    assert done.stdout == f"{rental.pk} pending\n"
    assert (rental.name, rental.command) == ("via proxy", ["x"])
    done = gpumarket("rentals", "--json")
    assert [r["id"] for r in json.loads(done.stdout)["results"]] == [str(rental.pk)]

    # Then every request went through the proxy, each as the CLI made it
    assert proxy.seen == [
        ("GET", f"{server}/api/v1/offers/?ordering=price&limit=20"),
        ("GET", f"{server}/api/v1/offers/?gpu_family=h100&ordering=price&limit=20"),
        ("POST", f"{server}/api/v1/rentals/"),
        ("GET", f"{server}/api/v1/rentals/"),
    ]

    # And an error answer through it is the server's, with the exit code of one
    done = gpumarket("show", "00000000-0000-0000-0000-000000000000")
    assert done.returncode == 1 and done.stderr.startswith("gpumarket: 404: ")


def test_no_proxy_sends_the_cli_straight_to_the_server(venv, proxy, server, token, tmp_path):
    env = _clean_env(HTTP_PROXY=proxy.url, NO_PROXY="127.0.0.1")
    done = _run([str(venv / "bin" / "gpumarket"), "--server", server, "--token", token,
                 "offers"], env=env, cwd=tmp_path)  # fmt: skip
    assert (done.returncode, done.stdout) == (0, "no free GPUs match\n"), done.stderr
    assert proxy.seen == []


@pytest.fixture
def https_server(server, tmp_path):
    """TLS in front of the live server, with a self-signed certificate for 127.0.0.1: (its URL,
    the certificate's file)."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(cert, key)
    listener = socket.create_server(("127.0.0.1", 0))
    backend = urlsplit(server)

    def accept() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:  # closed
                return
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    def serve(conn: socket.socket) -> None:
        try:
            secure = tls.wrap_socket(conn, server_side=True)
        except OSError:
            conn.close()
            return
        _pipe(secure, socket.create_connection((backend.hostname, backend.port), timeout=30))

    threading.Thread(target=accept, daemon=True).start()
    yield f"https://127.0.0.1:{listener.getsockname()[1]}", str(cert)
    listener.close()


def test_https_goes_through_a_connect_tunnel_and_trusts_ssl_cert_file(
    venv, proxy, https_server, token, tmp_path
):
    url, cert = https_server
    command = [str(venv / "bin" / "gpumarket"), "--server", url, "--token", token, "offers"]
    # Without the CA named, the certificate is refused (in the tunnel, so the proxy saw it)
    done = _run(command, env=_clean_env(HTTPS_PROXY=proxy.url), cwd=tmp_path)
    assert done.returncode == 1 and "CERTIFICATE_VERIFY_FAILED" in done.stderr
    done = _run(command, env=_clean_env(HTTPS_PROXY=proxy.url, SSL_CERT_FILE=cert), cwd=tmp_path)
    assert (done.returncode, done.stdout) == (0, "no free GPUs match\n"), done.stderr
    assert proxy.seen == [("CONNECT", url.removeprefix("https://"))] * 2
