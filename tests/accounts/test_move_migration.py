"""The move of teams, memberships, invitations, API tokens and SSH keys from the marketplace app to
the accounts app: state only, so the rows written before it are the accounts models' rows after
it, the foreign keys of other apps follow, and the content types keep their ids."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor
from django.utils import timezone

pytestmark = pytest.mark.django_db(transaction=True)

# The state just before the move: no accounts app, the models still the marketplace's.
BEFORE = [
    ("accounts", None),
    ("marketplace", "0019_node_fabric_address"),
    ("billing", "0009_account_owned_by_team"),
    ("notifications", "0004_team_notifications_required"),
    ("storage", "0002_content_types"),
]
MOVED = ("team", "membership", "invitation", "apitoken", "sshkey")


def _migrate(targets):
    executor = MigrationExecutor(connection)
    executor.loader.build_graph()
    executor.migrate(targets)
    # ("accounts", None) unapplies the app; the state is that of the other targets.
    return executor.loader.project_state([t for t in targets if t[1] is not None]).apps


def _latest():
    executor = MigrationExecutor(connection)
    executor.loader.build_graph()
    return executor.loader.graph.leaf_nodes()


@pytest.fixture(autouse=True)
def _latest_afterwards():
    yield
    _migrate(_latest())


def _content_types() -> dict[str, tuple[str, int]]:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT model, app_label, id FROM django_content_type WHERE model = ANY(%s)",
            [list(MOVED)],
        )
        return {model: (app, pk) for model, app, pk in cursor.fetchall()}


def test_rows_written_before_the_move_are_read_through_the_accounts_models_after_it():
    # Given a team with a member, an invitation, a token and an SSH key, and a rental, a billing
    # account, notification settings and a dataset of the team, written before the move
    old = _migrate(BEFORE)
    get = old.get_model
    ann = get("marketplace", "User").objects.create(username="ann", email="ann@example.invalid")
    team = get("marketplace", "Team").objects.create(name="ann", personal_of=ann)
    get("marketplace", "Membership").objects.create(team=team, user=ann, role="owner")
    now = timezone.now()
    get("marketplace", "Invitation").objects.create(
        team=team, email="bo@example.invalid", key_hash="1" * 64, invited_by=ann,
        expires_at=now + timedelta(days=7),
    )  # fmt: skip
    get("marketplace", "ApiToken").objects.create(
        user=ann, team=team, name="ci", prefix="p", key_hash="2" * 64
    )
    get("marketplace", "SshKey").objects.create(
        team=team, owner=ann, key_type="ssh-ed25519", public_key="ssh-ed25519 AAAA",
        fingerprint="SHA256:x", bits=256,
    )  # fmt: skip
    get("marketplace", "Rental").objects.create(
        customer=ann, team=team, gpus_per_node=1, start_at=now,
        start_deadline=now + timedelta(hours=1), duration_s=60, image="img",
    )  # fmt: skip
    get("billing", "Account").objects.create(kind="customer", team=team)
    get("notifications", "NotificationSettings").objects.create(team=team)
    get("storage", "Dataset").objects.create(owner=ann, team=team, name="d")
    before = _content_types()

    # When the move runs
    new = _migrate(_latest())

    # Then the accounts models read the same rows, the other apps' keys reach them, and the
    # content types are the accounts app's with the ids they had
    get = new.get_model
    team = get("accounts", "Team").objects.get(personal_of__username="ann")
    assert team.memberships.get().role == "owner"
    assert list(team.invitations.values_list("email", flat=True)) == ["bo@example.invalid"]
    assert list(team.api_tokens.values_list("name", flat=True)) == ["ci"]
    assert list(team.ssh_keys.values_list("fingerprint", flat=True)) == ["SHA256:x"]
    for app, model in (
        ("marketplace", "Rental"),
        ("billing", "Account"),
        ("notifications", "NotificationSettings"),
        ("storage", "Dataset"),
    ):
        assert get(app, model).objects.get().team == team, model
    assert sorted(before) == sorted(MOVED)
    assert before == {model: ("marketplace", pk) for model, (_, pk) in before.items()}
    assert _content_types() == {model: ("accounts", pk) for model, (_, pk) in before.items()}

    # And back: the marketplace's models read them again, under their old content types
    old = _migrate(BEFORE)
    assert old.get_model("marketplace", "ApiToken").objects.get().team.name == "ann"
    assert _content_types() == before
