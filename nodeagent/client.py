"""The agent's HTTPS client for the server's agent API (join, heartbeat, artifact sync).

One retry policy for every call: connection errors, timeouts, 429 and 5xx are transient and
retried a few times with bounded exponential backoff and jitter, then surface as
`TransientApiError` (the agent keeps spooling and tries again later). Two are not retried
within the call, since sending again at once is what turns an overloaded server into a
collapsed one: a 429/503 carrying `Retry-After` (`ServerBusyError`: the server said when to come
back) and a heartbeat that timed out (the server may still be applying it; the agent's next
round sends its newer state). 401/403 mean the token is invalid or revoked
(`AuthRejectedError`: the agent stops); any other 4xx is `RequestRejectedError` carrying the
server's message. Every request has a timeout.
"""

from __future__ import annotations

import contextlib
import logging
import math
import random
import time
from collections.abc import Callable
from typing import Any

import requests

from agentprotocol import (
    ARTIFACT_COMMIT_PATH,
    ARTIFACT_UPLOADS_PATH,
    HEARTBEAT_PATH,
    JOIN_PATH,
    RETRY_AFTER_MAX_S,
    HeartbeatRefusal,
    ProtocolError,
)

logger = logging.getLogger(__name__)

_CONNECT_TIMEOUT_S = 5.0


class AgentApiError(Exception):
    """The server did not accept a request."""


class TransientApiError(AgentApiError):
    """Unreachable, timed out, throttled or a 5xx: the same request may succeed later."""


class TimedOutError(TransientApiError):
    """No answer within the timeout: the server may still be working on the request."""


