"""Heartbeat admission (provisioning.admission) through the production WSGI entry point
(config.wsgi.application): a heartbeat beyond the process's bound is refused before any work,
customers' requests never are."""

import io
import json
import os
import time
from datetime import timedelta

import pytest
import redis
from django.conf import settings
from django.core.signals import request_finished, request_started
from django.db import close_old_connections
from django.utils import timezone
from prometheus_client import REGISTRY

from agentprotocol import HEARTBEAT_PATH, HeartbeatRefusal
from marketplace.models import Node, NodeEvent, NodeStatus
from provisioning.admission import HeartbeatAdmission, Turns, retry_after_s
from provisioning.services import nodes_mark_silent

pytestmark = pytest.mark.django_db


def _call(app, path, *, method="POST", token="", body=b"{}"):
    """One request through a WSGI app: (status, headers, body)."""
    environ = {
        "REQUEST_METHOD": method, "PATH_INFO": path, "QUERY_STRING": "",
        "SERVER_NAME": "testserver", "SERVER_PORT": "443", "HTTP_HOST": "testserver",
        "wsgi.url_scheme": "https",
        "REMOTE_ADDR": "127.0.0.1", "CONTENT_TYPE": "application/json",
        "CONTENT_LENGTH": str(len(body)), "wsgi.input": io.BytesIO(body),
        "wsgi.errors": io.StringIO(), "wsgi.version": (1, 0), "wsgi.multithread": True,
        "wsgi.multiprocess": True, "wsgi.run_once": False,
    }  # fmt: skip
    if token:
        environ["HTTP_AUTHORIZATION"] = f"Bearer {token}"
    started = {}

    def start_response(status, headers, exc_info=None):
        started.update(status=int(status.split()[0]), headers=dict(headers))

    # The test's database connection is kept open across the request, as Django's test client
    # keeps it: the test's transaction holds its rows.
    request_started.disconnect(close_old_connections)
    request_finished.disconnect(close_old_connections)
    try:
        response = app(environ, start_response)
        content = b"".join(response)
        getattr(response, "close", lambda: None)()
    finally:
        request_started.connect(close_old_connections)
        request_finished.connect(close_old_connections)
    return started["status"], started["headers"], content


@pytest.fixture
def node_token(api, join_token):
    body = {"join_token": join_token, "hostname": "gpu-host-1",
            "host": {"cpu_cores": 32, "ram_gb": 256, "disk_gb": 2000},
            "gpus": [{"index": 0, "uuid": "GPU-adm-0", "name": "NVIDIA A100-SXM4-80GB",
                      "memory_mb": 81920}]}  # fmt: skip
    r = api.post("/api/agent/v1/join/", body, format="json")
    assert r.status_code == 201, r.content
    return r.json()["node_token"]


@pytest.fixture
def wsgi():
    """The production entry point."""
    from config import wsgi

    return wsgi


def _refused_count() -> float:
    return REGISTRY.get_sample_value("gpumarket_agent_heartbeats_refused_total") or 0.0


def test_a_heartbeat_past_the_bound_is_refused_before_any_work(wsgi, node_token):
    # given the process's heartbeat slots taken (half its threads: two heartbeats in flight)
    node = Node.objects.get()
    seen = node.last_seen_at
    before = _refused_count()
    bound = settings.GPUMARKET["AGENT_HEARTBEATS_IN_FLIGHT"]
    assert bound == 2
    for _ in range(bound):
        assert wsgi.agent_api.slots.acquire(blocking=False)
    try:
        # when another heartbeat arrives
        status, headers, body = _call(wsgi.application, HEARTBEAT_PATH, token=node_token)
    finally:
        for _ in range(bound):
            wsgi.agent_api.slots.release()
    # then 503, when to come back and how often to heartbeat, and it is counted
    assert status == 503
    refusal = HeartbeatRefusal.from_payload(json.loads(body))
    # (no wake server: the fleet's interval is the base one, 1 s in the tests): a turn within
    # half of it, said to the millisecond in the body and in whole seconds in Retry-After
    assert refusal.heartbeat_interval_s == 1
    assert 0 < refusal.retry_after_s <= 0.5
    assert headers["Retry-After"] == "1"
    assert _refused_count() == before + 1
    # and nothing of it was applied: the node was not marked seen
    assert Node.objects.get(pk=node.pk).last_seen_at == seen
    # once the slot is free, the same heartbeat is served
    status, _, body = _call(wsgi.application, HEARTBEAT_PATH, token=node_token)
    assert status == 200, body
    assert Node.objects.get(pk=node.pk).last_seen_at > seen


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_refused_heartbeats_get_turns_a_service_time_apart_then_the_interval():
    clock = _Clock()
    turns = Turns(2, clock=clock)
    turns.service_s = 0.08
    # a burst: each refused is booked 0.08 s / 2 slots after the one before it
    booked = [turns.book(within_s=0.5) for _ in range(6)]
    assert booked == pytest.approx([0.04, 0.08, 0.12, 0.16, 0.2, 0.24])
    # time passes: the next turn follows the last one booked, not now
    clock.now += 0.1
    assert turns.book(within_s=0.5) == pytest.approx(0.18)
    # past the window nothing is booked (the caller spreads over the interval instead), and the
    # refusal did not take a turn: the next within the window is still the one after
    turns.service_s = 0.4
    assert turns.book(within_s=0.3) is None
    assert turns.book(within_s=1.0) == pytest.approx(0.18 + 0.2)
    # the service time follows what the heartbeats took
    for _ in range(40):
        turns.served(0.01)
    assert turns.service_s == pytest.approx(0.01, abs=1e-3)
    # a process that serves no heartbeat gives no turn
    assert Turns(0, clock=clock).book(within_s=10) is None


