"""Shared set-up for the benchmarks: a fresh database on DATABASE_URL or on embedded services."""

from __future__ import annotations

import json
import os
import statistics
import sys
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def median(values: list[float]) -> float:
    return statistics.median(values)


def _with_database(url: str, name: str) -> str:
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, f"/{name}", parts.query, parts.fragment))


@contextmanager
def bench_database(name: str):
    """Create database `name` afresh on the server, migrate it, and point Django at it."""
    from config.embedded import ensure_services

    services = ensure_services(ROOT / ".var" / "bench", durable=False)
    import psycopg

    admin_url = _with_database(services.database_url, "postgres")
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{name}"')
    url = _with_database(services.database_url, name)
    os.environ["DATABASE_URL"] = url
    os.environ["REDIS_URL"] = services.redis_url
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings.base")
    os.environ.setdefault("GPUMARKET_EPHEMERAL_SECRET", "1")
    os.environ.setdefault("LOG_LEVEL", "WARNING")
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    try:
        yield url
    finally:
        from django.db import connections

        connections.close_all()
        with psycopg.connect(admin_url, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        services.stop()


def emit(figures: dict) -> None:
    """The last line of every benchmark: one JSON object of its figures."""
    print(json.dumps(figures), flush=True)
