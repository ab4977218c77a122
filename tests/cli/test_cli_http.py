"""The CLI's HTTP client (gpumarket_cli.http, on requests) against a real local server that
answers each request as the test says: kept-alive connections, timeouts, what is sent again
and what never is, and how an answer becomes an error a person reads.

(The CLI's tests against the live Django server cover the answers the API gives; these cover
what a proxy or a struggling server in front of it may do.)
"""

from __future__ import annotations

import socket
import ssl
import subprocess
import threading
import time
from dataclasses import dataclass

import pytest

from gpumarket_cli import http
from gpumarket_cli.api import Api, CliError
from gpumarket_cli.http import Client, HttpError

OK = b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 7\r\n\r\n{"a":1}'
DROP = b""  # close the connection without a word


@dataclass
class Answer:
    data: bytes
    keep: bool = True  # keep the connection open for the next request
    delay_s: float = 0.0  # before answering


@dataclass
class Received:
    connection: int  # the number of the connection it came on, from 0
    data: bytes

    @property
    def line(self) -> bytes:
        return self.data.split(b"\r\n", 1)[0]


class ScriptedServer:
    """A thread per connection; each request, on whichever connection, gets the next answer of
    the script. Records every request with the connection it came on."""

    def __init__(self, answers: list[Answer], tls: ssl.SSLContext | None = None) -> None:
        self.answers = list(answers)
        self.tls = tls
        self.received: list[Received] = []
        self.refused: list[str] = []  # TLS handshakes the client broke off
        self.connections = 0
        self.lock = threading.Lock()
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed
                return
            with self.lock:
                number = self.connections
                self.connections += 1
            threading.Thread(target=self._serve, args=(conn, number), daemon=True).start()

    def _serve(self, conn: socket.socket, number: int) -> None:
        if self.tls is not None:
            try:
                conn = self.tls.wrap_socket(conn, server_side=True)
            except OSError as exc:
                self.refused.append(repr(exc))
                conn.close()
                return
        with conn:
            while True:
                request = self._read_request(conn)
                if request is None:
                    return
                with self.lock:
                    self.received.append(Received(number, request))
                    answer = self.answers.pop(0) if self.answers else Answer(DROP, keep=False)
                time.sleep(answer.delay_s)
                try:
                    conn.sendall(answer.data)
                except OSError:  # the client gave up waiting
                    return
                if not answer.keep or not answer.data:
                    return

    @staticmethod
    def _read_request(conn: socket.socket) -> bytes | None:
        data = b""
        try:
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
        except OSError:
            return None
        return head + b"\r\n\r\n" + rest

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def serve():
    servers: list[ScriptedServer] = []

    def start(*answers: Answer, tls: ssl.SSLContext | None = None) -> ScriptedServer:
        server = ScriptedServer(list(answers), tls)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.close()


@pytest.fixture(autouse=True)
def _no_proxy_from_the_environment(monkeypatch):
    """The client trusts the environment: a proxy set where the tests run would stand between
    it and these servers."""
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy",
                 "all_proxy", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "SSL_CERT_FILE",
                 "SSL_CERT_DIR"):  # fmt: skip
        monkeypatch.delenv(name, raising=False)


def _url(server: ScriptedServer, scheme: str = "http") -> str:
    return f"{scheme}://127.0.0.1:{server.port}"


def test_calls_share_one_kept_alive_connection_and_carry_the_token(serve):
    # Given a server that keeps each connection open
    server = serve(Answer(OK), Answer(OK), Answer(b"HTTP/1.1 204 No Content\r\n\r\n"))
    api = Api(_url(server) + "/base", "tok")

    # When three calls are made
    assert api.call("GET", "/a/", params={"limit": 5, "after": 7}) == {"a": 1}
    assert api.call("POST", "/b/", json={"x": [1, 2]}) == {"a": 1}
    assert api.call("DELETE", "/c/") is None

    # Then they went over one connection, under the server's path prefix, with the token
    assert [r.connection for r in server.received] == [0, 0, 0]
    assert [r.line for r in server.received] == [
        b"GET /base/a/?limit=5&after=7 HTTP/1.1",
        b"POST /base/b/ HTTP/1.1",
        b"DELETE /base/c/ HTTP/1.1",
    ]
    get, post, _ = (r.data for r in server.received)
    assert b"\r\nAuthorization: Bearer tok\r\n" in get
    assert b"\r\nUser-Agent: gpumarket-cli\r\n" in get
    assert b"\r\nAccept: application/json\r\n" in get
    assert b"\r\nContent-Type: application/json\r\n" in post
    assert post.endswith(b'\r\n\r\n{"x": [1, 2]}')


