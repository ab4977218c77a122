"""Hand-written SQL stays where it is now and spreads no further: a ratchet.

The project's SQL goes through the ORM except where a statement was written by hand for speed
or for what the ORM cannot say (COPY, pipelined round trips, set-based updates). The modules
below hold all of it today; the structure work moves it into one `queries.py` per app, named
from the models' `_meta`, and shortens this list as it goes. A new module with raw SQL fails
here, and so does a listed module that no longer needs its place (take it off the list).
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
APPS = (
    "config",
    "core",
    "devstack",
    "marketplace",
    "scheduler",
    "provisioning",
    "billing",
    "notifications",
)
# A Redis pipeline's execute() is not SQL: only a cursor's or a connection's counts.
RAW_SQL = re.compile(r"\bcursor\(|\.raw\(|\bRawSQL\b|\b(?:cursor|connection)\.execute\(")

# Module -> why it holds raw SQL today.
ALLOWED = {
    "billing/selectors.py": "the team's owed and held sums, read under the account lock",
    "billing/services/budgets.py": "the rentals past their cost caps, in one statement",
    "billing/services/invoices.py": "a statement's lines summed in SQL",
    "billing/services/ledger.py": "the account lock, owed sum and hold in one round trip",
    "billing/services/metering.py": "usage reports applied set-based",
    "billing/services/rating.py": "the billing pass's set-based rate and post",
    "config/observability/health.py": "readiness probes (SELECT 1 under a statement timeout)",
    "config/observability/metrics.py": "the schedule-latency histogram over recent events",
    "marketplace/lifecycle.py": "the batch placement's UPDATE and COPY of events",
    "core/locks.py": "advisory locks",
    "core/rows.py": "statements built once per model for the hot rows",
    "marketplace/selectors.py": "offers and the create-time node query, built once",
    "provisioning/services/heartbeat.py": "the one-statement idle heartbeat",
    "provisioning/services/join.py": "the node token's lookup",
    "provisioning/services/reliability.py": "each node's failures over the window, in SQL",
    "scheduler/services.py": "the snapshot and the COPY bind",
}


def _modules_with_raw_sql() -> set[str]:
    found = set()
    for app in APPS:
        for path in (ROOT / app).rglob("*.py"):
            if "migrations" in path.parts:
                continue
            if RAW_SQL.search(path.read_text(encoding="utf-8")):
                found.add(path.relative_to(ROOT).as_posix())
    return found


def test_raw_sql_lives_only_in_the_modules_that_hold_it_today():
    found = _modules_with_raw_sql()
    assert sorted(found - set(ALLOWED)) == [], "raw SQL outside the allowed modules"
    assert sorted(set(ALLOWED) - found) == [], "no raw SQL left there: take it off the list"


def test_the_scan_finds_each_form_of_raw_sql():
    for text in (
        "with connection.cursor() as c:",
        "Node.objects.raw('SELECT 1')",
        "annotate(x=RawSQL('1', []))",
        "cursor.execute('SELECT 1')",
    ):
        assert RAW_SQL.search(text), text
    for text in ("executor = pool.submit(run)", "entries, _ = pipe.execute()"):
        assert not RAW_SQL.search(text), text
