"""What one REST create costs the database, counted (never timed): the statements its request
sends, the funds hold's pipelined ones included, so that a change which adds a statement or a
per-create lookup shows here rather than in a benchmark nobody ran."""

from __future__ import annotations

import tempfile

import pytest
from django.db import connection

from billing.models import FundsHold
from billing.services.ledger import account_adjust, account_for_team
from marketplace.models import Rental, RentalEvent
from tests.factories import personal_team

pytestmark = pytest.mark.django_db

BODY = {"gpus_per_node": 1, "duration_s": 3600, "gpu_models": ["a100-sxm4-80gb"],
        "runtime": {"image": "img"}}  # fmt: skip


def _statements_run(do) -> int:
    """How many statements this process's connection sends while `do` runs, read from libpq's
    trace of the wire (a simple Query or an extended-protocol Bind runs one): Django's query
    log does not see the ones psycopg's pipeline sends."""
    connection.ensure_connection()
    pgconn = connection.connection.pgconn
    with tempfile.TemporaryFile("w+") as trace:
        pgconn.trace(trace.fileno())
        try:
            do()
        finally:
            pgconn.untrace()
        trace.seek(0)
        sent = [line.split("\t") for line in trace.read().splitlines() if "\tF\t" in line]
    return sum(1 for fields in sent if fields[fields.index("F") + 2] in ("Query", "Bind"))


@pytest.fixture
def funded(settings, user):
    settings.BILLING_FUNDS_CHECK = True  # as production runs: the hold checks the balance
    account_adjust(
        account_id=account_for_team(team=personal_team(user)).pk,
        amount_micros=10**12,
        reason="test credit",
        actor=None,
    )


def _rows() -> tuple[int, int, int]:
    return Rental.objects.count(), RentalEvent.objects.count(), FundsHold.objects.count()


def test_one_rest_create_runs_eight_statements(auth_api, make_node, funded):
    # Given a node that can take the request and a funded team whose token the process knows
    make_node(card="a100-sxm4-80gb")
    assert auth_api.post("/api/v1/rentals/", BODY, format="json").status_code == 201
    before = _rows()

    # When one more rental naming a GPU model is created through the API
    answers = []
    count = _statements_run(
        lambda: answers.append(auth_api.post("/api/v1/rentals/", BODY, format="json"))
    )

    # Then it is stored with its event and its hold...
    assert answers[0].status_code == 201, answers[0].content
    assert _rows() == (before[0] + 1, before[1] + 1, before[2] + 1)
    # ...by eight statements: the token with its membership; the refusal check's cheapest nodes
    # (the catalog's models are known from the first create: no lookup); BEGIN (a savepoint
    # here, inside the test's transaction); the rental with its event, one statement; the
    # account's lock, what the team owes and the hold, pipelined; COMMIT. (Nine until the
    # rental and its event became one statement.)
    assert count == 8


def test_a_refused_create_writes_nothing(auth_api, make_node, funded):
    # Given the same node
    make_node(card="a100-sxm4-80gb")
    before = _rows()
    # When the request asks for more GPUs than any node has
    r = auth_api.post("/api/v1/rentals/", {**BODY, "gpus_per_node": 16}, format="json")
    # Then it is refused with the reason and nothing is written
    assert r.status_code == 400
    assert "16 matching GPUs" in r.json()["non_field"][0]
    assert _rows() == before