@pytest.mark.parametrize(
    "answer",
    [
        b'HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n4\r\n{"a"\r\n3\r\n:1}\r\n0\r\n\r\n',
        b'HTTP/1.0 200 OK\r\n\r\n{"a":1}',  # no length: the body ends with the connection
        b'HTTP/1.1 200 OK\r\nContent-Length: 7\r\nConnection: close\r\n\r\n{"a":1}',
        b'HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 7\r\n\r\n{"a":1}',
    ],
    ids=["chunked", "no-length", "connection-close", "interim-answer"],
)
def test_each_framing_a_proxy_may_choose_is_read_and_a_closed_connection_is_reopened(serve, answer):
    server = serve(Answer(answer, keep=False), Answer(OK))
    client = Client(_url(server), token=None, headers={})
    assert client.request("GET", "/x/") == {"a": 1}
    assert client.request("GET", "/y/") == {"a": 1}
    assert [r.connection for r in server.received] == [0, 1]


def test_a_get_the_server_dropped_is_sent_again_on_a_new_connection(serve):
    server = serve(Answer(DROP), Answer(OK))
    assert Api(_url(server), "tok").call("GET", "/x/") == {"a": 1}
    assert [(r.connection, r.line) for r in server.received] == [
        (0, b"GET /x/ HTTP/1.1"),
        (1, b"GET /x/ HTTP/1.1"),
    ]


def test_a_post_that_reached_the_server_is_never_sent_again(serve):
    # Given a server that reads a POST and drops the connection without answering
    server = serve(Answer(DROP), Answer(OK))

    # When the CLI sends it, then it fails naming what happened
    with pytest.raises(CliError, match=r"cannot reach .*: Remote end closed connection"):
        Api(_url(server), "tok").call("POST", "/rentals/", json={"gpus_per_node": 1})

    # And the server saw it once: a second one could have been a second rental
    assert [r.line for r in server.received] == [b"POST /rentals/ HTTP/1.1"]


def test_a_get_past_its_read_timeout_is_sent_again_and_a_post_is_not(serve, monkeypatch):
    monkeypatch.setattr(http, "READ_TIMEOUT_S", 0.3)
    # Given a server whose first answer comes late
    server = serve(Answer(OK, delay_s=1.0), Answer(OK))
    t0 = time.monotonic()
    assert Api(_url(server), None).call("GET", "/x/") == {"a": 1}
    assert time.monotonic() - t0 < 0.9  # the second try did not wait for the first answer
    assert [r.connection for r in server.received] == [0, 1]

    server = serve(Answer(OK, delay_s=1.0), Answer(OK))
    with pytest.raises(CliError, match=r"cannot reach .*: timed out"):
        Api(_url(server), None).call("POST", "/rentals/", json={})
    time.sleep(1.2)  # past the late answer: nothing more arrived
    assert [r.line for r in server.received] == [b"POST /rentals/ HTTP/1.1"]


def test_a_get_that_keeps_timing_out_gives_up_after_three_tries(serve, monkeypatch):
    monkeypatch.setattr(http, "READ_TIMEOUT_S", 0.2)
    server = serve(*[Answer(OK, delay_s=0.6)] * 4)
    with pytest.raises(CliError, match="timed out"):
        Api(_url(server), None).call("GET", "/x/")
    assert len(server.received) == 3


def test_a_server_that_refuses_connections_is_tried_three_times_then_named(monkeypatch):
    # A refused connection carried nothing, so even a POST is tried again (after 0 s and 1 s).
    with socket.create_server(("127.0.0.1", 0)) as sock:
        port = sock.getsockname()[1]  # closed on leaving: nothing listens there now
    t0 = time.monotonic()
    with pytest.raises(CliError, match=r"cannot reach http://127.0.0.1:\d+: .*Connection refused"):
        Api(f"http://127.0.0.1:{port}", None).call("POST", "/rentals/", json={})
    assert time.monotonic() - t0 >= 0.9


