"""Teams: members and roles, invitations by email, switching teams, and every lookup scoped to
the team (another team's id answers 404 on every endpoint that takes one)."""

from __future__ import annotations

import os
import re
import subprocess
from datetime import timedelta

import pytest
from django.core import mail
from django.urls import URLPattern, URLResolver, get_resolver
from django.utils import timezone
from rest_framework.test import APIClient

from accounts.models import ApiToken, Invitation, Membership, SshKey, TeamRole
from accounts.services import (
    api_token_create,
    invitation_accept,
    invitation_create,
    team_create,
    user_create,
)
from accounts.services.sshkeys import ssh_key_add
from accounts.services.teams import invitation_path
from billing.models import Invoice
from billing.services import account_adjust, account_for_team, invoice_issue
from marketplace.models import Rental, RentalStatus, RentalTemplate, User
from notifications.models import Delivery
from notifications.services import notification_record
from storage.models import Dataset
from tests.factories import UserFactory, personal_team

pytestmark = pytest.mark.django_db

BODY = {
    "gpus_per_node": 1,
    "duration_s": 3600,
    "runtime": {"image": "gpumarket/harness:dev"},
}


def _client(user, team) -> APIClient:
    _, raw = api_token_create(user=user, team=team, name="tests")
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {raw}")
    return client


def _join(team, owner, person, role=TeamRole.MEMBER):
    """`person` joins `team` the real way: invited by `owner`, accepting the link."""
    sent = invitation_create(
        team=team, actor=owner, email=person.email, role=role, base_url="http://testserver"
    )
    raw = sent.link.rstrip("/").rsplit("/", 1)[1]
    return invitation_accept(user=person, team_id=team.pk, raw=raw)


@pytest.fixture
def acme(user):
    return team_create(owner=user, name="acme")


@pytest.fixture
def member(acme, user):
    person = UserFactory()
    _join(acme, user, person)
    return person


def test_a_new_person_gets_a_personal_team_they_own():
    # When the one customer-creation service makes an account
    person = user_create(username="ada", email="ada@example.invalid", password="pw-long-enough")
    # Then they own a personal team named after them, and nothing else
    (membership,) = Membership.objects.filter(user=person)
    assert membership.role == TeamRole.OWNER
    assert membership.team.personal_of == person
    assert membership.team.name == "ada"


def test_a_person_made_without_a_team_gets_their_personal_team_on_first_use(client):
    # Given ops staff made by `createsuperuser` (no team: it bypasses user_create)
    from django.core.management import call_command

    call_command(
        "createsuperuser",
        "--noinput",
        username="root",
        email="root@example.invalid",
        stdout=open(os.devnull, "w"),  # noqa: SIM115
    )
    root = User.objects.get(username="root")
    assert not Membership.objects.filter(user=root).exists()
    # When they open a page of the current team
    client.force_login(root)
    assert client.get("/ssh-keys/").status_code == 200
    # Then they own a personal team, made once
    (membership,) = Membership.objects.filter(user=root)
    assert (membership.role, membership.team.personal_of) == (TeamRole.OWNER, root)
    assert client.get("/datasets/").status_code == 200
    assert Membership.objects.filter(user=root).count() == 1


@pytest.mark.django_db(transaction=True)
def test_first_requests_at_once_make_one_personal_team():
    import threading

    from django.db import connection

    from accounts.services.teams import team_personal_ensure

    person = User.objects.create_user("twin", "twin@example.invalid", "pw-long-enough")
    barrier, teams, errors = threading.Barrier(8), [], []

    def first_request() -> None:
        try:
            barrier.wait(10)
            teams.append(team_personal_ensure(user=person).pk)
        except Exception as exc:
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=first_request) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert errors == [] and len(set(teams)) == 1 and len(teams) == 8
    assert Membership.objects.filter(user=person, team__personal_of=person).count() == 1
    assert Membership.objects.filter(user=person).count() == 1


def test_a_taken_email_creates_nothing(user):
    from core.errors import ValidationFailed

    before = (Membership.objects.count(), user.__class__.objects.count())
    with pytest.raises(ValidationFailed) as exc:
        user_create(username="other", email=user.email.upper(), password="pw-long-enough")
    assert exc.value.field == "email"
    assert (Membership.objects.count(), user.__class__.objects.count()) == before


