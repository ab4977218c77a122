"""Auth hardening: a token cannot outlive the token that minted it, sign-in is locked out after
repeated failures (through the real login form), the customer API is throttled, and
X-Forwarded-For is believed only from a configured proxy."""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
from axes.models import AccessAttempt
from django.test import Client, RequestFactory
from django.utils import timezone
from rest_framework.test import APIClient

from accounts.models import ApiToken
from accounts.services import api_token_create
from core.api.guards import client_ip
from tests.factories import personal_team

pytestmark = pytest.mark.django_db


def _client_for(raw: str) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {raw}")
    return client


# Inherited expiry.


@pytest.fixture
def expiring(user):
    expires = timezone.now() + timedelta(hours=1)
    token, raw = api_token_create(
        user=user,
        team=personal_team(user),
        name="short",
        expires_at=expires,
    )
    return token, _client_for(raw)


def test_a_token_with_an_expiry_mints_tokens_that_inherit_it(expiring):
    parent, client = expiring
    r = client.post("/api/v1/tokens/", {"name": "child"}, format="json")
    assert r.status_code == 201, r.content
    child = ApiToken.objects.get(pk=r.json()["id"])
    assert child.expires_at == parent.expires_at


def test_a_token_with_an_expiry_cannot_mint_one_that_outlives_it(expiring, user):
    parent, client = expiring
    before = ApiToken.objects.count()
    later = (parent.expires_at + timedelta(seconds=1)).isoformat()
    r = client.post("/api/v1/tokens/", {"name": "child", "expires_at": later}, format="json")
    assert r.status_code == 400 and "expires_at" in r.json()
    assert ApiToken.objects.count() == before


def test_a_token_with_an_expiry_may_mint_a_shorter_one(expiring):
    parent, client = expiring
    sooner = parent.expires_at - timedelta(minutes=30)
    r = client.post("/api/v1/tokens/", {"name": "c", "expires_at": sooner.isoformat()}, "json")
    assert r.status_code == 201
    assert ApiToken.objects.get(pk=r.json()["id"]).expires_at == sooner


def test_a_token_without_expiry_and_a_session_mint_without_one(auth_api, user):
    r = auth_api.post("/api/v1/tokens/", {"name": "child"}, format="json")
    assert r.status_code == 201 and r.json()["expires_at"] is None
    session = APIClient()
    session.force_login(user)
    r = session.post("/api/v1/tokens/", {"name": "web"}, format="json")
    assert r.status_code == 201 and r.json()["expires_at"] is None


# Sign-in lockout through the real login page.


def _sign_in(client: Client, username: str, password: str, **extra):
    return client.post("/accounts/login/", {"login": username, "password": password}, **extra)


def test_sign_in_locks_out_after_the_configured_failures(settings, user):
    settings.AXES_FAILURE_LIMIT = 3
    user.set_password("right-password-42")
    user.save()
    client = Client()
    for _ in range(2):
        page = _sign_in(client, user.username, "wrong")
        assert page.status_code == 200  # the form again, with its error
    locked = _sign_in(client, user.username, "wrong")
    assert locked.status_code == 429
    assert b"Too many failed sign-ins" in locked.content
    # Locked out: even the right password is refused now, and no session is made.
    assert _sign_in(client, user.username, "right-password-42").status_code == 429
    assert "_auth_user_id" not in client.session
    # Another address is not locked out (per username and address).
    other = _sign_in(Client(), user.username, "right-password-42", REMOTE_ADDR="10.9.9.9")
    assert other.status_code == 302
    assert AccessAttempt.objects.filter(username=user.username, ip_address="127.0.0.1").exists()


def test_a_good_sign_in_resets_the_failure_count(settings, user):
    settings.AXES_FAILURE_LIMIT = 3
    user.set_password("right-password-42")
    user.save()
    client = Client()
    for _ in range(2):
        _sign_in(client, user.username, "wrong")
    assert _sign_in(client, user.username, "right-password-42").status_code == 302
    client.logout()
    for _ in range(2):
        assert _sign_in(client, user.username, "wrong").status_code == 200


def test_a_spoofed_forwarded_for_does_not_escape_the_lockout(settings, user):
    settings.AXES_FAILURE_LIMIT = 2
    client = Client()
    for n in range(3):
        last = _sign_in(client, user.username, "wrong", HTTP_X_FORWARDED_FOR=f"203.0.113.{n}")
    assert last.status_code == 429


# Throttles on the customer API.


def _rates(settings, **rates):
    from core.redis_clients import redis_clients

    # Account ids start again in every test database: counts of an earlier run are not theirs.
    client = redis_clients().background()
    for scope in rates:
        for key in client.scan_iter(f"gpumarket:rate:{scope}:*"):
            client.delete(key)
    settings.REST_FRAMEWORK = {
        **settings.REST_FRAMEWORK,
        "DEFAULT_THROTTLE_RATES": {**settings.REST_FRAMEWORK["DEFAULT_THROTTLE_RATES"], **rates},
    }


