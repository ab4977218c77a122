"""Cluster-wide singletons: PostgreSQL session advisory locks, shared by every app."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from contextlib import contextmanager

from django.db import connection


def advisory_key(name: str) -> int:
    """The 64-bit key PostgreSQL holds the named lock under (pg_locks shows it as two halves)."""
    digest = hashlib.blake2b(name.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)


@contextmanager
def advisory_lock(name: str) -> Iterator[bool]:
    """Try to take the named lock; yields whether this process holds it. A killed worker's
    connection drops and PostgreSQL releases the lock with it, so nothing stays stuck."""
    key = advisory_key(name)
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_try_advisory_lock(%s)", [key])
        got = cursor.fetchone()[0]
    try:
        yield got
    finally:
        if got:
            with connection.cursor() as cursor:
                cursor.execute("SELECT pg_advisory_unlock(%s)", [key])
