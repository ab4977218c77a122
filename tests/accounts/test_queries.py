"""The hand-written statement of accounts/queries.py against the same question asked through
the ORM, on rows made by the real services."""

from __future__ import annotations

import pytest

from accounts import queries
from accounts.models import ApiToken, Membership
from accounts.services import api_token_create, token_hash
from tests.factories import personal_team

pytestmark = pytest.mark.django_db


def _fields(obj) -> dict:
    return {f.attname: getattr(obj, f.attname) for f in obj._meta.concrete_fields}


def test_api_token_with_membership_reads_the_rows_the_orm_reads(user):
    team = personal_team(user)
    token, raw = api_token_create(user=user, team=team, name="ci")
    found, found_user, found_team, membership = queries.api_token_with_membership(
        key_hash=token_hash(raw)
    )
    assert _fields(found) == _fields(ApiToken.objects.get(pk=token.pk))
    assert (_fields(found_user), _fields(found_team)) == (_fields(user), _fields(team))
    assert _fields(membership) == _fields(Membership.objects.get(user=user, team=team))
    Membership.objects.filter(user=user, team=team).delete()
    assert queries.api_token_with_membership(key_hash=token_hash(raw))[3] is None
    assert queries.api_token_with_membership(key_hash="0" * 64) is None
