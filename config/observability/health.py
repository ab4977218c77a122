"""Liveness and readiness for load balancers and Kubernetes probes.

`/healthz` says the process answers and touches nothing. `/readyz` checks each dependency this
process was configured with, each under a short timeout, and answers 503 naming the failed ones;
object storage (a signed HEAD of the bucket) is checked only when S3_BUCKET is set ("skipped"
otherwise).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import redis
from django.conf import settings
from django.db import connection
from django.http import HttpRequest, JsonResponse
from kombu import Connection

from storage import objectstore

CHECK_TIMEOUT_S = 2.0


def healthz(request: HttpRequest) -> JsonResponse:
    return JsonResponse({"status": "ok"})


def _postgres() -> None:
    with connection.cursor() as cursor:
        # Local to this transaction-less statement pair: a stuck server cannot hold the probe.
        # set_config rather than SET: a utility statement takes no bound parameter.
        cursor.execute(
            "SELECT set_config('statement_timeout', %s, false)", [str(int(CHECK_TIMEOUT_S * 1000))]
        )
        try:
            cursor.execute("SELECT 1")
        finally:
            cursor.execute("RESET statement_timeout")


def _redis() -> None:
    client = redis.Redis.from_url(
        settings.REDIS_URL, socket_timeout=CHECK_TIMEOUT_S, socket_connect_timeout=CHECK_TIMEOUT_S
    )
    try:
        client.ping()
    finally:
        client.close()


def _broker() -> None:
    with Connection(settings.CELERY_BROKER_URL, connect_timeout=CHECK_TIMEOUT_S) as conn:
        conn.ensure_connection(max_retries=0, timeout=CHECK_TIMEOUT_S)


def _object_storage() -> None:
    # The real bucket with the server's credentials: a reachable store with a missing bucket or
    # wrong keys is not ready either.
    objectstore.bucket_check(timeout_s=CHECK_TIMEOUT_S)


def _checks() -> dict[str, Callable[[], None] | None]:
    """name -> check, or None where this process has nothing of that kind configured."""
    broker = settings.CELERY_BROKER_URL
    return {
        "postgres": _postgres,
        "redis": _redis,
        # The broker is usually that same Redis; checked again only when it is another service.
        "broker": _broker if broker and broker != settings.REDIS_URL else None,
        "object_storage": _object_storage if objectstore.configured() else None,
    }


def readyz(request: HttpRequest) -> JsonResponse:
    results: dict[str, dict[str, object]] = {}
    for name, check in _checks().items():
        if check is None:
            results[name] = {"status": "skipped"}
            continue
        started = time.perf_counter()
        try:
            check()
        except Exception as exc:  # any failure of a dependency makes this process not ready
            results[name] = {"status": "fail", "error": f"{type(exc).__name__}: {exc}"[:300]}
        else:
            results[name] = {"status": "ok"}
        results[name]["seconds"] = round(time.perf_counter() - started, 4)
    ready = all(r["status"] != "fail" for r in results.values())
    return JsonResponse(
        {"status": "ok" if ready else "fail", "checks": results}, status=200 if ready else 503
    )
