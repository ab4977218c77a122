"""Request counting in Redis for the customer and agent APIs: one round trip per request.

DRF's cache throttle reads and rewrites a list of timestamps through Django's cache: two round
trips, a list as long as the rate pickled both ways on every request, and a race between the
read and the write that lets concurrent requests past the rate. Here a counter per (scope,
ident, window) is counted by a script that Redis runs atomically, in one round trip. The count
that decides is a sliding window's: this window's requests plus the previous window's, weighted
by the share of the previous window that the last `period` seconds still cover. A fixed window
alone let a client make twice its rate across a window's edge; this one lets it past its rate
only by what the weighting assumes (requests spread evenly over the previous window).

Only requests let through are counted, as DRF's throttles count them: a refused request costs
the client nothing, so one that retries at its Retry-After gets through, however often it asked
before. When Redis does not answer, requests are let through: an outage of the limiter must not
stop the API.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable

import redis

log = logging.getLogger(__name__)

_PERIODS = {"s": 1, "m": 60, "h": 3600, "d": 86400}

# KEYS: this window's counter, the previous window's. ARGV: the limit, the previous window's
# weight, the counter's time to live. Returns {allowed (1 or 0), this window's count of allowed
# requests, the previous window's}. The tolerance keeps rounding (a float of today's epoch
# seconds is exact to about 2e-7 s) from refusing a request exactly at the rate.
_COUNT = """
local count = redis.call('INCR', KEYS[1])
redis.call('EXPIRE', KEYS[1], ARGV[3])
local previous = tonumber(redis.call('GET', KEYS[2]) or '0')
if previous * tonumber(ARGV[2]) + count <= tonumber(ARGV[1]) + 1e-6 then
    return {1, count, previous}
end
redis.call('DECR', KEYS[1])
return {0, count - 1, previous}
"""
_scripts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _script(client: redis.Redis):
    """The counting script bound to `client` (redis-py sends its digest, and the source once if
    Redis does not hold it, as after a restart)."""
    script = _scripts.get(client)
    if script is None:
        script = _scripts[client] = client.register_script(_COUNT)
    return script


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
    into = now - window * period  # seconds into this window
    key = f"gpumarket:rate:{scope}:{ident}:"
    try:
        allowed, count, previous = _script(client)(
            keys=[f"{key}{window}", f"{key}{window - 1}"],
            # Kept through the next window, which weighs it.
            args=[limit, repr(1 - into / period), 2 * period + 1],
        )
    except redis.RedisError as exc:
        log.warning("rate limiter unavailable, request allowed: %s", exc)
        if on_error is not None:
            on_error(exc)
        return None
    if allowed:
        return None
    count, previous = int(count), int(previous)
    # When the next request would pass if no other came: it makes count + 1, and the previous
    # window's weight falls to zero at this window's end...
    if count + 1 <= limit:
        return period * (1 - (limit - count - 1) / previous) - into
    # ...or not before the next window, where this window's count is weighed the same way.
    return (window + 1) * period - now + period * min(1.0, max(0.0, 1 - (limit - 1) / count))
