"""What the silence sweep must know about heartbeats the web tier refused.

A heartbeat refused before its work (provisioning.admission) writes nothing: the node's
`last_seen_at` stays where it was, and so does the interval it was last asked for, usually the
base one. Without more, a fleet the server cannot keep up with cannot be told to come back
less often either: a Retry-After past a third of the node's silence timeout would get the
refused nodes taken offline, so the refused come back every few seconds and keep the server
overloaded (10,000 nodes offered 804 heartbeats a second for 21 handled).

So a refusal also leaves a note in Redis: the interval the refused nodes were told, and when.
While a note is recent (within three of its intervals), the silence sweep gives every node at
least three of those intervals before it takes the node for lost: Kubernetes' node lifecycle
controller does the same in spirit, not evicting pods when the control plane itself cannot hear
the nodes. A dead node is then noticed later, never a live one dropped because the server was
busy. The note is written at most once a second per process, in one round trip; when it could
not be written (Redis down), the refusal keeps its Retry-After within the plain silence timeout.
"""

from __future__ import annotations

import logging
import time

from core.redis_clients import redis_clients

log = logging.getLogger(__name__)

REFUSED_KEY = "gpumarket:heartbeats:refused"
NOTE_EVERY_S = 1.0
# How long a note is kept at most: three of the longest interval a refusal may name.
KEEP_S = 3 * 300

# [last note (monotonic), whether it was written, the interval it named]
_noted: list[float] = [float("-inf"), 0.0, 0.0]


def heartbeats_refused_note(*, interval_s: int) -> bool:
    """Note that this process refuses heartbeats, telling the refused `interval_s`; at most one
    Redis round trip a second for one interval. Returns whether the sweep knows of a refusal
    with this interval (the note was written), so the caller may spread Retry-After over the
    whole interval."""
    now = time.monotonic()
    if now - _noted[0] < NOTE_EVERY_S and _noted[2] == interval_s:
        return bool(_noted[1])
    _noted[:] = [now, 0.0, float(interval_s)]
    clients = redis_clients()
    client = clients.hot()
    if client is None:
        return False
    try:
        with client.pipeline(transaction=False) as pipe:
            pipe.hset(REFUSED_KEY, str(int(interval_s)), f"{time.time():.3f}")
            pipe.expire(REFUSED_KEY, KEEP_S)
            pipe.execute()
    except Exception as exc:  # the refusal then stays within the plain silence timeout
        clients.hot_failed(exc)
        return False
    _noted[1] = 1.0
    return True


def refused_silence_floor_s(*, now: float | None = None) -> int:
    """The silence the sweep allows every node now because of refusals: three times the longest
    interval a refusal named within the last three of that interval; 0 when there was none (or
    Redis does not answer: the sweep then keeps the nodes' own timeouts)."""
    now = time.time() if now is None else now
    clients = redis_clients()
    try:
        notes = clients.background().hgetall(REFUSED_KEY)
    except Exception as exc:
        log.warning("heartbeat refusals unknown: %s", exc)
        return 0
    floor = 0
    for interval, at in notes.items():
        try:
            span = 3 * int(interval)
            if now - float(at) <= span:
                floor = max(floor, span)
        except ValueError:
            continue
    return floor
