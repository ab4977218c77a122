"""Fixed-window request counting in Redis for the customer and agent APIs: one round trip per
request.

DRF's cache throttle reads and rewrites a list of timestamps through Django's cache: two round
trips, a list as long as the rate pickled both ways on every request, and a race between the
read and the write that lets concurrent requests past the rate. Here a counter per (scope,
ident, window) is INCRemented and given its expiry in one pipeline, atomically. A fixed window
lets a client make up to twice its rate across a window's edge, never more. When Redis does not
answer, requests are let through: an outage of the limiter must not stop the API.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import redis

log = logging.getLogger(__name__)

_PERIODS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_rate(rate: str) -> tuple[int, int]:
    """ "600/min" -> (600, 60): requests allowed per window of seconds."""
    count, _, period = rate.partition("/")
    if not count.isdigit() or not period or period[0] not in _PERIODS:
        raise ValueError(f"bad rate {rate!r}: write N/s, N/min, N/hour or N/day")
    return int(count), _PERIODS[period[0]]


def hit(
    client: redis.Redis | None,
    *,
    scope: str,
    ident: str,
    rate: str,
    on_error: Callable[[Exception], None] | None = None,
) -> float | None:
    """Count one request; None when it is allowed, else the seconds until the window ends.
    Without a client (Redis paused) or when Redis fails, the request is allowed."""
    limit, period = parse_rate(rate)
    if client is None:
        return None
    now = time.time()
    window = int(now // period)
    key = f"gpumarket:rate:{scope}:{ident}:{window}"
    try:
        pipe = client.pipeline(transaction=False)
        pipe.incr(key)
        pipe.expire(key, period + 1)
        count, _ = pipe.execute()
    except redis.RedisError as exc:
        log.warning("rate limiter unavailable, request allowed: %s", exc)
        if on_error is not None:
            on_error(exc)
        return None
    if count <= limit:
        return None
    return (window + 1) * period - now
