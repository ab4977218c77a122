"""AgentApiClient against a real local HTTP server: retries, typed errors, timeouts."""

from __future__ import annotations

import contextlib
import socket
import time

import pytest

from agentprotocol import (
    HEARTBEAT_PATH,
    JOIN_PATH,
    RETRY_AFTER_MAX_S,
    HeartbeatAnswer,
    HeartbeatRefusal,
    JoinAnswer,
)
from nodeagent.client import (
    AgentApiClient,
    AuthRejectedError,
    RequestRejectedError,
    ServerBusyError,
    TimedOutError,
    TransientApiError,
    backoff_delay,
)

DESIRED = HeartbeatAnswer(
    desired=(), ack_usage_seq=0, heartbeat_interval_s=5, run_benchmark=False
).to_payload()


def client_for(server, **options) -> AgentApiClient:
    options = {"backoff_base_s": 0.01, "backoff_max_s": 0.05, **options}
    return AgentApiClient(server.url, **options)


def test_503_is_retried_until_success(fake_server):
    answers = iter([(503, {"detail": "busy"}), (503, "<html>bad gateway</html>"), (200, DESIRED)])
    fake_server.on(HEARTBEAT_PATH, lambda request: next(answers))
    client = client_for(fake_server, attempts=3)
    assert client.heartbeat({"sent_at": 1.0}, token="gpn_x") == DESIRED
    # three identical requests, each with the bearer token
    assert fake_server.bodies(HEARTBEAT_PATH) == [{"sent_at": 1.0}] * 3
    assert {r.headers["Authorization"] for r in fake_server.requests} == {"Bearer gpn_x"}


def test_5xx_beyond_the_attempts_is_a_transient_error(fake_server):
    fake_server.on(HEARTBEAT_PATH, lambda request: (500, {"detail": "boom"}))
    client = client_for(fake_server, attempts=2)
    with pytest.raises(TransientApiError, match="HTTP 500: boom"):
        client.heartbeat({}, token="t")
    assert len(fake_server.requests) == 2


def test_429_is_transient(fake_server):
    fake_server.on(HEARTBEAT_PATH, lambda request: (429, {"detail": "slow down"}))
    with pytest.raises(TransientApiError, match="429"):
        client_for(fake_server, attempts=1).heartbeat({}, token="t")


def test_401_is_a_typed_error_and_not_retried(fake_server):
    fake_server.on(
        HEARTBEAT_PATH, lambda request: (401, {"detail": "invalid or revoked node token"})
    )
    client = client_for(fake_server, attempts=5)
    with pytest.raises(AuthRejectedError) as raised:
        client.heartbeat({}, token="gpn_revoked")
    assert raised.value.status == 401
    assert raised.value.message == "invalid or revoked node token"
    assert len(fake_server.requests) == 1


def test_other_4xx_carries_the_servers_message_and_is_not_retried(fake_server):
    body = {"join_token": ["invalid, used or expired join token"], "code": "invalid"}
    fake_server.on(JOIN_PATH, lambda request: (400, body))
    with pytest.raises(RequestRejectedError) as raised:
        client_for(fake_server, attempts=3).join({"join_token": "gpj_x"})
    assert not isinstance(raised.value, AuthRejectedError)
    assert raised.value.status == 400
    assert "invalid, used or expired join token" in raised.value.message
    assert len(fake_server.requests) == 1


def test_join_returns_the_servers_answer(fake_server):
    answer = JoinAnswer(node_id=4, node_token="gpn_abc", heartbeat_interval_s=5).to_payload()
    fake_server.on(JOIN_PATH, lambda request: (201, answer))
    assert client_for(fake_server).join({"join_token": "gpj_x"}) == answer
    assert "Authorization" not in fake_server.requests[0].headers


def test_timeout_is_honoured(fake_server):
    # given a server that answers after 3 s
    fake_server.on(HEARTBEAT_PATH, lambda request: (200, DESIRED, 3.0))
    client = client_for(fake_server, attempts=1, timeout_s=0.3)
    began = time.monotonic()
    # then the client gives up after its timeout, as a transient error
    with pytest.raises(TransientApiError, match="timed out"):
        client.heartbeat({}, token="t")
    assert time.monotonic() - began < 2.0


def test_unreachable_server_is_transient():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    client = AgentApiClient(f"http://127.0.0.1:{port}", attempts=2, backoff_base_s=0.01)
    with pytest.raises(TransientApiError, match="unreachable"):
        client.heartbeat({}, token="t")


def test_success_without_json_is_transient(fake_server):
    fake_server.on(HEARTBEAT_PATH, lambda request: (200, "<html>proxy</html>"))
    with pytest.raises(TransientApiError, match="without a JSON body"):
        client_for(fake_server, attempts=1).heartbeat({}, token="t")


def test_server_url_must_be_http():
    with pytest.raises(ValueError, match="http"):
        AgentApiClient("ftp://example.invalid")


def test_backoff_is_bounded_and_jittered():
    delays = [backoff_delay(attempt, base_s=1.0, max_s=8.0) for attempt in range(10)]
    for attempt, delay in enumerate(delays):
        cap = min(8.0, 2.0**attempt)
        assert cap / 2 <= delay <= cap