def test_a_member_lists_and_sees_the_teams_rentals_and_creates_rentals(
    make_node, acme, user, member, rent
):
    # Given a rental the owner made for the team, and one in the owner's personal team
    make_node()
    teams_rental = rent(customer=user, team=acme, name="shared")
    private = rent(customer=user, name="private")
    as_member = _client(member, acme)
    # Then the member lists and opens the team's rental, not the owner's personal one
    listed = as_member.get("/api/v1/rentals/").json()["results"]
    assert [r["id"] for r in listed] == [str(teams_rental.pk)]
    assert listed[0]["team"] == acme.pk and listed[0]["created_by"] == user.username
    assert as_member.get(f"/api/v1/rentals/{teams_rental.pk}/").status_code == 200
    assert as_member.get(f"/api/v1/rentals/{private.pk}/").status_code == 404
    # And creates one, owned by the team, created by the member
    created = as_member.post("/api/v1/rentals/", BODY, format="json")
    assert created.status_code == 201
    rental = Rental.objects.get(pk=created.json()["id"])
    assert (rental.team_id, rental.customer_id) == (acme.pk, member.pk)
    # And may stop a teammate's rental
    stopped = as_member.post(f"/api/v1/rentals/{teams_rental.pk}/stop/")
    assert stopped.status_code == 200 and stopped.json()["status"] == RentalStatus.CANCELLED


def test_owners_manage_members_and_a_member_cannot(acme, user, member):
    as_owner, as_member = _client(user, acme), _client(member, acme)
    members = as_owner.get("/api/v1/team/members/").json()
    assert [(m["username"], m["role"]) for m in members] == [
        (user.username, "owner"),
        (member.username, "member"),
    ]
    mine = next(m["id"] for m in members if m["username"] == member.username)
    owners = next(m["id"] for m in members if m["username"] == user.username)
    # A member can neither change roles nor invite
    refused = as_member.patch(f"/api/v1/team/members/{owners}/", {"role": "member"}, format="json")
    assert refused.status_code == 403
    invite = as_member.post("/api/v1/team/invitations/", {"email": "x@example.invalid"})
    assert invite.status_code == 403
    assert not Invitation.objects.filter(email="x@example.invalid").exists()
    assert Membership.objects.get(pk=owners).role == TeamRole.OWNER
    # The owner makes the member a billing member
    promoted = as_owner.patch(f"/api/v1/team/members/{mine}/", {"role": "billing"}, format="json")
    assert promoted.status_code == 200 and promoted.json()["role"] == "billing"
    # The last owner cannot step down
    last = as_owner.patch(f"/api/v1/team/members/{owners}/", {"role": "member"}, format="json")
    assert last.status_code == 409 and "role" in last.json()
    assert Membership.objects.get(pk=owners).role == TeamRole.OWNER
    # A bad role names the field
    bad = as_owner.patch(f"/api/v1/team/members/{mine}/", {"role": "admin"}, format="json")
    assert bad.status_code == 400 and "role" in bad.json()
    # Removing a member revokes their tokens for the team at once
    assert as_member.get("/api/v1/rentals/").status_code == 200
    assert as_owner.delete(f"/api/v1/team/members/{mine}/").status_code == 204
    assert as_member.get("/api/v1/rentals/").status_code == 401
    assert not Membership.objects.filter(pk=mine).exists()


def test_invitation_accepted_once_by_the_invited_address(acme, user):
    # Given an owner inviting by email
    invited = UserFactory(email="bo@example.invalid")
    owner = _client(user, acme)
    r = owner.post("/api/v1/team/invitations/", {"email": "bo@example.invalid", "role": "billing"})
    assert r.status_code == 201 and r.json()["mailed"] is True
    # Then the mail carries the single-use link
    (message,) = mail.outbox
    assert message.to == ["bo@example.invalid"]
    link = re.search(r"http://testserver(/teams/\d+/join/[^/\s]+/)", message.body).group(1)
    assert link == r.json()["link"].removeprefix("http://testserver")
    team_id, key = re.match(r"/teams/(\d+)/join/([^/]+)/", link).groups()
    # When the invited person accepts it
    as_invited = _client(invited, personal_team(invited))
    joined = as_invited.post(
        "/api/v1/invitations/accept/", {"team": int(team_id), "key": key}, format="json"
    )
    # Then they are a billing member of the team
    assert joined.status_code == 201
    assert joined.json() == {"id": acme.pk, "name": "acme", "personal": False, "role": "billing"}
    assert Membership.objects.get(team=acme, user=invited).role == TeamRole.BILLING
    # And the link is spent
    again = as_invited.post(
        "/api/v1/invitations/accept/", {"team": int(team_id), "key": key}, format="json"
    )
    assert again.status_code == 409 and "used" in again.json()["detail"]
    assert Membership.objects.filter(team=acme).count() == 2


