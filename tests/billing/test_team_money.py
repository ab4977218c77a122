"""Only a team's owners and billing members move its money: top-ups (API and page), statements,
the ledger. Every member sees the balance, which decides whether they can rent."""

from __future__ import annotations

import pytest
from rest_framework.test import APIClient

from accounts.models import TeamRole
from accounts.services import api_token_create, invitation_accept, invitation_create, team_create
from billing.models import Account, TopUp
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db


def _join(team, owner, role) -> object:
    person = UserFactory()
    sent = invitation_create(
        team=team, actor=owner, email=person.email, role=role, base_url="http://testserver"
    )
    invitation_accept(user=person, team_id=team.pk, raw=sent.link.rstrip("/").rsplit("/", 1)[1])
    return person


def _api(person, team) -> APIClient:
    client = APIClient()
    client.credentials(
        HTTP_AUTHORIZATION=f"Bearer {api_token_create(user=person, team=team, name='t')[1]}"
    )
    return client


@pytest.fixture
def acme(user):
    return team_create(owner=user, name="acme")


@pytest.mark.parametrize(
    "path",
    [
        "/api/v1/billing/topups/",
        "/api/v1/billing/invoices/",
        "/api/v1/billing/ledger/",
    ],
)
def test_a_member_is_refused_the_money_endpoints_and_sees_the_balance(acme, user, path):
    member = _api(_join(acme, user, TeamRole.MEMBER), acme)
    refused = member.get(path)
    assert refused.status_code == 403
    assert refused.json()["detail"] == (
        "only the team's owners and billing members manage its money"
    )
    assert member.get("/api/v1/billing/account/").status_code == 200


def test_a_member_cannot_top_up_and_nothing_is_started(stripe_on, acme, user):
    member = _api(_join(acme, user, TeamRole.MEMBER), acme)
    r = member.post("/api/v1/billing/topups/", {"amount_cents": 2000}, format="json")
    assert r.status_code == 403
    assert TopUp.objects.count() == 0


@pytest.mark.parametrize("role", [TeamRole.BILLING, TeamRole.OWNER])
def test_billing_members_and_owners_top_up_the_teams_balance(stripe_on, acme, user, role):
    person = user if role == TeamRole.OWNER else _join(acme, user, role)
    r = _api(person, acme).post("/api/v1/billing/topups/", {"amount_cents": 2000}, format="json")
    assert r.status_code == 201 and r.json()["client_secret"]
    (topup,) = TopUp.objects.all()
    assert topup.account.team_id == acme.pk and topup.amount_cents == 2000


def test_the_top_up_page_is_refused_to_a_member_and_open_to_billing(stripe_on, client, acme, user):
    member, billing = _join(acme, user, TeamRole.MEMBER), _join(acme, user, TeamRole.BILLING)
    for person, status in ((member, 403), (billing, 200)):
        client.force_login(person)
        client.post("/teams/switch/", {"team": acme.pk})
        page = client.get("/billing/topup/")
        assert page.status_code == status
        html = page.content.decode()
        refused = 'id="refused"' in html
        assert refused is (status == 403)
        # The billing page shows the balance to both, statements and the ledger to billing only
        account = client.get("/billing/").content.decode()
        assert 'id="balance"' in account
        assert ('id="ledger"' in account) is (status == 200)


def test_a_member_sees_the_teams_budget_but_only_billing_members_set_it(acme, user):
    member = _api(_join(acme, user, TeamRole.MEMBER), acme)
    billing = _api(_join(acme, user, TeamRole.BILLING), acme)
    assert member.get("/api/v1/billing/budgets/").status_code == 200
    refused = member.patch("/api/v1/billing/budgets/", {"monthly_budget": "50.00"}, format="json")
    assert refused.status_code == 403
    assert Account.objects.filter(team=acme, monthly_budget_micros__isnull=False).count() == 0
    done = billing.patch("/api/v1/billing/budgets/", {"monthly_budget": "50.00"}, format="json")
    assert done.status_code == 200
    assert Account.objects.get(team=acme).monthly_budget_micros == 50_000_000
    assert member.get("/api/v1/billing/budgets/").json()["monthly_budget_micros"] == 50_000_000
