"""Hearing of work at once: a thread that long-polls the server's wake channel.

The heartbeat answer names a wake URL and a signed ticket (agentprotocol.WakeChannel); this
thread holds a GET there and, when it is answered "woken", calls `on_wake` (the agent's loop
then heartbeats at once instead of at the end of its interval). It is only a hint: the agent
reconciles on its own schedule whatever happens here, and without a wake channel, or with the
wake server down, it behaves as it did before there was one.

After a wake-up the thread waits for the ticket of the heartbeat that followed before it polls
again (the old ticket would be answered "woken" at once, for the same change); a refused ticket
(4xx) waits for a fresh one the same way. Unreachable, 429 and 5xx back off (bounded exponential
with jitter). Every request has a timeout.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from urllib.parse import urljoin

import requests

from agentprotocol import WakeChannel
from nodeagent.client import backoff_delay, server_session

logger = logging.getLogger(__name__)

POLL_S = 25.0
# Beyond the poll: the server answers at `timeout`; this covers its and the network's delay.
READ_MARGIN_S = 10.0
CONNECT_TIMEOUT_S = 5.0
# A fresh ticket is waited for this long after a wake-up before the old one is tried again
# (the heartbeat that would bring it failed: the next round's will).
FRESH_TICKET_WAIT_S = 30.0
BACKOFF_BASE_S, BACKOFF_MAX_S = 1.0, 60.0


class WakeListener:
    """One node's long-poll; `offer()` each heartbeat answer's channel, `close()` at the end."""

    def __init__(
        self, *, server_url: str, on_wake: Callable[[], None], poll_s: float = POLL_S
    ) -> None:
        self._server_url = server_url.rstrip("/") + "/"
        self._on_wake = on_wake
        self._poll_s = poll_s
        self._lock = threading.Lock()
        self._channel: WakeChannel | None = None
        self._fresh = threading.Event()  # a new channel was offered
        self._closed = threading.Event()
        self._session = server_session(self._server_url)
        self._thread = threading.Thread(target=self._run, name="wake", daemon=True)
        self.wakeups = 0

    def start(self) -> None:
        self._thread.start()

    def offer(self, channel: WakeChannel | None) -> None:
        """The latest heartbeat answer's channel (None: the server has no wake server)."""
        with self._lock:
            if channel == self._channel:
                return
            self._channel = channel
        self._fresh.set()

    def close(self) -> None:
        self._closed.set()
        self._fresh.set()
        # Closing the session ends a poll in progress (its socket is shut down).
        self._session.close()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=0.5)

    def _run(self) -> None:
        failures = 0
        while not self._closed.is_set():
            with self._lock:
                channel = self._channel
                self._fresh.clear()
            if channel is None:
                self._fresh.wait()
                continue
            outcome = self._poll(channel)
            if self._closed.is_set():
                return
            if outcome == "woken":
                failures = 0
                self.wakeups += 1
                self._on_wake()
                self._fresh.wait(FRESH_TICKET_WAIT_S)
            elif outcome == "idle":
                failures = 0
            elif outcome == "refused":
                self._fresh.wait()
            else:
                delay = backoff_delay(failures, base_s=BACKOFF_BASE_S, max_s=BACKOFF_MAX_S)
                failures += 1
                logger.debug("wake poll failed, retrying", extra={"retry_in_s": round(delay, 1)})
                self._closed.wait(delay)

    def _poll(self, channel: WakeChannel) -> str:
        """ "woken", "idle" (timed out), "refused" (4xx: wait for a new ticket) or "failed"."""
        url = urljoin(self._server_url, channel.url)
        if not url.startswith(("http://", "https://")):
            return "refused"
        try:
            response = self._session.get(
                url,
                params={"timeout": self._poll_s},
                headers={"Authorization": f"Bearer {channel.ticket}"},
                timeout=(CONNECT_TIMEOUT_S, self._poll_s + READ_MARGIN_S),
            )
        except (requests.RequestException, OSError):
            return "failed"
        status = response.status_code
        if status == 429 or status >= 500:
            return "failed"
        if status >= 400:
            logger.warning("wake ticket refused", extra={"status": status})
            return "refused"
        try:
            woken = response.json().get("woken")
        except (ValueError, AttributeError):
            return "failed"
        return "woken" if woken is True else "idle"
