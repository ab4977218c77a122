"""The wake channel: the real wake server process on the real Redis, the heartbeat's ticket,
and the wake-ups that placements and stops publish after commit."""

from __future__ import annotations

import concurrent.futures
import json
import threading
import time

import pytest
import redis
import requests
from django.conf import settings as django_settings

from core.wake import nodes_wake, wake_ticket_issue, wake_ticket_verify
from marketplace.lifecycle import rental_stop
from marketplace.models import RentalStatus
from scheduler.services import scheduler_cycle_run
from tests.factories import personal_team
from tests.provisioning.test_agent_api import _beat, agent  # noqa: F401 - the fixture
from tests.provisioning.wake import WakeServer

pytestmark = pytest.mark.django_db


@pytest.fixture(scope="module")
def wake_server(tmp_path_factory):
    server = WakeServer(log=tmp_path_factory.mktemp("wake") / "wake.log").start()
    yield server
    server.stop()


@pytest.fixture
def wake_on(settings, wake_server):
    settings.GPUMARKET = {
        **settings.GPUMARKET, "WAKE_URL": wake_server.url, "WAKE_CHANNEL": wake_server.channel,
    }  # fmt: skip
    return wake_server


def _poll(server: WakeServer, ticket: str | None, timeout: float | str = 20) -> requests.Response:
    headers = {"Authorization": f"Bearer {ticket}"} if ticket is not None else {}
    return requests.get(server.url, params={"timeout": timeout}, headers=headers, timeout=30)


def _ticket(node_id: int, issued_at: float | None = None) -> str:
    return wake_ticket_issue(node_id=node_id, issued_at=issued_at or time.time())


def _waiting(server: WakeServer, count: int) -> None:
    deadline = time.monotonic() + 10
    while server.health()["waiting"] < count:
        assert time.monotonic() < deadline, "the polls did not arrive"
        time.sleep(0.02)


def test_a_poll_is_answered_when_its_node_is_woken_and_no_other_node_s_is(
    wake_on, django_capture_on_commit_callbacks
):
    # Given node 7's and node 8's agents waiting
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        mine = pool.submit(_poll, wake_on, _ticket(7))
        other = pool.submit(_poll, wake_on, _ticket(8), 3)
        _waiting(wake_on, 2)
        # When node 7 is woken by a commit
        with django_capture_on_commit_callbacks(execute=True):
            nodes_wake(node_ids=[7])
        # Then node 7's poll is answered woken, node 8's only times out
        assert mine.result().json() == {"woken": True}
        assert other.result().json() == {"woken": False}


def test_nothing_is_published_until_the_transaction_commits(
    wake_on, django_capture_on_commit_callbacks
):
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(_poll, wake_on, _ticket(9), 2)
        _waiting(wake_on, 1)
        with django_capture_on_commit_callbacks(execute=False) as callbacks:
            nodes_wake(node_ids=[9])  # then rolled back: the callback never runs
        assert len(callbacks) == 1
        assert waiting.result().json() == {"woken": False}


def test_a_ticket_issued_before_a_wake_up_is_answered_at_once_a_later_one_waits(
    wake_on, django_capture_on_commit_callbacks
):
    before = time.time() - 1
    with django_capture_on_commit_callbacks(execute=True):
        nodes_wake(node_ids=[11])
    deadline = time.monotonic() + 10
    while _poll(wake_on, _ticket(11, before), 0.5).json() != {"woken": True}:
        assert time.monotonic() < deadline, "the wake-up never reached the server"
    # A heartbeat after the wake-up read the change: its ticket waits for the next one.
    assert _poll(wake_on, _ticket(11, time.time() + 0.01), 0.3).json() == {"woken": False}


def test_a_wake_up_due_later_is_answered_when_it_is_due(wake_on):
    client = redis.Redis.from_url(django_settings.REDIS_URL)
    now = time.time()
    message = {"t": now, "at": now + 1.5, "n": [12]}
    assert client.publish(wake_on.channel, json.dumps(message)) == 1
    assert _poll(wake_on, _ticket(12, now), 0.3).json() == {"woken": False}
    assert _poll(wake_on, _ticket(12, now), 10).json() == {"woken": True}


def _forged(ticket: str) -> str:
    node, issued, expires, signature = ticket.split(".")
    return f"{int(node) + 1}.{issued}.{expires}.{signature}"


