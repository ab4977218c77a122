"""The web pages as the server renders them: who may see what, and bad input named with a 4xx."""

from __future__ import annotations

import pytest
from django.test import Client

from accounts.services import api_token_create
from billing.services.ledger import account_adjust, account_for_team
from marketplace.models import Rental
from tests.factories import UserFactory, personal_team

pytestmark = pytest.mark.django_db


@pytest.fixture
def browser_client(client, user):
    client.force_login(user)
    return client


def test_the_offers_page_lists_free_gpus_to_anyone_and_filters_them(client, make_node):
    make_node(card="h100-sxm5-80gb", gpus=8, price="2.10", hostname="h100-host")
    make_node(card="rtx4090-24gb", gpus=2, price="0.40", hostname="cheap-host")
    page = client.get("/")
    assert page.status_code == 200
    html = page.content.decode()
    assert "h100-host" in html and "cheap-host" in html
    assert html.index("cheap-host") < html.index("h100-host")  # cheapest first
    only_h100 = client.get("/", {"gpu_model": "h100-sxm5-80gb", "max_price": "", "region": ""})
    assert "h100-host" in only_h100.content.decode()
    assert "cheap-host" not in only_h100.content.decode()
    none = client.get("/", {"max_price": "0.10"})
    assert none.status_code == 200 and "No GPUs match" in none.content.decode()


@pytest.mark.parametrize(
    ("query", "field"),
    [
        ({"max_price": "cheap"}, "max_price"),
        ({"min_free_gpus": "0"}, "min_free_gpus"),
        ({"ordering": "DROP TABLE"}, "ordering"),
        ({"colour": "red"}, "colour"),
    ],
)
def test_a_bad_offer_filter_is_400_naming_the_field(client, make_node, query, field):
    make_node()
    page = client.get("/", query)
    assert page.status_code == 400
    assert f"{field}:" in page.content.decode()
    assert 'id="offers"' not in page.content.decode()


@pytest.mark.parametrize(
    "path", ["/rentals/", "/rentals/new/", "/tokens/", "/billing/", "/provider/"]
)
def test_account_pages_send_anonymous_visitors_to_log_in(client, path):
    page = client.get(path)
    assert page.status_code == 302
    assert page["Location"].startswith("/accounts/login/?next=")


def test_the_login_page_logs_in_and_lands_on_the_page_asked_for(client, user):
    assert client.get("/accounts/login/").status_code == 200
    page = client.post(
        "/accounts/login/?next=/rentals/",
        {"login": user.username, "password": "pw-not-secret", "next": "/rentals/"},
    )
    assert (page.status_code, page["Location"]) == (302, "/rentals/")
    wrong = Client().post("/accounts/login/", {"login": user.username, "password": "nope"})
    assert wrong.status_code == 200 and "are not correct" in wrong.content.decode()


def test_a_rental_page_shows_its_history_and_another_customers_id_is_404(
    browser_client, user, make_node, rent
):
    make_node(gpus=8)
    mine = rent(2, name="my-run")
    theirs = rent(1, customer=UserFactory(), name="their-run")
    page = browser_client.get(f"/rentals/{mine.pk}/")
    assert page.status_code == 200
    html = page.content.decode()
    assert "my-run" in html and "PENDING" in html and 'id="cancel"' in html
    assert browser_client.get(f"/rentals/{theirs.pk}/").status_code == 404
    listing = browser_client.get("/rentals/").content.decode()
    assert "my-run" in listing and "their-run" not in listing
    assert browser_client.get("/rentals/", {"status": "BOGUS"}).status_code == 400
    assert "my-run" in browser_client.get("/rentals/", {"status": "pending"}).content.decode()
    assert "my-run" not in browser_client.get("/rentals/", {"status": "running"}).content.decode()
    assert Rental.objects.count() == 2


def test_the_rental_page_says_its_network_and_the_form_asks_for_it(browser_client, make_node, rent):
    make_node(gpus=8)
    internet, internal = rent(1, name="online"), rent(1, name="offline", network="internal")
    html = browser_client.get(f"/rentals/{internet.pk}/").content.decode()
    assert '<dd id="network">internet <span class="muted">(public addresses only' in html
    html = browser_client.get(f"/rentals/{internal.pk}/").content.decode()
    assert '<dd id="network">internal <span class="muted">(no network)' in html
    form = browser_client.get("/rentals/new/").content.decode()
    assert '<select id="r-network">' in form and '<option value="internal">' in form


def test_the_tokens_page_lists_only_your_tokens_and_never_a_secret(browser_client, user):
    _, mine = api_token_create(user=user, team=personal_team(user), name="laptop")
    _, theirs = api_token_create(
        user=(them := UserFactory()), team=personal_team(them), name="someone-elses"
    )
    html = browser_client.get("/tokens/").content.decode()
    assert "laptop" in html and "someone-elses" not in html
    assert mine not in html and theirs not in html


def test_the_billing_page_shows_the_balance_and_ledger(browser_client, user):
    account = account_for_team(team=personal_team(user))
    account_adjust(
        account_id=account.pk, amount_micros=12_340_000, reason="welcome credit", actor=None
    )
    page = browser_client.get("/billing/")
    assert page.status_code == 200
    html = page.content.decode()
    assert "$12.34" in html and "welcome credit" in html


def test_the_provider_page_shows_only_the_owners_nodes(browser_client, make_node, provider):
    from django.test import Client

    make_node(hostname="owned-host")
    owner = Client()
    owner.force_login(provider.owner)
    html = owner.get("/provider/").content.decode()
    assert "owned-host" in html and provider.name in html
    stranger = browser_client.get("/provider/").content.decode()
    assert "owned-host" not in stranger and "do not own a provider" in stranger


@pytest.mark.parametrize(
    "path", ["/", "/api/v1/offers/", "/api/v1/rentals/", "/api/v1/billing/ledger/"]
)
def test_an_offset_past_any_page_is_400_naming_it(browser_client, path):
    r = browser_client.get(path, {"offset": "99999999999999999999"})
    assert r.status_code == 400
    assert "offset" in r.content.decode()
