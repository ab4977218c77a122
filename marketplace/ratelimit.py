"""Request counting in Redis for the customer and agent APIs: one round trip per request.

DRF's cache throttle reads and rewrites a list of timestamps through Django's cache: two round
trips, a list as long as the rate pickled both ways on every request, and a race between the
read and the write that lets concurrent requests past the rate. Here a counter per (scope,
ident, window) is INCRemented and given its expiry in one pipeline, atomically, which also reads
the previous window's counter. The count that decides is a sliding window's: this window's
requests plus the previous window's, weighted by the share of the previous window that the last
`period` seconds still cover. A fixed window alone let a client make twice its rate across a
window's edge; this one lets it past its rate only by what the weighting assumes (requests
spread evenly over the previous window). When Redis does not answer, requests are let through:
an outage of the limiter must not stop the API.
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
    now: float | None = None,
) -> float | None:
    """Count one request; None when it is allowed, else the seconds until one would be (if no
    other came). Without a client (Redis paused) or when Redis fails, the request is allowed.
    `now`: the time, for tests that cross a window's edge."""
    limit, period = parse_rate(rate)
    if client is None:
        return None
    now = time.time() if now is None else now
    window = int(now // period)
    key = f"gpumarket:rate:{scope}:{ident}:"
    try:
        pipe = client.pipeline(transaction=False)
        pipe.incr(f"{key}{window}")
        # Kept through the next window, which weighs it.
        pipe.expire(f"{key}{window}", 2 * period + 1)
        pipe.get(f"{key}{window - 1}")
        count, _, previous = pipe.execute()
    except redis.RedisError as exc:
        log.warning("rate limiter unavailable, request allowed: %s", exc)
        if on_error is not None:
            on_error(exc)
        return None
    previous = int(previous or 0)
    into = now - window * period  # seconds into this window
    # Requests are whole: the tolerance keeps rounding (a float of today's epoch seconds is
    # exact to about 2e-7 s) from refusing a request exactly at the rate.
    if previous * (1 - into / period) + count <= limit + 1e-6:
        return None
    # When the next request would pass if no other came: this one is counted, so the next makes
    # count + 1, and the previous window's weight falls to zero at this window's end...
    if count + 1 <= limit:
        return period * (1 - (limit - count - 1) / previous) - into
    # ...or not before the next window, where this window's count is weighed the same way.
    return (window + 1) * period - now + period * min(1.0, max(0.0, 1 - (limit - 1) / count))
