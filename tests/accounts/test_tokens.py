"""API tokens: shown once, stored hashed, scoped to their owner; auth failures are 401."""

from datetime import timedelta

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from accounts.models import ApiToken
from accounts.services import api_token_create, token_hash
from tests.factories import personal_team

pytestmark = pytest.mark.django_db


def _bearer(raw):
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {raw}")
    return client


def test_created_token_is_shown_once_and_stored_hashed(auth_api, user):
    r = auth_api.post("/api/v1/tokens/", {"name": "ci"}, format="json")
    assert r.status_code == 201
    raw = r.json()["token"]
    stored = ApiToken.objects.get(pk=r.json()["id"])
    assert stored.key_hash == token_hash(raw)
    assert raw not in {stored.key_hash, stored.prefix}
    assert raw.startswith(f"gpm_{stored.prefix}_")
    listed = auth_api.get("/api/v1/tokens/").json()
    assert {t["name"] for t in listed} == {"tests", "ci"}
    assert all("token" not in t for t in listed)
    assert _bearer(raw).get("/api/v1/me/").json()["username"] == user.username


def test_missing_token_is_401(api):
    r = api.get("/api/v1/me/")
    assert r.status_code == 401


@pytest.mark.parametrize(
    "header",
    ["Bearer gpm_deadbeef_wrong", "Bearer", "Bearer a b", "Bearer \u00e9"],
)
def test_wrong_or_malformed_token_is_401(header):
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=header)
    assert client.get("/api/v1/me/").status_code == 401


def test_revoked_token_is_401(user):
    token, raw = api_token_create(user=user, team=personal_team(user), name="old")
    client = _bearer(raw)
    assert client.get("/api/v1/me/").status_code == 200
    assert client.post(f"/api/v1/tokens/{token.pk}/revoke/").status_code == 200
    assert client.get("/api/v1/me/").status_code == 401


def test_expired_token_is_401(user):
    token, raw = api_token_create(
        user=user,
        team=personal_team(user),
        name="short",
        expires_at=timezone.now() + timedelta(minutes=1),
    )
    ApiToken.objects.filter(pk=token.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    assert _bearer(raw).get("/api/v1/me/").status_code == 401


def test_another_accounts_token_is_404_and_unchanged(auth_api, db):
    from tests.factories import UserFactory

    other_token, _ = api_token_create(
        user=(them := UserFactory()), team=personal_team(them), name="theirs"
    )
    r = auth_api.post(f"/api/v1/tokens/{other_token.pk}/revoke/")
    assert r.status_code == 404
    other_token.refresh_from_db()
    assert other_token.revoked_at is None
    assert all(t["id"] != other_token.pk for t in auth_api.get("/api/v1/tokens/").json())


def test_token_without_name_is_400_and_nothing_stored(auth_api):
    before = ApiToken.objects.count()
    r = auth_api.post("/api/v1/tokens/", {"name": "  "}, format="json")
    assert r.status_code == 400
    assert "name" in r.json()
    assert ApiToken.objects.count() == before


def test_the_token_read_at_each_request_is_what_the_orm_reads(user):
    """The authentication reads a token, its user, team and membership in one hand-built
    statement: every field of each comes back as the ORM gives it."""
    from accounts import selectors
    from accounts.models import Membership

    team = personal_team(user)
    token, raw = api_token_create(
        user=user, team=team, name="t", expires_at=timezone.now() + timedelta(days=1)
    )
    ApiToken.objects.filter(pk=token.pk).update(last_used_at=timezone.now())
    read = selectors.api_token_authenticating(key_hash=token_hash(raw))
    membership = Membership.objects.get(team=team, user=user)
    for got, want in (
        (read, ApiToken.objects.get(pk=token.pk)),
        (read.user, user.__class__.objects.get(pk=user.pk)),
        (read.team, team.__class__.objects.get(pk=team.pk)),
        (read.membership, membership),
    ):
        for field in want._meta.concrete_fields:
            assert getattr(got, field.attname) == getattr(want, field.attname), field.name
        assert not got._state.adding
    assert read.membership.user is read.user and read.membership.team is read.team
    assert selectors.api_token_authenticating(key_hash=token_hash(raw + "x")) is None
    membership.delete()
    assert selectors.api_token_authenticating(key_hash=token_hash(raw)).membership is None
