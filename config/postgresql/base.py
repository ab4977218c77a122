"""Django's PostgreSQL backend with a health check that costs no round trip when it need not.

With CONN_HEALTH_CHECKS, Django sends `SELECT 1` before the first query of every request on a
kept connection: a tenth of the statements of an API create. A connection the server closed
(a restart, `pg_terminate_backend`, an idle timeout) has the server's FATAL message or the end of
the stream waiting on its socket, so an idle connection whose socket has nothing to read is
usable as far as a `SELECT 1` could tell; only one with bytes waiting gets the full check.
"""

from __future__ import annotations

import select

from django.db.backends.postgresql import base
from psycopg import pq


class DatabaseWrapper(base.DatabaseWrapper):
    def is_usable(self) -> bool:
        conn = self.connection
        if conn is None or conn.closed or conn.broken:
            return False
        if conn.info.transaction_status != pq.TransactionStatus.IDLE:
            return super().is_usable()
        poller = select.poll()
        try:
            poller.register(conn.fileno(), select.POLLIN | select.POLLPRI)
            waiting = poller.poll(0)
        except (OSError, ValueError):
            return False
        return not waiting or super().is_usable()