class ServerBusyError(TransientApiError):
    """A 429 or 503 with `Retry-After`: the server refused the request before doing any of it
    and says when to come back (`retry_after_s`, capped at RETRY_AFTER_MAX_S) and, for a
    heartbeat, how often to heartbeat from then on (`interval_s`; None: not said)."""

    def __init__(self, message: str, *, retry_after_s: float, interval_s: float | None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.interval_s = interval_s


class RequestRejectedError(AgentApiError):
    """A 4xx: the server refused the request as it is."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message


class AuthRejectedError(RequestRejectedError):
    """401/403: the node token (or join token) is invalid or was revoked."""


def backoff_delay(attempt: int, *, base_s: float, max_s: float) -> float:
    """Exponential backoff with "equal jitter": half fixed, half random, capped at max_s."""
    delay = min(max_s, base_s * 2**attempt)
    return delay / 2 + random.uniform(0, delay / 2)


def refusal_wait(retry_after: str | None, body: Any) -> tuple[float, float | None] | None:
    """What a refusal says from its `Retry-After` header and its decoded body: the seconds to
    wait (RETRY_AFTER_MAX_S at most) and, for a heartbeat, the interval to use from then on;
    None when the header is no delay in seconds (an HTTP date, or none). The body says the wait
    to the millisecond (a turn the server booked), the header in whole seconds; a body past the
    header's bound is not believed."""
    try:
        wait = float(retry_after or "")
    except ValueError:
        return None
    if not math.isfinite(wait) or wait < 0:
        return None
    interval = None
    with contextlib.suppress(ProtocolError):
        refusal = HeartbeatRefusal.from_payload(body)
        interval = refusal.heartbeat_interval_s
        if math.isfinite(refusal.retry_after_s) and 0 <= refusal.retry_after_s <= wait:
            wait = refusal.retry_after_s
    return min(wait, RETRY_AFTER_MAX_S), interval


def server_busy(response: requests.Response) -> ServerBusyError | None:
    """The refusal a 429/503 says it is when it carries `Retry-After` in seconds (an HTTP date,
    or none: an ordinary transient error, retried with backoff)."""
    try:
        body = response.json()
    except ValueError:
        body = None
    said = refusal_wait(response.headers.get("Retry-After"), body)
    if said is None:
        return None
    return ServerBusyError(
        f"HTTP {response.status_code}: {error_message(response)}",
        retry_after_s=said[0],
        interval_s=said[1],
    )


def error_message(response: requests.Response) -> str:
    """The server's explanation: DRF's "detail", else its field errors, else the raw body."""
    try:
        body = response.json()
    except ValueError:
        return response.text.strip()[:500] or response.reason
    if isinstance(body, dict):
        if "detail" in body:
            return str(body["detail"])
        return "; ".join(f"{field}: {errors}" for field, errors in body.items())
    return str(body)[:500]


def server_session(server_url: str) -> requests.Session:
    """A session for requests to the server at `server_url`, with what the environment says of
    it (HTTPS_PROXY / NO_PROXY, REQUESTS_CA_BUNDLE for a private CA) read once: requests
    otherwise reads os.environ on every request (a fifth of an agent's CPU per heartbeat in
    bench/launch.py's fleet). TLS verification stays on; no .netrc credential is added."""
    session = requests.Session()
    found = session.merge_environment_settings(server_url, {}, None, None, None)
    session.trust_env = False
    session.proxies = found["proxies"]
    session.verify = found["verify"]
    session.cert = found["cert"]
    return session


class AgentApiClient:
    """Talks to one server; safe to use from one thread at a time."""

    def __init__(
        self,
        server_url: str,
        *,
        timeout_s: float = 10.0,
        attempts: int = 3,
        backoff_base_s: float = 0.5,
        backoff_max_s: float = 8.0,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if not server_url.startswith(("http://", "https://")):
            raise ValueError(f"server URL must start with http:// or https://, not {server_url!r}")
        if attempts < 1:
            raise ValueError("attempts must be at least 1")
        self.server_url = server_url.rstrip("/")
        self.timeout_s = timeout_s
        self.attempts = attempts
        self.backoff_base_s = backoff_base_s
        self.backoff_max_s = backoff_max_s
        self._sleep = sleep
        self._session = server_session(self.server_url)

    def join(self, payload: dict[str, Any]) -> dict[str, Any]:
        """POST the join payload; the answer holds node_id, node_token, heartbeat_interval_s."""
        return self._post(JOIN_PATH, payload, token=None)

    def heartbeat(self, payload: dict[str, Any], *, token: str) -> dict[str, Any]:
        """POST one heartbeat; the answer holds the desired state. Not resent after a timeout
        (TimedOutError): the next round carries the newer state."""
        return self._post(HEARTBEAT_PATH, payload, token=token, once_on=(TimedOutError,))

    def artifact_uploads(
        self, rental_id: str, payload: dict[str, Any], *, token: str
    ) -> dict[str, Any]:
        """POST an ArtifactUploadRequest; the answer holds the presigned uploads."""
        return self._post(ARTIFACT_UPLOADS_PATH.format(rental_id=rental_id), payload, token=token)

    def artifact_commit(
        self, rental_id: str, payload: dict[str, Any], *, token: str
    ) -> dict[str, Any]:
        """POST an ArtifactCommit; the answer says what was stored and what refused."""
        return self._post(ARTIFACT_COMMIT_PATH.format(rental_id=rental_id), payload, token=token)

    def close(self) -> None:
        self._session.close()

    def _post(
        self,
        path: str,
        payload: dict[str, Any],
        *,
        token: str | None,
        once_on: tuple[type[TransientApiError], ...] = (),
    ) -> dict[str, Any]:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        url = self.server_url + path
        for attempt in range(self.attempts):
            try:
                return self._post_once(url, payload, headers)
            except TransientApiError as exc:
                if attempt == self.attempts - 1 or isinstance(exc, (ServerBusyError, *once_on)):
                    raise
                delay = backoff_delay(attempt, base_s=self.backoff_base_s, max_s=self.backoff_max_s)
                logger.warning(
                    "server request failed, retrying",
                    extra={"path": path, "error": str(exc), "retry_in_s": round(delay, 2)},
                )
                self._sleep(delay)
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _post_once(self, url: str, payload: dict[str, Any], headers: dict[str, str]) -> dict:
        try:
            response = self._session.post(
                url, json=payload, headers=headers, timeout=(_CONNECT_TIMEOUT_S, self.timeout_s)
            )
        except requests.Timeout as exc:
            raise TimedOutError(f"timed out after {self.timeout_s}s: {exc}") from exc
        except requests.RequestException as exc:
            raise TransientApiError(f"unreachable: {exc}") from exc
        status = response.status_code
        if status in (401, 403):
            raise AuthRejectedError(status, error_message(response))
        if status in (429, 503) and (busy := server_busy(response)) is not None:
            # Come back on a new connection: a kept one goes back to the web process that
            # refused, and a fleet that connected at one instant can sit on one process of
            # several while the others idle (seen at 222 heartbeats against 16). A new
            # connection goes to whichever process accepts it first, usually an idle one.
            self._session.close()
            raise busy
        if status == 429 or status >= 500:
            raise TransientApiError(f"HTTP {status}: {error_message(response)}")
        if status >= 400:
            raise RequestRejectedError(status, error_message(response))
        try:
            body = response.json()
        except ValueError as exc:
            # A proxy's HTML page in front of a restarting server, typically.
            raise TransientApiError(f"HTTP {status} without a JSON body") from exc
        if not isinstance(body, dict):
            raise TransientApiError(f"HTTP {status} with a JSON {type(body).__name__}, not object")
        return body
