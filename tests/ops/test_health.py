"""Liveness and readiness against the real PostgreSQL and Redis, and against dead ones."""

from __future__ import annotations

import socket

import pytest

pytestmark = pytest.mark.django_db


def _dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_healthz_touches_nothing(client, settings):
    settings.REDIS_URL = f"redis://127.0.0.1:{_dead_port()}/0"
    response = client.get("/healthz")
    assert response.status_code == 200
    assert response.json() == {"status": "ok"}


def test_readyz_checks_what_is_configured_and_names_each_check(client, settings):
    settings.S3_BUCKET = ""
    settings.CELERY_BROKER_URL = settings.REDIS_URL
    response = client.get("/readyz")
    assert response.status_code == 200, response.json()
    checks = response.json()["checks"]
    assert checks["postgres"]["status"] == "ok"
    assert checks["redis"]["status"] == "ok"
    assert checks["broker"]["status"] == "skipped"
    assert checks["object_storage"]["status"] == "skipped"


def test_readyz_is_503_naming_the_dependency_that_is_down(client, settings):
    dead = _dead_port()
    settings.CELERY_BROKER_URL = f"redis://127.0.0.1:{dead}/0"
    settings.S3_BUCKET = "gpumarket"
    settings.S3_ENDPOINT_URL = f"http://127.0.0.1:{dead}"
    response = client.get("/readyz")
    assert response.status_code == 503
    body = response.json()
    assert body["status"] == "fail"
    assert body["checks"]["postgres"]["status"] == "ok"
    assert body["checks"]["redis"]["status"] == "ok"
    assert body["checks"]["broker"]["status"] == "fail"
    assert body["checks"]["object_storage"]["status"] == "fail"
    assert all(c["seconds"] < 5 for c in body["checks"].values())


def test_request_id_is_taken_or_made_and_returned(client):
    assert client.get("/healthz", HTTP_X_REQUEST_ID="abc-123").headers["X-Request-ID"] == "abc-123"
    made = client.get("/healthz", HTTP_X_REQUEST_ID="bad id\n").headers["X-Request-ID"]
    assert made != "bad id\n"
    assert len(made) == 32
