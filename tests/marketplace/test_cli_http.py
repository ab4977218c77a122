"""The CLI's HTTP client against a real socket server that answers in each way HTTP/1.1 allows.

(The CLI's tests against the live Django server cover the answers the API gives; these cover the
framings a proxy in front of it may choose: chunked, no length, Connection: close, 100 Continue.)
"""

import socket
import ssl
import subprocess
import threading

import pytest

from marketplace.cli import Api, CliError
from marketplace.cli_http import Connection, HttpError


class OneShotServer:
    """Accepts connections; each request gets the next canned answer (bytes), then the
    connection is kept or closed as the answer's entry says. Records what it received."""

    def __init__(
        self, answers: list[tuple[bytes, bool]], tls: ssl.SSLContext | None = None
    ) -> None:
        self.answers = list(answers)
        self.tls = tls
        self.received: list[bytes] = []
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while self.answers:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed
                return
            if self.tls is not None:
                try:
                    conn = self.tls.wrap_socket(conn, server_side=True)
                except OSError as exc:  # the client refused the handshake
                    self.received.append(repr(exc).encode())
                    conn.close()
                    continue
            with conn:
                while self.answers:
                    request = self._read_request(conn)
                    if request is None:
                        break
                    self.received.append(request)
                    answer, keep = self.answers.pop(0)
                    conn.sendall(answer)
                    if not keep:
                        break

    @staticmethod
    def _read_request(conn: socket.socket) -> bytes | None:
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = conn.recv(65536)
            if not chunk:
                return None
            data += chunk
        head, _, rest = data.partition(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        while len(rest) < length:
            rest += conn.recv(65536)
        return head + b"\r\n\r\n" + rest

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def serve():
    servers: list[OneShotServer] = []

    def start(*answers: tuple[bytes, bool], tls: ssl.SSLContext | None = None) -> OneShotServer:
        server = OneShotServer(list(answers), tls)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.close()


def _connection(server: OneShotServer) -> Connection:
    return Connection("127.0.0.1", server.port, https=False, timeout=5)


def test_lengths_chunks_and_interim_answers_are_read_on_one_kept_connection(serve):
    server = serve(
        (b'HTTP/1.1 200 OK\r\nContent-Length: 7\r\n\r\n{"a":1}', True),
        (
            b"HTTP/1.1 201 Created\r\nTransfer-Encoding: chunked\r\n\r\n"
            b'4;ext=1\r\n{"b"\r\n3\r\n:2}\r\n0\r\nX-Trailer: t\r\n\r\n',
            True,
        ),
        (b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 204 No Content\r\n\r\n", True),
    )
    conn = _connection(server)
    assert conn.request("GET", "/a", headers={}) == (200, b'{"a":1}')
    assert conn.request("POST", "/b", headers={}, body=b"{}") == (201, b'{"b":2}')
    assert conn.request("DELETE", "/c", headers={"X-Y": "z"}) == (204, b"")
    conn.close()
    assert len(server.received) == 3  # one connection carried all three
    post = server.received[1]
    assert post.startswith(b"POST /b HTTP/1.1\r\n")
    assert f"Host: 127.0.0.1:{server.port}".encode() in post
    assert post.endswith(b"Content-Length: 2\r\n\r\n{}")


def test_a_body_without_a_length_ends_with_the_connection_and_the_next_call_reconnects(serve):
    server = serve(
        (b"HTTP/1.0 200 OK\r\n\r\nall of it", False),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok", False),
        (b"HTTP/1.0 200 OK\r\nContent-Length: 3\r\n\r\n1.0", False),  # 1.0 closes by default
        (b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nmore", True),
    )
    conn = _connection(server)
    assert conn.request("GET", "/", headers={}) == (200, b"all of it")
    assert conn.request("GET", "/", headers={}) == (200, b"ok")
    assert conn.request("GET", "/", headers={}) == (200, b"1.0")
    assert conn.request("GET", "/", headers={}) == (200, b"more")


@pytest.mark.parametrize(
    "answer",
    [
        b"",  # closed without a word
        b"SSH-2.0-OpenSSH_9.2\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort",
        b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
        b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n",
        b"HTTP/1.1 200 OK\r\n" + b"X: " + b"a" * 70000 + b"\r\n\r\n",
        b"HTTP/1.1 200 OK\r\n" + b"X: a\r\n" * 101 + b"\r\n",
    ],
)
def test_what_is_not_an_http_answer_is_an_error_and_the_connection_is_dropped(serve, answer):
    server = serve((answer, False))
    conn = _connection(server)
    with pytest.raises(HttpError):
        conn.request("GET", "/", headers={})
    assert conn._sock is None


def test_the_cli_retries_a_get_the_server_dropped_and_sends_a_post_once(serve):
    ok = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}"
    server = serve((b"", False), (ok, True))
    api = Api(f"http://127.0.0.1:{server.port}", "tok")
    assert api.call("GET", "/x/") == {}
    assert [r.split(b"\r\n")[0] for r in server.received] == [b"GET /x/ HTTP/1.1"] * 2
    assert b"Authorization: Bearer tok" in server.received[1]

    server = serve((b"", False), (ok, True))
    api = Api(f"http://127.0.0.1:{server.port}/base", None)
    with pytest.raises(CliError, match="cannot reach"):
        api.call("POST", "/y/", json={"a": 1})
    assert len(server.received) == 1 and server.received[0].startswith(b"POST /base/y/ HTTP/1.1")


@pytest.mark.parametrize("url", ["ftp://host", "http://", "http://host:port", "host:80"])
def test_a_server_that_is_not_an_http_url_is_refused(url):
    with pytest.raises(CliError):
        Api(url, None)


@pytest.fixture
def certificate(tmp_path, monkeypatch):
    """A self-signed certificate for 127.0.0.1 (openssl), trusted through SSL_CERT_FILE: the
    client verifies it with the default context, as it verifies a real server's."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(cert, key)
    return tls


def test_https_verifies_the_servers_certificate_and_name(serve, certificate):
    ok = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}"
    server = serve((ok, True), tls=certificate)
    assert Api(f"https://127.0.0.1:{server.port}", "tok").call("GET", "/x/") == {}
    assert server.received[0].startswith(b"GET /x/ HTTP/1.1")

    # The same certificate under another name (localhost) is refused before anything is sent.
    server = serve((ok, True), tls=certificate)
    with pytest.raises(CliError, match="cannot reach"):
        Api(f"https://localhost:{server.port}", "tok").call("GET", "/x/")
    assert not any(r.startswith(b"GET") for r in server.received)