@pytest.mark.parametrize(
    ("ticket", "field"),
    [
        pytest.param(None, "ticket", id="missing"),
        pytest.param(lambda: _forged(_ticket(13)), "ticket", id="another node's number"),
        pytest.param(lambda: _ticket(13)[:-2] + "AA", "ticket", id="a made-up signature"),
        pytest.param(
            lambda: wake_ticket_issue(node_id=13, issued_at=time.time() - 700, ttl_s=600),
            "ticket",
            id="expired",
        ),
        pytest.param(lambda: "13.1.99999999999.sig", "ticket", id="not signed"),
    ],
)
def test_a_bad_ticket_is_401_naming_the_ticket_and_waits_for_nothing(wake_on, ticket, field):
    refused = wake_on.health()["refused"]
    response = _poll(wake_on, ticket() if ticket else None)
    assert response.status_code == 401
    assert response.json()["detail"].startswith(f"{field}:")
    assert wake_on.health()["refused"] == refused + 1
    assert wake_on.health()["waiting"] == 0


@pytest.mark.parametrize("timeout", ["soon", "-1", "3600", "nan"])
def test_a_bad_timeout_is_400_naming_it(wake_on, timeout):
    response = _poll(wake_on, _ticket(14), timeout)
    assert response.status_code == 400
    assert response.json()["detail"].startswith("timeout:")


def test_one_node_holds_a_few_polls_at_most(wake_on, django_capture_on_commit_callbacks):
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        polls = [pool.submit(_poll, wake_on, _ticket(15)) for _ in range(4)]
        _waiting(wake_on, 4)
        assert _poll(wake_on, _ticket(15)).status_code == 429
        with django_capture_on_commit_callbacks(execute=True):
            nodes_wake(node_ids=[15])
        assert [p.result().json() for p in polls] == [{"woken": True}] * 4


def test_the_heartbeat_answer_carries_a_ticket_for_its_own_node(agent, wake_on):  # noqa: F811
    answer = _beat(agent).json()
    assert answer["wake"]["url"] == wake_on.url
    ticket = wake_ticket_verify(answer["wake"]["ticket"], now=time.time())
    assert ticket is not None and ticket.node_id == agent.node.pk


def test_without_a_wake_server_the_answer_has_no_wake_channel(agent):  # noqa: F811
    assert "wake" not in _beat(agent).json()


class Channel:
    """What was published on the wake channel, read from a real subscription."""

    def __init__(self, name: str) -> None:
        self.pubsub = redis.Redis.from_url(django_settings.REDIS_URL).pubsub()
        self.pubsub.subscribe(name)
        assert self.pubsub.get_message(timeout=5)["type"] == "subscribe"

    def nodes(self) -> list[list[int]]:
        woken = []
        while (message := self.pubsub.get_message(timeout=0.2)) is not None:
            woken.append(json.loads(message["data"])["n"])
        return woken


def test_a_placement_and_a_stop_wake_the_node_and_the_agent_s_own_reports_do_not(
    agent,  # noqa: F811
    rent,
    wake_on,
    django_capture_on_commit_callbacks,
):
    channel = Channel(wake_on.channel)
    node = agent.node.pk
    rental = rent(2)
    with django_capture_on_commit_callbacks(execute=True):
        scheduler_cycle_run()
    assert channel.nodes() == [[node]]
    with django_capture_on_commit_callbacks(execute=True):
        [desired] = _beat(agent).json()["desired"]  # SCHEDULED -> PROVISIONING
        run = {"rental_id": str(rental.pk), "run_id": desired["run_id"], "started_at": 1.0e9}
        _beat(agent, containers=[{**run, "status": "running"}])
    rental.refresh_from_db()
    assert rental.status == RentalStatus.RUNNING
    assert channel.nodes() == []
    with django_capture_on_commit_callbacks(execute=True):
        rental_stop(team=personal_team(rental.customer), actor=rental.customer, rental_id=rental.pk)
    assert channel.nodes() == [[node]]


def test_the_agent_s_listener_waits_for_a_fresh_ticket_after_a_refusal_and_wakes_its_loop(
    wake_on, django_capture_on_commit_callbacks
):
    from agentprotocol import WakeChannel
    from nodeagent.wake import WakeListener

    woken = threading.Event()
    listener = WakeListener(server_url=wake_on.base, on_wake=woken.set)
    listener.start()
    try:
        # Given a forged ticket: refused once, and not tried again until a new one comes
        refused = wake_on.health()["refused"]
        listener.offer(WakeChannel(url="/wake/v1/wait", ticket=_forged(_ticket(16))))
        deadline = time.monotonic() + 10
        while wake_on.health()["refused"] == refused:
            assert time.monotonic() < deadline, "the forged ticket was never sent"
            time.sleep(0.05)
        time.sleep(1)
        assert wake_on.health()["refused"] == refused + 1
        # When the next heartbeat brings a good ticket, the listener waits with it
        listener.offer(WakeChannel(url="/wake/v1/wait", ticket=_ticket(16)))
        _waiting(wake_on, 1)
        with django_capture_on_commit_callbacks(execute=True):
            nodes_wake(node_ids=[16])
        # Then the agent's loop is woken
        assert woken.wait(10)
        assert listener.wakeups == 1
    finally:
        listener.close()
