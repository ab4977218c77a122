"""The data migration that gives every existing person a personal team: their rentals, API
tokens and billing account move into it, nothing is lost or shared."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor
from django.utils import timezone

pytestmark = pytest.mark.django_db(transaction=True)

TEAMS = ("marketplace", "0010_teams")
ACCOUNTS = ("billing", "0007_account_team")
AFTER = [("marketplace", "0012_team_required"), ("billing", "0009_account_owned_by_team")]


def _migrate(targets):
    executor = MigrationExecutor(connection)
    executor.loader.build_graph()
    executor.migrate(targets)
    return executor.loader.project_state(targets).apps


def _before() -> list[tuple[str, str]]:
    """Just before the teams migrations, whatever migrations precede them."""
    graph = MigrationExecutor(connection).loader.graph
    return [
        parent.key
        for key in (TEAMS, ACCOUNTS)
        for parent in graph.node_map[key].parents
        if parent.key[0] == key[0]
    ]


@pytest.fixture(autouse=True)
def _latest_afterwards():
    yield
    executor = MigrationExecutor(connection)
    executor.migrate(executor.loader.graph.leaf_nodes())


def test_existing_people_get_a_personal_team_owning_their_rentals_tokens_and_balance():
    # Given two people as they were before teams: rentals, tokens and accounts owned by user
    old = _migrate(_before())
    User = old.get_model("marketplace", "User")
    Rental = old.get_model("marketplace", "Rental")
    ApiToken = old.get_model("marketplace", "ApiToken")
    Account = old.get_model("billing", "Account")
    now = timezone.now()
    people = [User.objects.create(username=n, email=f"{n}@example.invalid") for n in ("ann", "bo")]
    for i, person in enumerate(people):
        for _ in range(i + 1):
            Rental.objects.create(
                customer=person, gpus_per_node=1, start_at=now,
                start_deadline=now + timedelta(hours=1), duration_s=60, image="img",
            )  # fmt: skip
        ApiToken.objects.create(user=person, name="t", prefix=f"p{i}", key_hash=f"{i:064d}")
        Account.objects.create(kind="customer", user=person, balance_micros=(i + 1) * 1000)
    Account.objects.create(kind="platform")

    # When the migrations run
    new = _migrate(AFTER)

    # Then each person owns exactly one personal team holding what was theirs
    Team = new.get_model("marketplace", "Team")
    Membership = new.get_model("marketplace", "Membership")
    Rental = new.get_model("marketplace", "Rental")
    ApiToken = new.get_model("marketplace", "ApiToken")
    Account = new.get_model("billing", "Account")
    for i, person in enumerate(people):
        team = Team.objects.get(personal_of_id=person.pk)
        assert team.name == person.username
        assert list(Membership.objects.filter(team=team).values_list("user_id", "role")) == [
            (person.pk, "owner")
        ]
        assert Rental.objects.filter(team=team, customer_id=person.pk).count() == i + 1
        assert ApiToken.objects.get(team=team).user_id == person.pk
        assert Account.objects.get(kind="customer", team=team).balance_micros == (i + 1) * 1000
    assert Rental.objects.count() == 3
    assert Account.objects.get(kind="platform").team_id is None