def test_a_signed_in_client_over_its_rate_gets_429_with_retry_after(settings, auth_api):
    _rates(settings, user="3/min")
    answers = [auth_api.get("/api/v1/me/") for _ in range(4)]
    assert [a.status_code for a in answers] == [200, 200, 200, 429]
    assert int(answers[-1]["Retry-After"]) > 0
    assert "throttled" in answers[-1].json()["detail"].lower()


def test_an_anonymous_client_is_throttled_by_its_address(settings):
    _rates(settings, anon="2/min")
    address = f"10.{uuid.uuid4().int % 250}.{uuid.uuid4().int % 250}.7"
    client = APIClient(REMOTE_ADDR=address)
    codes = [client.get("/api/v1/offers/").status_code for _ in range(3)]
    assert codes == [200, 200, 429]
    # Another address still gets its own allowance.
    other = f"10.251.{uuid.uuid4().int % 250}.1"
    assert APIClient(REMOTE_ADDR=other).get("/api/v1/offers/").status_code == 200


def test_forwarded_for_from_an_untrusted_peer_does_not_reset_the_throttle(settings):
    _rates(settings, anon="2/min")
    address = f"10.{uuid.uuid4().int % 250}.{uuid.uuid4().int % 250}.8"
    client = APIClient(REMOTE_ADDR=address)
    codes = [
        client.get("/api/v1/offers/", HTTP_X_FORWARDED_FOR=f"198.51.100.{n}").status_code
        for n in range(3)
    ]
    assert codes == [200, 200, 429]


def test_the_api_answers_while_the_throttles_redis_is_unreachable(settings, auth_api):
    # Given a Redis address that refuses connections
    import socket

    from core.redis_clients import RedisClients, redis_clients, redis_clients_replaced

    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    _rates(settings, user="2/min")
    with redis_clients_replaced(RedisClients(f"redis://127.0.0.1:{port}/0")):
        # Then the API still answers (the throttle steps aside), past the rate it could not
        # count, and Redis is left alone for a while after the first failure
        codes = [auth_api.get("/api/v1/rentals/").status_code for _ in range(3)]
        assert codes == [200, 200, 200]
        assert redis_clients().hot() is None
    # With Redis back, the rate is counted again
    codes = [auth_api.get("/api/v1/rentals/").status_code for _ in range(3)]
    assert codes == [200, 200, 429]


@pytest.mark.django_db(transaction=True)  # the threads' connections see the token
def test_concurrent_requests_of_one_account_never_pass_its_rate(settings, user):
    # DRF's cache throttle read and rewrote a list: requests racing between the two were all let
    # through. The counter is one atomic increment.
    import threading

    from django.db import connection

    _, token = api_token_create(user=user, team=personal_team(user), name="race")
    _rates(settings, user="10/day")  # one window, unless the test straddles midnight (UTC)
    codes: list[int] = []
    lock = threading.Lock()

    def hammer() -> None:
        client = APIClient()
        client.credentials(HTTP_AUTHORIZATION=f"Bearer {token}")
        try:
            for _ in range(5):
                code = client.get("/api/v1/me/").status_code
                with lock:
                    codes.append(code)
        finally:
            connection.close()  # this thread's own

    threads = [threading.Thread(target=hammer) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(codes).count(200) <= 10 and len(codes) == 40
    assert set(codes) <= {200, 429}


# Which address is the client's.


@pytest.mark.parametrize(
    ("trusted", "peer", "forwarded", "client"),
    [
        # From an untrusted peer the header is the client's own claim: ignored.
        (["10.0.0.0/8"], "192.0.2.10", "203.0.113.5", "192.0.2.10"),
        # From a trusted proxy: the right-most hop that is not one of our proxies (the client
        # may write anything left of what our proxies appended).
        (["10.0.0.0/8"], "10.0.0.2", "6.6.6.6, 203.0.113.5, 10.0.0.9", "203.0.113.5"),
        # No proxy configured: always the peer.
        ([], "10.0.0.2", "6.6.6.6", "10.0.0.2"),
        # A hop that is not an address stops the walk at the last trusted one.
        (["10.0.0.0/8"], "10.0.0.2", "6.6.6.6, not-an-ip", "10.0.0.2"),
    ],
)
def test_the_client_address(settings, trusted, peer, forwarded, client):
    settings.TRUSTED_PROXIES = trusted
    request = RequestFactory().get("/", REMOTE_ADDR=peer, HTTP_X_FORWARDED_FOR=forwarded)
    assert client_ip(request) == client


def test_behind_a_trusted_proxy_the_throttle_and_lockout_see_the_forwarded_client(settings, user):
    settings.TRUSTED_PROXIES = ["10.0.0.0/8"]
    settings.AXES_FAILURE_LIMIT = 2
    proxy = Client(REMOTE_ADDR="10.0.0.2")
    for _ in range(2):
        _sign_in(proxy, user.username, "wrong", HTTP_X_FORWARDED_FOR="203.0.113.77")
    assert AccessAttempt.objects.get(username=user.username).ip_address == "203.0.113.77"
    # A different client behind the same proxy is not locked out.
    page = _sign_in(proxy, user.username, "wrong", HTTP_X_FORWARDED_FOR="203.0.113.78")
    assert page.status_code == 200