def test_a_burst_past_the_bound_is_told_turns_then_the_fleets_interval(wsgi, node_token):
    # given the process's slot taken and a heartbeat's service time of 0.12 s here
    app = HeartbeatAdmission(wsgi.agent_api, bound=1)
    app.turns.service_s = 0.12
    assert app.slots.acquire(blocking=False)
    try:
        answers = [_call(app, HEARTBEAT_PATH, token=node_token) for _ in range(8)]
    finally:
        app.slots.release()
    refusals = [HeartbeatRefusal.from_payload(json.loads(body)) for _, _, body in answers]
    retries = [r.retry_after_s for r in refusals]
    # then the first four are given turns 0.12 s apart within half the interval (1 s in the
    # tests), later ones the interval's spread (whole seconds, the test's 1 s)
    assert all(status == 503 for status, _, _ in answers)
    assert retries[:4] == sorted(retries[:4])
    assert 0.06 <= retries[0] <= 0.12 and 0.1 <= retries[3] - retries[2] <= 0.14
    assert retries[3] <= 0.5 and retries[4:] == [1, 1, 1, 1]
    assert [headers["Retry-After"] for _, headers, _ in answers] == ["1"] * 8
    # a heartbeat served updates the service time the turns are booked with
    status, _, _ = _call(app, HEARTBEAT_PATH, token=node_token)
    assert status == 200
    assert app.turns.service_s != 0.12


def test_with_a_bound_of_zero_every_heartbeat_is_refused_and_customers_are_not(
    wsgi, node_token, auth_api
):
    app = HeartbeatAdmission(wsgi.agent_api, bound=0)
    status, _, _ = _call(app, HEARTBEAT_PATH, token=node_token)
    assert status == 503
    # the agent API's other endpoints, and a heartbeat's GET, pass
    status, _, _ = _call(app, "/api/agent/v1/join/", body=b'{"join_token": "gpj_x"}')
    assert status == 400
    status, _, _ = _call(app, HEARTBEAT_PATH, method="GET", token=node_token)
    assert status == 405
    # customers' requests take the site's handler: never refused, whatever the bound
    for _ in range(3):
        status, _, _ = _call(wsgi.application, "/healthz", method="GET")
        assert status == 200


def test_retry_after_spreads_over_the_interval_and_stays_within_the_silence_timeout(settings):
    settings.GPUMARKET = {**settings.GPUMARKET, "NODE_SILENCE_TIMEOUT_S": 60}
    assert {retry_after_s(5) for _ in range(200)} == {3, 4, 5}
    assert {retry_after_s(120) for _ in range(400)} == set(range(10, 21))
    assert {retry_after_s(1) for _ in range(20)} == {1}


def test_retry_after_spans_the_whole_interval_when_the_sweep_knows(settings):
    settings.GPUMARKET = {**settings.GPUMARKET, "NODE_SILENCE_TIMEOUT_S": 60}
    assert {retry_after_s(40, sweep_knows=True) for _ in range(600)} == set(range(20, 41))
    # never past what an agent waits on one Retry-After
    assert {retry_after_s(120, sweep_knows=True) for _ in range(900)} == set(range(30, 61))


