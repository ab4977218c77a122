"""Admission of agent heartbeats before any of their work: Kubernetes' API priority and
fairness in its simplest form, one bound per web process.

Without it, a fleet heartbeating faster than the web tier serves collapses it: every thread
holds a heartbeat, customers' requests and /healthz queue behind them, the agents time out and
send again. Here a heartbeat beyond AGENT_HEARTBEATS_IN_FLIGHT in this process is answered 503
at once, before Django builds a request, reads its body or touches the database: a
`Retry-After` jittered over the interval the fleet is asked for, and
agentprotocol.HeartbeatRefusal as the body. Nothing of a refused heartbeat is applied; the agent
sends its state again at its next round. Every other request passes untouched.

A refused heartbeat is first given a turn: the instant this process expects a slot free for
it, after the heartbeats in flight and those refused before it (the service time of a heartbeat
here, a moving average, divided among the slots), as a clinic books the next free appointment.
A burst (64 agents woken by one scheduler pass, each sending its heartbeat at once) is then
served in about the time its heartbeats take, instead of coming back in clumps a few seconds
apart. The turn is said to the millisecond in the body (`retry_after_s`), Retry-After carrying
the whole seconds HTTP allows. Turns are given only within TURNS_AHEAD_S, and within half the
shortest wait a refusal would otherwise name: past that the process is overloaded, not in a
burst, and the refused are spread over the fleet's interval as below.

That refusal leaves a note for the silence sweep (provisioning.services.refusals), so the
refused nodes may wait the whole interval: the fleet settles on the rate the server set
(IDLE_HEARTBEATS_PER_S) instead of coming back every few seconds. Without the note (Redis
down) the Retry-After stays within a third of the silence timeout, so a node refused twice in a
row is not taken offline.
"""

from __future__ import annotations

import json
import math
import random
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from django.conf import settings

from agentprotocol import HEARTBEAT_PATH, RETRY_AFTER_MAX_S, HeartbeatRefusal
from core.metrics import HEARTBEATS_REFUSED
from provisioning.services.heartbeat import fleet_heartbeat_interval_s
from provisioning.services.refusals import heartbeats_refused_note

WsgiApp = Callable[[dict, Callable], Iterable[bytes]]


# A heartbeat's service time assumed before this process has served one, and the weight of
# the newest in the moving average.
FIRST_SERVICE_S = 0.05
SERVICE_WEIGHT = 0.2
# How far ahead turns are given: a burst's worth (64 agents woken at once, their hand-overs and
# RUNNING reports: bench/launch.py, 180 rentals, found the last RUNNING 6.55-6.89 s after T
# with 2.5 s against 6.95-10.87 s with 1 s, the runs refused past 1 s waiting 3-5 s). Past it
# the process is overloaded, not in a burst. Under a lasting overload turns still bring the
# refused back sooner to be refused again: bench/scheduler.py with 1,000 busy hosts offering
# twice what the web serves counted 206-241 refusals a second with turns (2.5 s or 1 s ahead
# alike) against 113 without.
TURNS_AHEAD_S = 2.5


def _window_s(interval_s: int, *, sweep_knows: bool) -> int:
    window = min(interval_s, int(RETRY_AFTER_MAX_S))
    if not sweep_knows:
        window = min(window, settings.GPUMARKET["NODE_SILENCE_TIMEOUT_S"] // 3)
    return max(1, window)


def retry_after_s(interval_s: int, *, sweep_knows: bool = False) -> int:
    """Whole seconds (HTTP's Retry-After) between half and all of the fleet's interval: the
    refused nodes spread over the interval they were going to wait anyway. At most what an agent
    waits (RETRY_AFTER_MAX_S), and, unless the silence sweep knows of the refusal
    (`sweep_knows`), a third of NODE_SILENCE_TIMEOUT_S."""
    window = _window_s(interval_s, sweep_knows=sweep_knows)
    return random.randint(math.ceil(window / 2), window)


class Turns:
    """The turns this process gives the heartbeats it refuses: each the previous turn (or now)
    plus a heartbeat's service time here divided among the `bound` slots."""

    def __init__(self, bound: int, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.bound = bound
        self.service_s = FIRST_SERVICE_S
        self._last = float("-inf")
        self._clock = clock
        self._lock = threading.Lock()

    def served(self, seconds: float) -> None:
        """A heartbeat took `seconds` in this process."""
        with self._lock:
            self.service_s += SERVICE_WEIGHT * (seconds - self.service_s)

    def book(self, *, within_s: float) -> float | None:
        """Seconds from now to the next turn, booked; None (nothing booked) when it is past
        `within_s` or the process serves no heartbeat at all."""
        if self.bound <= 0:
            return None
        now = self._clock()
        with self._lock:
            turn = max(now, self._last) + self.service_s / self.bound
            if turn - now > within_s:
                return None
            self._last = turn
        return turn - now


class HeartbeatAdmission:
    """WSGI middleware around the agent API: at most `bound` heartbeats in flight."""

    def __init__(self, app: WsgiApp, *, bound: int) -> None:
        self._app = app
        self.slots = threading.BoundedSemaphore(bound) if bound > 0 else None
        self.turns = Turns(bound)

    def __call__(self, environ: dict, start_response: Callable) -> Any:
        if environ.get("PATH_INFO") != HEARTBEAT_PATH or environ.get("REQUEST_METHOD") != "POST":
            return self._app(environ, start_response)
        if self.slots is None or not self.slots.acquire(blocking=False):
            return self._refuse(start_response)
        began = time.monotonic()
        try:
            # Django's handler builds the whole response here; iterating it is only writing.
            return self._app(environ, start_response)
        finally:
            self.slots.release()
            self.turns.served(time.monotonic() - began)

    def _refuse(self, start_response: Callable) -> list[bytes]:
        HEARTBEATS_REFUSED.inc()
        interval = fleet_heartbeat_interval_s()
        ahead = min(TURNS_AHEAD_S, _window_s(interval, sweep_knows=False) / 2)
        retry: float | None = self.turns.book(within_s=ahead)
        if retry is None:
            retry = retry_after_s(
                interval, sweep_knows=heartbeats_refused_note(interval_s=interval)
            )
        body = json.dumps(
            HeartbeatRefusal(
                detail="the server is at its bound of heartbeats in flight; retry after the delay",
                retry_after_s=round(retry, 3),
                heartbeat_interval_s=interval,
            ).to_payload()
        ).encode()
        start_response(
            "503 Service Unavailable",
            [
                ("Content-Type", "application/json"),
                ("Content-Length", str(len(body))),
                ("Retry-After", str(math.ceil(retry))),
            ],
        )
        return [body]