def _pending(acme, user, email="bo@example.invalid"):
    sent = invitation_create(team=acme, actor=user, email=email, base_url="http://testserver")
    return sent.invitation, sent.link.rstrip("/").rsplit("/", 1)[1]


def _state(acme):
    return (
        list(Membership.objects.filter(team=acme).values_list("user_id", "role")),
        list(Invitation.objects.filter(team=acme).values_list("accepted_at", "revoked_at")),
    )


def test_an_invitation_for_another_address_is_refused_and_creates_nothing(acme, user):
    _, key = _pending(acme, user)
    stranger = UserFactory(email="eve@example.invalid")
    before = _state(acme)
    r = _client(stranger, personal_team(stranger)).post(
        "/api/v1/invitations/accept/", {"team": acme.pk, "key": key}, format="json"
    )
    assert r.status_code == 403 and "another email address" in r.json()["detail"]
    assert _state(acme) == before


def test_an_expired_invitation_is_refused_and_creates_nothing(acme, user):
    invitation, key = _pending(acme, user)
    Invitation.objects.filter(pk=invitation.pk).update(
        expires_at=timezone.now() - timedelta(seconds=1)
    )
    invited = UserFactory(email="bo@example.invalid")
    before = _state(acme)
    r = _client(invited, personal_team(invited)).post(
        "/api/v1/invitations/accept/", {"team": acme.pk, "key": key}, format="json"
    )
    assert r.status_code == 409 and "expired" in r.json()["invitation"][0]
    assert _state(acme) == before


def test_an_invitation_used_for_another_team_is_refused_and_creates_nothing(acme, user):
    # Given a link to acme, presented with the id of another team the person could join
    _, key = _pending(acme, user)
    other = team_create(owner=UserFactory(), name="other")
    invited = UserFactory(email="bo@example.invalid")
    before = (_state(acme), _state(other))
    r = _client(invited, personal_team(invited)).post(
        "/api/v1/invitations/accept/", {"team": other.pk, "key": key}, format="json"
    )
    assert r.status_code == 400 and r.json()["invitation"] == [
        "this invitation is for another team"
    ]
    assert (_state(acme), _state(other)) == before
    # And the web link with the other team's id is not found
    web = APIClient()
    web.force_login(invited)
    page = web.post(invitation_path(team_id=other.pk, raw=key))
    assert page.status_code == 404 and (_state(acme), _state(other)) == before


def test_a_withdrawn_or_made_up_invitation_is_refused(acme, user):
    invitation, key = _pending(acme, user)
    owner = _client(user, acme)
    assert owner.post(f"/api/v1/team/invitations/{invitation.pk}/revoke/").status_code == 200
    invited = UserFactory(email="bo@example.invalid")
    client = _client(invited, personal_team(invited))
    withdrawn = client.post(
        "/api/v1/invitations/accept/", {"team": acme.pk, "key": key}, format="json"
    )
    assert withdrawn.status_code == 409
    made_up = client.post(
        "/api/v1/invitations/accept/", {"team": acme.pk, "key": "gpi_x_y"}, format="json"
    )
    assert made_up.status_code == 404
    assert not Membership.objects.filter(team=acme, user=invited).exists()


def test_the_web_link_asks_to_sign_in_then_joins_and_switches_to_the_team(
    client, make_node, acme, user, rent
):
    make_node()
    rent(customer=user, team=acme, name="acme-run")
    _, key = _pending(acme, user)
    invited = UserFactory(email="bo@example.invalid")
    link = invitation_path(team_id=acme.pk, raw=key)
    assert client.get(link)["Location"].startswith("/accounts/login/?next=")
    client.force_login(invited)
    page = client.get(link)
    assert page.status_code == 200 and "acme" in page.content.decode()
    joined = client.post(link)
    assert joined.status_code == 302 and joined["Location"] == "/rentals/"
    assert "acme-run" in client.get("/rentals/").content.decode()


