"""The request counter behind the API throttles (core.ratelimit), on the real Redis:
a sliding window, so a client cannot make twice its rate across a window's edge."""

from __future__ import annotations

import uuid

import pytest

from core.ratelimit import hit
from core.redis_clients import redis_clients

RATE = "10/min"
START = 29_000_000 * 60.0  # the start of a minute's window


@pytest.fixture
def counter():
    client = redis_clients().hot()
    assert client is not None
    ident = uuid.uuid4().hex

    def count(at: float, rate: str = RATE):
        return hit(client, scope="test", ident=ident, rate=rate, now=START + at)

    return count


def test_a_burst_across_a_windows_edge_is_held_to_the_rate(counter):
    # Given a client that spent its rate in the last second of one window
    assert [counter(59.0) for _ in range(10)] == [None] * 10

    # When it asks again half a second into the next window (a fixed window would let ten by)
    wait = counter(60.5)

    # Then it is refused, and told when the next request passes: once the last window's weight
    # has fallen enough for one more (10 x (1 - 6/60) + 1 = 10; the refused one is not counted)
    assert wait == pytest.approx(5.5)
    assert counter(60.5 + wait) is None
    assert counter(60.5 + wait) is not None


def test_a_client_below_its_rate_is_never_refused(counter):
    # Nine requests a minute, evenly, for five minutes, across every window's edge
    times = [i * 60 / 9 for i in range(45)]
    assert [counter(at) for at in times] == [None] * 45


def test_a_client_far_past_its_rate_waits_into_the_next_window_and_then_passes(counter):
    # 25 requests in one window: the next must wait until this window's weight has fallen too
    answers = [counter(30.0) for _ in range(25)]
    assert answers[:10] == [None] * 10
    # Every refusal names the same wait: a refused request is not counted against the client
    assert len(set(answers[10:])) == 1
    wait = answers[-1]
    # 30 s to the window's end, then until 10 x (1 - e/60) + 1 <= 10: e = 60 x (1 - 9/10)
    assert wait == pytest.approx(30 + 60 * (1 - 9 / 10))
    assert counter(30.0 + wait - 0.01) is not None
    assert counter(30.0 + wait) is None


@pytest.mark.parametrize("rate, period", [("3/hour", 3600), ("600/min", 60), ("1/s", 1)])
def test_the_wait_is_at_most_a_window_and_a_share_of_it_per_request(counter, rate, period):
    # The rate spent at every point of a window: the wait never passes the window plus the
    # share of the next one that one request's weight takes, and the request at it passes
    limit = int(rate.split("/")[0])
    for k, offset in enumerate([0.0, 0.25, 0.5, 0.999]):
        at = 10 * k * period + offset * period
        assert [counter(at, rate) for _ in range(limit)] == [None] * limit
        wait = counter(at, rate)
        assert wait is not None
        assert 0 < wait <= period * (1 + 1 / limit) + 1e-6
        assert counter(at + wait, rate) is None


def test_a_redis_that_lost_its_scripts_still_counts(counter):
    # As after a restart: Redis no longer holds the counting script, and is sent it again
    assert counter(1.0, "1/min") is None
    redis_clients().hot().script_flush()
    assert counter(2.0, "1/min") is not None
