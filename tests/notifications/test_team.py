"""Notifications are the team's: its settings (owners and billing members change them, every
member reads them), its deliveries (every member lists them) and who of it is emailed."""

from __future__ import annotations

import pytest

from accounts.models import TeamRole
from accounts.services import team_create
from marketplace.models import RentalStatus as S
from notifications.models import Channel, Delivery, NotificationSettings
from notifications.services import balance_low_notify, budget_reached_notify
from tests.accounts.test_teams import _client, _join
from tests.factories import UserFactory, personal_team
from tests.notifications.conftest import move

pytestmark = pytest.mark.django_db

SETTINGS = "/api/v1/notifications/settings/"
ROTATE = "/api/v1/notifications/settings/rotate-secret/"
DELIVERIES = "/api/v1/notifications/deliveries/"
TO_RUNNING = (S.SCHEDULED, S.PROVISIONING, S.RUNNING)


@pytest.fixture
def acme(user):
    """A team with its owner (`user`), a billing member and two plain members."""
    team = team_create(owner=user, name="acme")
    people = {"owner": user}
    for role in ("billing", "member", "other_member"):
        person = UserFactory()
        _join(team, user, person, TeamRole.BILLING if role == "billing" else TeamRole.MEMBER)
        people[role] = person
    team.people = people
    return team


def _emailed(**filters) -> set[str]:
    return set(
        Delivery.objects.filter(channel=Channel.EMAIL, **filters).values_list(
            "recipient", flat=True
        )
    )


def test_members_read_the_teams_settings_and_only_owners_and_billing_change_them(acme):
    people = acme.people
    as_member = _client(people["member"], acme)
    # When a plain member reads, then tries to change the settings and the secret
    assert as_member.get(SETTINGS).status_code == 200
    refused = as_member.patch(SETTINGS, {"email_enabled": False}, format="json")
    assert refused.status_code == 403
    assert as_member.post(ROTATE).status_code == 403
    # Then nothing was stored
    assert not NotificationSettings.objects.exists()
    # When the billing member turns the webhook on
    as_billing = _client(people["billing"], acme)
    body = {"webhook_url": "https://93.184.215.14/hooks", "email_kinds": ["rental.failed"]}
    changed = as_billing.patch(SETTINGS, body, format="json")
    assert changed.status_code == 200 and changed.json()["webhook_secret"]
    # Then it is the team's, and every member reads it; another team (the owner's personal
    # one) keeps its defaults
    (row,) = NotificationSettings.objects.all()
    assert row.team == acme
    assert as_member.get(SETTINGS).json()["webhook_url"] == "https://93.184.215.14/hooks"
    owner_elsewhere = _client(people["owner"], personal_team(people["owner"]))
    assert owner_elsewhere.get(SETTINGS).json()["webhook_url"] == ""


def test_rental_events_email_their_creator_and_the_owners(acme, rent, make_node):
    people = acme.people
    make_node()
    # When a plain member's rental of the team starts
    rental = rent(customer=people["member"], team=acme)
    move(rental, *TO_RUNNING)
    # Then its creator and the team's owner are emailed, not the billing member nor the
    # other members
    assert _emailed(notification__rental=rental) == {
        people["member"].email,
        people["owner"].email,
    }
    # And every member lists the team's deliveries
    listed = _client(people["other_member"], acme).get(DELIVERIES).json()["results"]
    assert {d["recipient"] for d in listed} == {people["member"].email, people["owner"].email}


def test_money_is_told_to_the_owners_and_billing_members_only(acme):
    people = acme.people
    # When the team's balance runs low and its budget is reached
    low = balance_low_notify(
        team=acme, notice_id=1, detail="$1 left", available_micros=1, hourly_burn_micros=2
    )
    cap = budget_reached_notify(team=acme, budget_key="acme", summary="cap", data={})
    # Then each is emailed to the owner and the billing member, never to plain members
    expected = {people["owner"].email, people["billing"].email}
    assert _emailed(notification=low) == expected
    assert _emailed(notification=cap) == expected


def test_the_teams_switches_hold_for_every_member(acme, rent, make_node):
    people = acme.people
    make_node()
    # Given the owner switched "started" emails off for the team
    _client(people["owner"], acme).patch(
        SETTINGS, {"email_kinds": ["rental.failed"]}, format="json"
    )
    # When a member's rental of the team starts
    rental = rent(customer=people["member"], team=acme)
    move(rental, *TO_RUNNING)
    # Then nobody is emailed
    assert _emailed(notification__rental=rental) == set()


def test_the_settings_page_is_read_only_for_plain_members(acme, client):
    people = acme.people
    client.force_login(people["member"])
    client.post("/teams/switch/", {"team": acme.pk})
    page = client.get("/notifications/").content.decode()
    assert 'id="read-only"' in page and "acme" in page
    client.force_login(people["billing"])
    client.post("/teams/switch/", {"team": acme.pk})
    assert 'id="read-only"' not in client.get("/notifications/").content.decode()
