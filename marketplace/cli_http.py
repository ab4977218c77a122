"""The CLI's HTTP/1.1 client: one kept-alive connection, JSON bodies, nothing more.

The standard library's `http.client` parses headers with the `email` package and imports `ssl`
for plain HTTP too: 35 ms of a 115 ms `gpumarket rent` on a 2-core machine, more than the
server's work. This reads the answers the API gives (a status line, headers, then a body of
`Content-Length` bytes, chunked, or up to the close) and imports `ssl` only for https.
The file commands (datasets, artifacts) stream with requests instead (cli_transfer).
"""

from __future__ import annotations

import socket

MAX_LINE = 65536  # a status or header line longer than this is not an answer of the API
MAX_HEADERS = 100


class HttpError(Exception):
    """The server's answer could not be read as HTTP/1.x (or it closed the connection)."""


class Connection:
    def __init__(self, host: str, port: int | None, *, https: bool, timeout: float) -> None:
        self.host = host
        self.port = port or (443 if https else 80)
        self.https = https
        self.timeout = timeout
        self._sock: socket.socket | None = None
        self._file = None

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._sock is not None:
            self._sock.close()
        self._sock = self._file = None

    def _connect(self) -> None:
        # An ASCII name goes to the resolver as bytes: as text it is IDNA-encoded first, which
        # imports the codec and unicodedata for nothing.
        host = self.host.encode() if self.host.isascii() else self.host
        sock = socket.create_connection((host, self.port), timeout=self.timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self.https:
            import ssl

            try:
                sock = ssl.create_default_context().wrap_socket(sock, server_hostname=self.host)
            except BaseException:
                sock.close()
                raise
        self._sock = sock
        self._file = sock.makefile("rb")

    def request(
        self, method: str, target: str, *, headers: dict[str, str], body: bytes | None = None
    ) -> tuple[int, bytes]:
        """Send one request and read its whole answer: (status, body). Raises OSError (which
        covers timeouts) or HttpError; the connection is closed then, and opened again by the
        next request."""
        if self._sock is None:
            self._connect()
        host = f"[{self.host}]" if ":" in self.host else self.host  # an IPv6 address
        if self.port != (443 if self.https else 80):
            host = f"{host}:{self.port}"
        lines = [f"{method} {target} HTTP/1.1", f"Host: {host}"]
        lines += [f"{name}: {value}" for name, value in headers.items()]
        if body is not None or method in ("POST", "PUT", "PATCH"):
            lines.append(f"Content-Length: {len(body or b'')}")
        head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        try:
            self._sock.sendall(head + (body or b""))  # type: ignore[union-attr]
            version, status, answer_headers = self._read_head()
            content = b"" if method == "HEAD" else self._read_body(status, answer_headers)
        except BaseException:
            self.close()
            raise
        connection = answer_headers.get("connection", "").lower()
        if connection == "close" or (version == "HTTP/1.0" and connection != "keep-alive"):
            self.close()  # the server ends the connection after this answer
        return status, content

    def _line(self) -> bytes:
        line = self._file.readline(MAX_LINE + 1)  # type: ignore[union-attr]
        if len(line) > MAX_LINE:
            raise HttpError("an answer line is too long")
        return line

    def _read_head(self) -> tuple[str, int, dict[str, str]]:
        while True:
            line = self._line()
            if not line:
                raise HttpError("the server closed the connection without an answer")
            parts = line.decode("latin-1").split(None, 2)
            if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
                raise HttpError(f"not an HTTP answer: {line[:80]!r}")
            status = int(parts[1])
            headers: dict[str, str] = {}
            for _ in range(MAX_HEADERS + 1):
                field = self._line()
                if field in (b"\r\n", b"\n", b""):
                    break
                name, sep, value = field.decode("latin-1").partition(":")
                if not sep:
                    raise HttpError(f"not a header: {field[:80]!r}")
                headers[name.strip().lower()] = value.strip()
            else:
                raise HttpError("too many headers")
            if not 100 <= status < 200:  # an interim answer (100 Continue) is followed by one
                return parts[0], status, headers

    def _read_body(self, status: int, headers: dict[str, str]) -> bytes:
        if status in (204, 304):
            return b""
        if "chunked" in headers.get("transfer-encoding", "").lower():
            return self._read_chunked()
        length = headers.get("content-length")
        if length is not None:
            if not length.isdigit():
                raise HttpError(f"bad Content-Length {length!r}")
            return self._exactly(int(length))
        content = self._file.read()  # type: ignore[union-attr]
        self.close()  # a body without a length ends with the connection
        return content

    def _read_chunked(self) -> bytes:
        chunks = []
        while True:
            size_line = self._line().split(b";", 1)[0].strip()
            try:
                size = int(size_line, 16)
            except ValueError:
                raise HttpError(f"bad chunk size {size_line[:20]!r}") from None
            if size == 0:
                while self._line() not in (b"\r\n", b"\n", b""):  # trailers
                    pass
                return b"".join(chunks)
            chunks.append(self._exactly(size))
            self._exactly(2)  # the CRLF after the chunk

    def _exactly(self, n: int) -> bytes:
        data = self._file.read(n)  # type: ignore[union-attr]
        if len(data) != n:
            raise HttpError(f"the answer ended after {len(data)} of {n} bytes")
        return data
