"""Hand-written SQL stays where it is now and spreads no further: a ratchet.

The project's SQL goes through the ORM except where a statement was written by hand for speed
or for what the ORM cannot say (COPY, pipelined round trips, set-based updates). Each app keeps
it in one `queries.py`, named from the models' `_meta`, each statement checked against the ORM
in tests/<app>/test_queries.py; the few other modules below say why they keep theirs. A new
module with raw SQL fails here, and so does a listed module that no longer needs its place
(take it off the list).
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
APPS = (
    "accounts",
    "config",
    "core",
    "devstack",
    "marketplace",
    "scheduler",
    "provisioning",
    "billing",
    "notifications",
    "advisor",
    "storage",
)
# A Redis pipeline's execute() is not SQL: only a cursor's or a connection's counts.
RAW_SQL = re.compile(r"\bcursor\(|\.raw\(|\bRawSQL\b|\b(?:cursor|connection)\.execute\(")

# Module -> why it holds raw SQL today.
ALLOWED = {
    "billing/queries.py": "the funds check's lock and sums, usage and telemetry ingestion, the"
    " set-based billing pass (bench/agents.py, bench/metering.py, bench/scheduler.py)",
    "config/observability/health.py": "readiness probes (SELECT 1 under a statement timeout)",
    "accounts/queries.py": "the create path's token and membership read (bench/scheduler.py"
    " --parts api)",
    "marketplace/queries.py": "the offers list (bench/offers.py), the create path's node reads"
    " (bench/scheduler.py --parts api), the schedule-latency histogram",
    "marketplace/lifecycle.py": "the batch placement's UPDATE and COPY of events: the lifecycle"
    " alone writes a rental's status and events, and tests/marketplace/test_lifecycle.py finds"
    " such SQL by its table names",
    "core/locks.py": "advisory locks",
    "core/rows.py": "statements built once per model for the hot rows",
    "provisioning/queries.py": "the heartbeat's token lookup, held GPUs and one-statement idle"
    " heartbeat (bench/agents.py: server CPU per heartbeat)",
    "scheduler/queries.py": "the snapshot's epoch-time reads, the inventory digest, the COPY bind"
    " and the set-based waiting reasons (bench/scheduler.py --parts stream)",
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