@pytest.fixture
def refusing_fleet(settings, make_node):
    """A wake server listening (a real Redis subscriber standing in for it), one idle heartbeat
    a second for the whole fleet, this process's counts and refusal notes forgotten."""
    from provisioning.services import heartbeat, refusals

    settings.GPUMARKET = {
        **settings.GPUMARKET, "WAKE_URL": "http://wake.invalid/wake/v1/",
        "IDLE_HEARTBEATS_PER_S": 1, "IDLE_HEARTBEAT_MAX_S": 120, "NODE_SILENCE_TIMEOUT_S": 60,
    }  # fmt: skip
    store = redis.Redis.from_url(os.environ["REDIS_URL"])

    def forget():
        heartbeat._listed_nodes[:] = [0, 0, 0, float("-inf")]
        refusals._noted[:] = [float("-inf"), 0.0, 0.0]
        store.delete(refusals.REFUSED_KEY)

    forget()
    listener = store.pubsub()
    listener.subscribe(settings.GPUMARKET["WAKE_CHANNEL"])
    listener.get_message(timeout=2)
    yield store
    listener.close()
    forget()


@pytest.mark.django_db(transaction=True)
def test_a_refused_fleet_waits_its_whole_interval_and_is_not_taken_for_lost(
    wsgi, node_token, make_node, refusing_fleet
):
    from provisioning.services import heartbeat

    # given 40 listed nodes heard from now, and a web process that has never counted them
    for _ in range(39):
        make_node(gpus=1)
    now = timezone.now()
    Node.objects.update(last_seen_at=now)
    app = HeartbeatAdmission(wsgi.agent_api, bound=0)
    # when it refuses heartbeats: the first refusal counts the fleet on a thread of its own
    _call(app, HEARTBEAT_PATH, token=node_token)
    deadline = time.monotonic() + 10
    while heartbeat._listed_nodes[0] != 40 and time.monotonic() < deadline:
        time.sleep(0.05)
    refusals = [HeartbeatRefusal.from_payload(json.loads(_call(app, HEARTBEAT_PATH,
                                                               token=node_token)[2]))
                for _ in range(60)]  # fmt: skip
    # then the refused are told the fleet's interval (40 nodes at one a second) and spread over
    # all of it, past a third of the silence timeout
    assert {r.heartbeat_interval_s for r in refusals} == {40}
    assert all(20 <= r.retry_after_s <= 40 for r in refusals)
    assert max(r.retry_after_s for r in refusals) > 20
    # and nothing of them was applied
    assert set(Node.objects.values_list("last_seen_at", flat=True)) == {now}
    # the sweep gives every node three of those intervals from the last refusal, not the 60 s
    # of the silence timeout
    assert nodes_mark_silent(now=now + timedelta(seconds=61)) == []
    assert nodes_mark_silent(now=now + timedelta(seconds=115)) == []
    assert set(Node.objects.values_list("status", flat=True)) == {NodeStatus.ONLINE}
    assert not NodeEvent.objects.exists()
    # and once refusals have stopped for three intervals, a node still silent is lost
    assert len(nodes_mark_silent(now=now + timedelta(seconds=125))) == 40


@pytest.mark.django_db(transaction=True)
def test_without_a_refusal_the_sweep_keeps_the_silence_timeout(node_token, refusing_fleet):
    from provisioning.services.refusals import REFUSED_KEY, heartbeats_refused_note

    now = timezone.now()
    Node.objects.update(last_seen_at=now)
    # a refusal 50 s ago that named 40 s: every node is given 120 s from it
    refusing_fleet.hset(REFUSED_KEY, "40", f"{now.timestamp() - 50:.3f}")
    assert nodes_mark_silent(now=now + timedelta(seconds=65)) == []
    # once three of its intervals have passed, the node's own silence timeout again
    assert nodes_mark_silent(now=now + timedelta(seconds=71)) == [Node.objects.get().pk]
    assert NodeEvent.objects.get().reason == "no heartbeat for 60 s"
    # and a short interval never shortens the silence timeout
    refusing_fleet.delete(REFUSED_KEY)
    Node.objects.update(status=NodeStatus.ONLINE, last_seen_at=now)
    assert heartbeats_refused_note(interval_s=5)
    assert nodes_mark_silent(now=now + timedelta(seconds=59)) == []
    assert nodes_mark_silent(now=now + timedelta(seconds=61)) == [Node.objects.get().pk]