def test_switching_teams_in_the_web_changes_what_the_pages_show(
    client, make_node, acme, user, member, rent
):
    make_node()
    rent(customer=user, team=acme, name="acme-run")
    rent(customer=member, name="own-run")
    client.force_login(member)
    # The personal team first
    page = client.get("/rentals/").content.decode()
    assert "own-run" in page and "acme-run" not in page
    # Switched to acme
    switched = client.post("/teams/switch/", {"team": acme.pk, "next": "/rentals/"})
    assert switched.status_code == 302 and switched["Location"] == "/rentals/"
    page = client.get("/rentals/").content.decode()
    assert "acme-run" in page and "own-run" not in page
    # And the API under the same session follows it
    assert client.get("/api/v1/me/").json()["team"]["id"] == acme.pk
    # A team they are not in is not found, and the session stays on acme
    stranger = team_create(owner=UserFactory(), name="stranger")
    assert client.post("/teams/switch/", {"team": stranger.pk}).status_code == 404
    assert client.get("/api/v1/me/").json()["team"]["id"] == acme.pk


def test_a_token_acts_for_its_own_team_only(make_node, acme, user, member, rent):
    make_node()
    rent(customer=user, team=acme, name="acme-run")
    rent(customer=member, name="own-run")
    personal = _client(member, personal_team(member))
    assert [r["name"] for r in personal.get("/api/v1/rentals/").json()["results"]] == ["own-run"]
    assert personal.get("/api/v1/me/").json()["team"]["personal"] is True
    teams = sorted((t["name"], t["role"]) for t in personal.get("/api/v1/teams/").json())
    assert teams == [("acme", "member"), (member.username, "owner")]


def test_a_token_acts_with_its_persons_membership_as_it_is_at_each_request(acme, member, rent):
    client = _client(member, acme)
    assert client.get("/api/v1/billing/topups/").status_code == 403
    assert client.get("/api/v1/me/").json()["team"]["id"] == acme.pk
    # The role changes: the same token manages money at its next request
    Membership.objects.filter(team=acme, user=member).update(role=TeamRole.BILLING)
    assert client.get("/api/v1/billing/topups/").status_code == 200
    # The person is no longer in the team (removed in the database, so the token is not
    # revoked): the token is refused, and creates nothing
    Membership.objects.filter(team=acme, user=member).delete()
    refused = client.post("/api/v1/rentals/", BODY, format="json")
    assert refused.status_code == 401
    assert "no longer in its team" in refused.json()["detail"]
    assert not Rental.objects.filter(team=acme).exists()


# Every URL parameter that names a team's object, and how to find another team's one. A new
# parameter fails test_every_id_parameter_is_known until it is listed here or in NOT_TEAM_OWNED.
NOT_TEAM_OWNED = {
    "slug",  # the public GPU catalog
    "provider_id",  # providers belong to their owner (tests/marketplace/test_provider_api.py)
    "node_id",
    "cluster_id",  # a provider's cluster, its owner's (tests/marketplace/test_clusters.py)
    "object_id",  # the admin
    "app_label",
    "content_type_id",
    "url",
    "path",
    "team_id",  # the invitation link: its own test above
    "key",  # the invitation link, and sign-up's email confirmation
    "uidb64",  # password reset (Django and allauth)
    "uidb36",
    "token",
}


def _patterns(resolver=None, prefix=""):
    resolver = resolver or get_resolver()
    for p in resolver.url_patterns:
        route = prefix + str(p.pattern)
        if isinstance(p, URLResolver):
            yield from _patterns(p, route)
        elif isinstance(p, URLPattern):
            yield route, p


def _id_routes():
    for route, pattern in _patterns():
        if route.startswith(("admin/", "api/agent/")):  # ops; nodes (their own credentials)
            continue
        names = re.findall(r"<(?:\w+:)?(\w+)>", route)
        if names:
            yield route, pattern, names


