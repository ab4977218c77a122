"""The database backend's health check (config.postgresql): a kept connection is checked before
each request's first query without a round trip when its socket has nothing to say, and one the
server closed is still found and replaced."""

from __future__ import annotations

import select

import psycopg
import pytest
from django.conf import settings
from django.db import connection

pytestmark = pytest.mark.django_db(transaction=True)


def _admin():
    info = connection.get_connection_params()
    info.pop("cursor_factory", None)
    info.pop("context", None)
    info.pop("prepare_threshold", None)
    return psycopg.connect(**info, autocommit=True)


def _last_query(pid: int) -> str:
    with _admin() as admin:
        return admin.execute("SELECT query FROM pg_stat_activity WHERE pid = %s", [pid]).fetchone()[
            0
        ]


def _readable(timeout_s: float = 10.0) -> bool:
    """Wait until the kept connection's socket has bytes to read: the server writes them
    (a notification, the message that ends the connection) a moment after it is asked to."""
    poller = select.poll()
    poller.register(connection.connection.fileno(), select.POLLIN)
    return bool(poller.poll(int(timeout_s * 1000)))


def _new_request() -> None:
    """What Django does at a request's start and then at its first query."""
    connection.close_if_unusable_or_obsolete()
    connection.close_if_health_check_failed()


def test_the_engine_is_the_project_backend():
    assert settings.DATABASES["default"]["ENGINE"] == "config.postgresql"
    assert settings.DATABASES["default"]["CONN_HEALTH_CHECKS"] is True


def test_an_idle_healthy_connection_is_checked_without_a_statement():
    # Given a kept connection whose last statement is known
    with connection.cursor() as cursor:
        cursor.execute("SELECT 'before the check'")
    pid = connection.connection.info.backend_pid

    # When the next request checks it
    _new_request()

    # Then it is kept, and the server saw no statement for the check
    assert connection.connection is not None
    assert connection.connection.info.backend_pid == pid
    assert _last_query(pid) == "SELECT 'before the check'"


def test_a_connection_the_server_ended_is_replaced_before_the_request_uses_it():
    # Given a kept connection that the server then terminates (as a restart or a timeout does)
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1")
    pid = connection.connection.info.backend_pid
    with _admin() as admin:
        assert admin.execute("SELECT pg_terminate_backend(%s)", [pid]).fetchone()[0] is True
    assert _readable()

    # When the next request checks it and runs a query
    _new_request()
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        now_pid = cursor.fetchone()[0]

    # Then the query ran on a new connection, not an error on the dead one
    assert now_pid != pid


def test_a_connection_with_something_to_read_gets_the_full_check_and_is_kept():
    # Given a kept connection listening on a channel, and a notification sent to it: bytes wait
    # on its socket though the connection is healthy
    with connection.cursor() as cursor:
        cursor.execute("LISTEN gpumarket_test_channel")
    pid = connection.connection.info.backend_pid
    with _admin() as admin:
        admin.execute("NOTIFY gpumarket_test_channel")
    assert _readable()

    # When the next request checks it
    _new_request()

    # Then the check asked the server (SELECT 1) and the connection stays
    assert connection.connection.info.backend_pid == pid
    assert _last_query(pid) == "SELECT 1"
    with connection.cursor() as cursor:
        cursor.execute("UNLISTEN *")
