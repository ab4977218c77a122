"""The data migrations that move datasets, SSH keys and notification settings from the person
to the team: each lands in its owner's personal team (made for a person who had none)."""

from __future__ import annotations

import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor
from django.utils import timezone

pytestmark = pytest.mark.django_db(transaction=True)

BEFORE = [("marketplace", "0012_team_required"), ("notifications", "0001_notification_outbox")]
AFTER = [
    ("marketplace", "0015_team_datasets_ssh_keys_required"),
    ("notifications", "0004_team_notifications_required"),
]


def _migrate(targets):
    executor = MigrationExecutor(connection)
    executor.loader.build_graph()
    executor.migrate(targets)
    return executor.loader.project_state(targets).apps


@pytest.fixture(autouse=True)
def _latest_afterwards():
    yield
    executor = MigrationExecutor(connection)
    executor.migrate(executor.loader.graph.leaf_nodes())


def test_datasets_keys_and_notification_settings_move_to_the_owners_personal_team():
    # Given a person with a personal team and one without any (made by hand), each with a
    # dataset, an SSH key, notification settings and a notification
    old = _migrate(BEFORE)
    User = old.get_model("marketplace", "User")
    Team = old.get_model("marketplace", "Team")
    Membership = old.get_model("marketplace", "Membership")
    ann = User.objects.create(username="ann", email="ann@example.invalid")
    team = Team.objects.create(name="ann", personal_of=ann)
    Membership.objects.create(team=team, user=ann, role="owner")
    bo = User.objects.create(username="bo", email="bo@example.invalid")
    for i, person in enumerate((ann, bo)):
        old.get_model("marketplace", "Dataset").objects.create(owner=person, name="d")
        old.get_model("marketplace", "SshKey").objects.create(
            owner=person, key_type="ssh-ed25519", public_key=f"ssh-ed25519 K{i}",
            fingerprint=f"SHA256:{i}", bits=256,
        )  # fmt: skip
        old.get_model("notifications", "NotificationSettings").objects.create(
            owner=person, webhook_url=f"https://example.invalid/{i}"
        )
        old.get_model("notifications", "Notification").objects.create(
            owner=person, kind="balance.low", source_key=f"k{i}", summary="s", payload={},
            created_at=timezone.now(),
        )  # fmt: skip

    # When the migrations run
    new = _migrate(AFTER)

    # Then each row is its owner's personal team's, and bo got a personal team he owns
    Team = new.get_model("marketplace", "Team")
    for name in ("ann", "bo"):
        personal = Team.objects.get(personal_of__username=name)
        assert personal.memberships.get().role == "owner"
        for app, model in (
            ("marketplace", "Dataset"),
            ("marketplace", "SshKey"),
            ("notifications", "NotificationSettings"),
            ("notifications", "Notification"),
        ):
            rows = new.get_model(app, model).objects.filter(team=personal)
            assert rows.count() == 1, (name, model)
    assert Team.objects.count() == 2