def test_a_5xx_is_retried_for_a_get_and_shown_by_its_status_for_a_post(serve):
    error = b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 4\r\n\r\nbusy"
    server = serve(Answer(error), Answer(error), Answer(OK))
    assert Api(_url(server), None).call("GET", "/x/") == {"a": 1}
    assert len(server.received) == 3

    server = serve(Answer(b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 0\r\n\r\n"))
    with pytest.raises(CliError) as failed:
        Api(_url(server), None).call("POST", "/rentals/", json={})
    assert str(failed.value) == "server error 500"
    assert isinstance(failed.value.__cause__, HttpError) and failed.value.__cause__.status == 500
    assert len(server.received) == 1

    server = serve(*[Answer(error)] * 4)
    with pytest.raises(CliError, match=r"^server error 503$"):
        Api(_url(server), None).call("GET", "/x/")
    assert len(server.received) == 3


def test_a_4xx_is_shown_at_once_with_the_servers_answer(serve):
    body = b'{"gpus_per_node":["Ensure this value is greater than or equal to 1."]}'
    invalid = b"HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\n"
    invalid += b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    throttled = (
        b"HTTP/1.1 429 Too Many Requests\r\nRetry-After: 3600\r\nContent-Length: 4\r\n\r\nslow"
    )
    server = serve(Answer(invalid), Answer(throttled), Answer(OK))
    client = Client(_url(server), token="tok", headers={})

    with pytest.raises(HttpError) as failed:
        client.request("POST", "/rentals/", json={"gpus_per_node": 0})
    error = failed.value
    assert (error.status, error.text) == (400, body.decode())
    assert error.body == {"gpus_per_node": ["Ensure this value is greater than or equal to 1."]}
    assert error.message == (
        '400: {"gpus_per_node": ["Ensure this value is greater than or equal to 1."]}'
    )

    # A throttled GET is not retried, Retry-After or not: the person reads why at once
    t0 = time.monotonic()
    with pytest.raises(HttpError) as failed:
        client.request("GET", "/x/")
    assert (failed.value.status, failed.value.body, failed.value.message) == (
        429, None, "429: slow",
    )  # fmt: skip
    assert time.monotonic() - t0 < 5
    assert len(server.received) == 2


def test_the_token_wins_over_a_netrc_entry_for_the_same_host(serve, tmp_path, monkeypatch):
    netrc = tmp_path / "netrc"
    netrc.write_text("machine 127.0.0.1 login someone password secret\n")
    netrc.chmod(0o600)
    monkeypatch.setenv("NETRC", str(netrc))
    server = serve(Answer(OK))
    Api(_url(server), "tok").call("GET", "/x/")
    assert b"\r\nAuthorization: Bearer tok\r\n" in server.received[0].data


@pytest.mark.parametrize("url", ["ftp://host", "http://", "http://host:port", "host:80"])
def test_a_server_that_is_not_an_http_url_is_refused(url):
    with pytest.raises(CliError):
        Api(url, None)


@pytest.fixture
def certificate(tmp_path):
    """A self-signed certificate for 127.0.0.1 (openssl): (its file, a server context)."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(cert, key)
    return str(cert), tls


@pytest.mark.parametrize("variable", ["SSL_CERT_FILE", "REQUESTS_CA_BUNDLE"])
def test_https_trusts_the_ca_the_environment_names_and_checks_the_name(
    serve, certificate, monkeypatch, variable
):
    cert, tls = certificate
    server = serve(Answer(OK), tls=tls)
    # Not trusted before it is named
    with pytest.raises(CliError, match=r"cannot reach .*CERTIFICATE_VERIFY_FAILED"):
        Api(_url(server, "https"), "tok").call("GET", "/x/")
    assert server.received == []

    monkeypatch.setenv(variable, cert)
    assert Api(_url(server, "https"), "tok").call("GET", "/x/") == {"a": 1}
    assert server.received[0].line == b"GET /x/ HTTP/1.1"

    # The same certificate under another name (localhost) is refused before anything is sent.
    server = serve(Answer(OK), tls=tls)
    with pytest.raises(CliError, match="cannot reach"):
        Api(f"https://localhost:{server.port}", "tok").call("GET", "/x/")
    assert server.received == []