@pytest.fixture
def theirs(make_node, rent, tmp_path):
    """Another team's rental, invoice, token, membership, invitation, dataset and SSH key."""
    make_node()
    them = UserFactory()
    team = team_create(owner=them, name="theirs")
    colleague = UserFactory()
    membership = _join(team, them, colleague)
    rental = rent(customer=them, team=team)
    account = account_for_team(team=team)
    account_adjust(account_id=account.pk, amount_micros=5_000_000, reason="t", actor=None)
    last_month = (timezone.now().replace(day=1) - timedelta(days=1)).replace(day=1)
    invoice_issue(account_id=account.pk, period_start=last_month.date())
    token, _ = api_token_create(user=them, team=team, name="theirs")
    invitation, _ = _pending(team, them, email="someone@example.invalid")
    # A dataset row as an upload's start writes it (no bytes are needed to be refused).
    dataset = Dataset.objects.create(team=team, owner=colleague, name="theirs", total_bytes=1)
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "k")],
        check=True,
        timeout=60,
    )
    key = ssh_key_add(team=team, owner=colleague, public_key=(tmp_path / "k.pub").read_text())
    told = notification_record(
        team=team, kind="balance.low", source_key="theirs", summary="low", data={}
    )
    template = RentalTemplate.objects.create(team=team, name="theirs", image="img:1")
    return {
        "name": template.name,
        "delivery_id": told.deliveries.get().pk,
        "dataset_id": str(dataset.pk),
        "key_id": key.pk,
        "rental_id": str(rental.pk),
        "invoice_id": Invoice.objects.get(account=account).pk,
        "token_id": token.pk,
        "membership_id": membership.pk,
        "invitation_id": invitation.pk,
    }


def test_every_id_parameter_is_known():
    unknown = {
        (route, name)
        for route, _, names in _id_routes()
        for name in names
        if name not in NOT_TEAM_OWNED and name not in TEAM_OWNED
    }
    assert unknown == set()


TEAM_OWNED = {
    "rental_id",
    "invoice_id",
    "token_id",
    "membership_id",
    "invitation_id",
    "dataset_id",
    "key_id",
    "delivery_id",
    "name",  # a rental template's
}


def _team_routes():
    return sorted(
        route
        for route, _, names in _id_routes()
        if set(names) & TEAM_OWNED and "team_id" not in names
    )


@pytest.mark.parametrize("route", _team_routes())
@pytest.mark.parametrize("method", ["get", "post", "patch", "delete"])
def test_another_teams_id_is_404_on_every_endpoint_that_takes_one(
    route, method, theirs, acme, user, client
):
    # Given an owner of acme (every role allowed), by token for the API, by session for pages
    path = "/" + re.sub(r"<(?:\w+:)?(\w+)>", lambda m: str(theirs[m.group(1)]), route)
    if path.startswith("/api/"):
        caller = _client(user, acme)
    else:
        client.force_login(user)
        client.post("/teams/switch/", {"team": acme.pk})
        caller = client
    before = (
        list(Rental.objects.values_list("pk", "status")),
        list(ApiToken.objects.values_list("pk", "revoked_at")),
        list(Membership.objects.values_list("pk", "role")),
        list(Invitation.objects.values_list("pk", "revoked_at")),
        list(Dataset.objects.values_list("pk", "status", "total_bytes")),
        list(SshKey.objects.values_list("pk", "team_id")),
        list(Delivery.objects.values_list("pk", "state", "attempts")),
        list(RentalTemplate.objects.values_list("pk", "image", "updated_at")),
    )
    body = {"role": "owner"} if method == "patch" else None
    answer = (
        getattr(caller, method)(path, body, format="json")
        if path.startswith("/api/")
        else (getattr(caller, method)(path))
    )
    # Then it is not found (or the method is not allowed there), and nothing changed
    assert answer.status_code in (404, 405), (path, answer.status_code)
    after = (
        list(Rental.objects.values_list("pk", "status")),
        list(ApiToken.objects.values_list("pk", "revoked_at")),
        list(Membership.objects.values_list("pk", "role")),
        list(Invitation.objects.values_list("pk", "revoked_at")),
        list(Dataset.objects.values_list("pk", "status", "total_bytes")),
        list(SshKey.objects.values_list("pk", "team_id")),
        list(Delivery.objects.values_list("pk", "state", "attempts")),
        list(RentalTemplate.objects.values_list("pk", "image", "updated_at")),
    )
    assert after == before


def test_the_scoping_test_covers_the_team_endpoints():
    routes = _team_routes()
    for expected in (
        "api/v1/rentals/<uuid:rental_id>/",
        "api/v1/rentals/<uuid:rental_id>/stop/",
        "api/v1/billing/invoices/<int:invoice_id>/",
        "api/v1/tokens/<int:token_id>/revoke/",
        "api/v1/team/members/<int:membership_id>/",
        "rentals/<uuid:rental_id>/",
        "api/v1/datasets/<uuid:dataset_id>/",
        "api/v1/datasets/<uuid:dataset_id>/complete/",
        "api/v1/templates/<slug:name>/",
        "api/v1/ssh-keys/<int:key_id>/",
        "api/v1/notifications/deliveries/<int:delivery_id>/",
    ):
        assert expected in routes
