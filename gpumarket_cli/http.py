"""The CLI's HTTP client: a requests Session, so the environment applies as it does to every
other tool: HTTP_PROXY, HTTPS_PROXY, ALL_PROXY and NO_PROXY, a CA bundle in REQUESTS_CA_BUNDLE
(or CURL_CA_BUNDLE, else SSL_CERT_FILE or SSL_CERT_DIR, else the system's trust store).

One session per process keeps its connection alive between the calls of a command (`logs -f`,
`nodes`, `notify set`). Every request has a connect and a read timeout. What is sent again:
- a request whose connection could not be opened (nothing was sent), whatever its method;
- a request of a method that may repeat, after a dropped connection, a read timeout or a 5xx.

A POST is never sent again once it may have reached the server: it creates (a rental, a key, a
token, a booking) and the API takes no idempotency key, so a second one could be a second
rental. A PATCH may repeat: the CLI's PATCHes set fields to values (budgets, prices,
notification settings), and setting them twice leaves what setting them once does.
"""

from __future__ import annotations

import json as _json
import os
import ssl
from typing import Any

import requests
from requests.adapters import HTTPAdapter
from requests.auth import AuthBase
from urllib3.exceptions import MaxRetryError
from urllib3.util.retry import Retry

CONNECT_TIMEOUT_S = 10
READ_TIMEOUT_S = 30
RETRIES = 2  # after the first try
BACKOFF_S = 0.5  # urllib3 sends the first retry at once, then waits 1 s, 2 s, ...
REPEATABLE_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "PUT", "PATCH", "DELETE"})
RETRIED_STATUSES = frozenset(range(500, 600))


class TransportError(Exception):
    """No answer: the server could not be reached, or the connection failed or timed out
    (after the retries the request allowed)."""


class HttpError(Exception):
    """The server answered with an error status: a 4xx, or a 5xx once the retries are spent."""

    def __init__(self, status: int, text: str, body: Any) -> None:
        self.status = status
        self.text = text  # the answer's body as sent
        self.body = body  # the same, decoded, when it is JSON (else None)
        super().__init__(self.message)

    @property
    def message(self) -> str:
        """What a person reads: a 4xx with the server's answer (its JSON on one line, where it
        names the field at fault), a 5xx by its status alone."""
        if self.status >= 500:
            return f"server error {self.status}"
        text = self.text if self.body is None else _json.dumps(self.body)
        return f"{self.status}: {text}"


def _retry() -> Retry:
    return Retry(
        total=RETRIES,
        connect=RETRIES,
        read=RETRIES,
        status=RETRIES,
        other=0,  # a refused certificate is refused again
        allowed_methods=REPEATABLE_METHODS,
        status_forcelist=RETRIED_STATUSES,
        backoff_factor=BACKOFF_S,
        # A 429's or 503's Retry-After could make a call wait an hour: a 4xx is shown at once,
        # a 5xx waits the backoff.
        respect_retry_after_header=False,
        raise_on_status=False,  # the last 5xx is answered, and shown by its status
    )


def _session() -> requests.Session:
    session = requests.Session()
    adapter = HTTPAdapter(max_retries=_retry())
    session.mount("http://", adapter)
    session.mount("https://", adapter)
    # requests reads REQUESTS_CA_BUNDLE and CURL_CA_BUNDLE (they win over this); OpenSSL's own
    # variables name the CAs the rest of the system uses; without either, the system's trust
    # store (where a company's CA is installed), and certifi's bundle only on a system that has
    # none.
    ca = os.environ.get("SSL_CERT_FILE") or os.environ.get("SSL_CERT_DIR") or _system_cas()
    if ca:
        session.verify = ca
    return session


def _system_cas() -> str | None:
    paths = ssl.get_default_verify_paths()
    for path in (paths.cafile, paths.capath):
        if path and os.path.exists(path) and (os.path.isfile(path) or os.listdir(path)):
            return path
    return None


def _reason(exc: BaseException) -> str:
    """The innermost cause, which a person reads: `[Errno 111] Connection refused`, not
    requests' and urllib3's wrappers around it."""
    inner: BaseException = exc
    if inner.args and isinstance(inner.args[0], MaxRetryError) and inner.args[0].reason:
        inner = inner.args[0].reason
    while inner.__cause__ is not None or (inner.args and isinstance(inner.args[-1], Exception)):
        inner = inner.__cause__ if inner.__cause__ is not None else inner.args[-1]
    return str(inner) or type(inner).__name__


class _Bearer(AuthBase):
    """The API token. As the session's auth it also keeps requests from putting a ~/.netrc
    entry for the same host in its place."""

    def __init__(self, token: str) -> None:
        self.token = token

    def __call__(self, request: requests.PreparedRequest) -> requests.PreparedRequest:
        request.headers["Authorization"] = f"Bearer {self.token}"
        return request


class Client:
    """JSON requests to one server (`base`, a path prefix included)."""

    def __init__(self, base: str, *, token: str | None, headers: dict[str, str]) -> None:
        self.base = base.rstrip("/")
        self.session = _session()
        self.session.headers.update(headers)
        if token:
            self.session.auth = _Bearer(token)

    def request(
        self, method: str, path: str, *, params: dict | None = None, json: Any = None
    ) -> Any:
        """The decoded JSON answer (None when it is empty). Raises HttpError for an error
        status, TransportError when no answer came."""
        try:
            answer = self.session.request(
                method,
                self.base + path,
                params=params,
                json=json,
                timeout=(CONNECT_TIMEOUT_S, READ_TIMEOUT_S),
                allow_redirects=False,
            )
        except requests.RequestException as exc:
            raise TransportError(_reason(exc)) from exc
        content = answer.content
        if answer.status_code >= 400:
            text = content.decode(errors="replace")
            try:
                body = _json.loads(text)
            except ValueError:
                body = None
            raise HttpError(answer.status_code, text, body)
        return _json.loads(content) if content else None

    def close(self) -> None:
        self.session.close()
