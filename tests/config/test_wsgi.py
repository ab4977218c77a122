"""config.wsgi serves the agent API with its own, shorter middleware chain and the site with the
whole one; both answer through the real WSGI application gunicorn runs."""

from __future__ import annotations

import io
import json
from wsgiref.util import setup_testing_defaults

import pytest
from django.conf import settings

from marketplace.models import Node

pytestmark = pytest.mark.django_db(transaction=True)


def _call(method: str, path: str, body: dict | None = None, **headers: str):
    from config.wsgi import application

    raw = json.dumps(body).encode() if body is not None else b""
    environ = {
        "REQUEST_METHOD": method,
        "PATH_INFO": path,
        "HTTP_HOST": "127.0.0.1",
        "REMOTE_ADDR": "127.0.0.1",
        "wsgi.input": io.BytesIO(raw),
        "CONTENT_LENGTH": str(len(raw)),
        "CONTENT_TYPE": "application/json",
        **{"HTTP_" + name.upper(): value for name, value in headers.items()},
    }
    setup_testing_defaults(environ)
    answer = {}

    def start_response(status, response_headers, exc_info=None):
        answer["status"] = int(status.split()[0])
        answer["headers"] = dict(response_headers)

    content = b"".join(application(environ, start_response))
    return answer["status"], answer["headers"], content


@pytest.fixture
def node_token(join_token) -> str:
    status, _, content = _call(
        "POST",
        "/api/agent/v1/join/",
        {
            "join_token": join_token,
            "hostname": "wsgi-host",
            "host": {"cpu_cores": 8, "ram_gb": 64, "disk_gb": 500},
            "gpus": [{"index": 0, "uuid": "GPU-wsgi-0", "name": "NVIDIA A100-SXM4-80GB",
                      "memory_mb": 81920, "topology_group": ""}],
        },
    )  # fmt: skip
    assert status == 201, content
    return json.loads(content)["node_token"]


def test_the_agent_middleware_is_the_sites_in_the_same_order():
    """Each middleware the agent API keeps runs where it runs for the site (the request id and
    timing first, the guard before anything reads the body)."""
    positions = [settings.MIDDLEWARE.index(m) for m in settings.AGENT_MIDDLEWARE]
    assert positions == sorted(positions)
    assert settings.AGENT_MIDDLEWARE[:2] == settings.MIDDLEWARE[:2]
    assert "core.api.guards.RequestGuardMiddleware" in settings.AGENT_MIDDLEWARE


def test_a_heartbeat_through_the_agent_handler_skips_the_browsers_middleware(node_token):
    seen = Node.objects.get(hostname="wsgi-host").last_seen_at
    status, headers, content = _call(
        "POST",
        "/api/agent/v1/heartbeat/",
        {"agent_version": "t", "sent_at": 1.8e9},
        Authorization=f"Bearer {node_token}",
        X_Request_ID="a" * 32,
    )
    assert status == 200, content
    assert json.loads(content)["desired"] == []
    assert Node.objects.get(hostname="wsgi-host").last_seen_at > seen
    assert headers["X-Request-ID"] == "a" * 32  # the observability middleware ran
    assert "X-Frame-Options" not in headers  # the browser's did not


def test_the_agent_handler_refuses_what_the_site_refuses(node_token):
    # the guard: a NUL byte in a header is refused, named, before the view reads anything
    seen = Node.objects.get(hostname="wsgi-host").last_seen_at
    status, _, content = _call(
        "POST", "/api/agent/v1/heartbeat/", {}, Authorization=f"Bearer {node_token}", X_Note="a\x00"
    )
    assert status == 400 and json.loads(content)["x-note"]
    assert Node.objects.get(hostname="wsgi-host").last_seen_at == seen
    status, _, _ = _call("POST", "/api/agent/v1/heartbeat/", {}, Authorization="Bearer x")
    assert status == 401
    status, _, content = _call("GET", "/api/agent/v1/no-such-thing/")
    assert (status, json.loads(content)["code"]) == (404, "not_found")
    status, _, content = _call(
        "POST",
        "/api/agent/v1/heartbeat/",
        {"agent_version": "t", "sent_at": "yesterday"},
        Authorization=f"Bearer {node_token}",
    )
    assert status == 400 and b"sent_at" in content


def test_the_site_keeps_the_whole_middleware():
    status, headers, _ = _call("GET", "/accounts/login/")
    assert status == 200
    assert headers["X-Frame-Options"] == "DENY"
    assert "csrftoken" in headers.get("Set-Cookie", "")
