"""The process's own Redis clients (beside Django's cache), behind one small object that tests
can replace.

Two clients with different contracts:
- `background`: for periodic work (the telemetry flush); ordinary timeouts with a retry.
- `hot`: for the request path (the API's and the agents' rate limits, the telemetry buffer),
  which must never be held up by Redis: short timeouts, no retry, and after a failure Redis is
  left alone for a few seconds, so a hung Redis costs a request at most one short timeout, then
  nothing.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator

import redis
from django.conf import settings
from redis.backoff import NoBackoff
from redis.retry import Retry

log = logging.getLogger(__name__)

HOT_TIMEOUT_S = 0.1
HOT_PAUSE_S = 5.0


class RedisClients:
    """Lazily built clients for one Redis URL; thread-safe (redis-py pools are)."""

    def __init__(
        self, url: str, *, hot_timeout_s: float = HOT_TIMEOUT_S, hot_pause_s: float = HOT_PAUSE_S
    ) -> None:
        self.url = url
        self.hot_timeout_s = hot_timeout_s
        self.hot_pause_s = hot_pause_s
        self._background: redis.Redis | None = None
        self._hot: redis.Redis | None = None
        self._paused_until = 0.0
        self._lock = threading.Lock()

    def background(self) -> redis.Redis:
        with self._lock:
            if self._background is None:
                self._background = redis.Redis.from_url(
                    self.url, socket_timeout=2, socket_connect_timeout=2, retry_on_timeout=True
                )
            return self._background

    def hot(self) -> redis.Redis | None:
        """The request path's client, or None while Redis is left alone after a failure."""
        if time.monotonic() < self._paused_until:
            return None
        with self._lock:
            if self._hot is None:
                self._hot = redis.Redis.from_url(
                    self.url,
                    socket_timeout=self.hot_timeout_s,
                    socket_connect_timeout=self.hot_timeout_s,
                    retry=Retry(NoBackoff(), 0),
                )
            return self._hot

    def hot_failed(self, exc: Exception) -> None:
        """Note a failure on the request path: Redis is left alone for `hot_pause_s`."""
        self._paused_until = time.monotonic() + self.hot_pause_s
        log.warning(
            "Redis failed on the request path, left alone for %.0f s: %s", self.hot_pause_s, exc
        )


_current: RedisClients | None = None


def redis_clients() -> RedisClients:
    """The process's clients, for settings.REDIS_URL."""
    global _current
    if _current is None:
        _current = RedisClients(settings.REDIS_URL)
    return _current


@contextlib.contextmanager
def redis_clients_replaced(clients: RedisClients) -> Iterator[RedisClients]:
    """Use `clients` for the duration (tests: a hung or stopped Redis)."""
    global _current
    saved, _current = _current, clients
    try:
        yield clients
    finally:
        _current = saved