def test_a_refusal_with_retry_after_is_not_retried_and_says_when_and_how_often(fake_server):
    # given a server at its bound of heartbeats in flight
    refusal = HeartbeatRefusal(detail="busy", retry_after_s=7, heartbeat_interval_s=20)
    fake_server.on(
        HEARTBEAT_PATH, lambda request: (503, refusal.to_payload(), 0.0, {"Retry-After": "7"})
    )
    # when the client heartbeats with attempts to spare
    with pytest.raises(ServerBusyError) as raised:
        client_for(fake_server, attempts=3).heartbeat({}, token="t")
    # then it sent once, and the error carries the server's delay and interval
    assert len(fake_server.requests) == 1
    assert raised.value.retry_after_s == 7.0
    assert raised.value.interval_s == 20.0


@pytest.mark.parametrize(
    ("said_s", "header", "waited_s"),
    [
        (0.25, "1", 0.25),  # a turn booked 0.25 s away: the body, to the millisecond
        (900.0, "2", 2.0),  # a body past the header's whole seconds is not believed
    ],
)
def test_a_refusal_s_turn_is_taken_from_its_body_within_retry_after(
    fake_server, said_s, header, waited_s
):
    refusal = HeartbeatRefusal(detail="busy", retry_after_s=said_s, heartbeat_interval_s=5)
    fake_server.on(
        HEARTBEAT_PATH, lambda request: (503, refusal.to_payload(), 0.0, {"Retry-After": header})
    )
    with pytest.raises(ServerBusyError) as raised:
        client_for(fake_server).heartbeat({}, token="t")
    assert raised.value.retry_after_s == waited_s


def test_after_a_refusal_the_client_comes_back_on_a_new_connection(fake_server):
    # given a server keeping connections, that answers, refuses once, then answers
    fake_server.keep_alive = True
    answers = iter([
        (200, {}), (200, {}),
        (503, HeartbeatRefusal(detail="busy", retry_after_s=0.1,
                               heartbeat_interval_s=5).to_payload(), 0.0, {"Retry-After": "1"}),
        (200, {}), (200, {}),
    ])  # fmt: skip
    fake_server.on(HEARTBEAT_PATH, lambda request: next(answers))
    client = client_for(fake_server)
    for _ in range(5):
        with contextlib.suppress(ServerBusyError):
            client.heartbeat({}, token="t")
    ports = [r.port for r in fake_server.requests]
    # then the answered requests kept their connection, and the one after the refusal came on
    # another, kept from then on
    assert ports[0] == ports[1] == ports[2]
    assert ports[3] != ports[2] and ports[3] == ports[4]


def test_a_429_with_retry_after_is_not_retried_and_the_wait_is_bounded(fake_server):
    fake_server.on(
        JOIN_PATH, lambda request: (429, {"detail": "slow down"}, 0.0, {"Retry-After": "3600"})
    )
    with pytest.raises(ServerBusyError) as raised:
        client_for(fake_server, attempts=3).join({"join_token": "gpj_x"})
    assert len(fake_server.requests) == 1
    assert raised.value.retry_after_s == RETRY_AFTER_MAX_S
    assert raised.value.interval_s is None


def test_a_retry_after_that_is_a_date_is_an_ordinary_transient_error(fake_server):
    date = "Wed, 21 Oct 2026 07:28:00 GMT"
    fake_server.on(
        HEARTBEAT_PATH, lambda request: (503, {"detail": "x"}, 0.0, {"Retry-After": date})
    )
    with pytest.raises(TransientApiError) as raised:
        client_for(fake_server, attempts=2).heartbeat({}, token="t")
    assert not isinstance(raised.value, ServerBusyError)
    assert len(fake_server.requests) == 2


def test_a_heartbeat_that_timed_out_is_not_resent_within_the_call(fake_server):
    # given a server that answers after the client's timeout
    fake_server.on(HEARTBEAT_PATH, lambda request: (200, DESIRED, 1.0))
    with pytest.raises(TimedOutError):
        client_for(fake_server, attempts=3, timeout_s=0.2).heartbeat({}, token="t")
    # then one request: the server may still apply it, the next round sends newer state
    assert len(fake_server.requests) == 1


def test_the_proxy_the_environment_names_at_the_start_is_used_and_no_proxy_bypasses_it(
    fake_server, monkeypatch
):
    # Given an environment whose proxy (the fake server, answering as a proxy would) stands
    # between the agent and a server it cannot reach directly
    monkeypatch.setenv("HTTP_PROXY", fake_server.url)
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    answer = JoinAnswer(node_id=1, node_token="n", heartbeat_interval_s=5).to_payload()
    fake_server.on(f"http://server.invalid{JOIN_PATH}", lambda _: (200, answer))
    client = AgentApiClient("http://server.invalid", attempts=1)
    # When the environment changes after the start, the client keeps what it read then
    monkeypatch.delenv("HTTP_PROXY")
    # Then its requests go through the proxy, for the server's URL
    assert client.join({"join_token": "x"}) == answer
    assert [r.path for r in fake_server.requests] == [f"http://server.invalid{JOIN_PATH}"]
    # And with the server named in NO_PROXY, a client goes to it directly (unreachable here)
    monkeypatch.setenv("HTTP_PROXY", fake_server.url)
    monkeypatch.setenv("NO_PROXY", "server.invalid")
    with pytest.raises(TransientApiError, match="unreachable"):
        AgentApiClient("http://server.invalid", attempts=1).join({"join_token": "x"})
    assert len(fake_server.requests) == 1
