"""Becoming a provider from the web: the profile, a join token for the first host with the host's
requirements, and payout onboarding (manual without Stripe; Stripe Connect through the real SDK
where keys are set)."""

from __future__ import annotations

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs

import pytest
from django.test import Client

from accounts.services import token_hash
from billing.models import Account, AccountKind
from billing.stripe_adapter import connect_account_params
from marketplace.models import Provider
from provisioning.models import JoinToken
from tests.billing.conftest import localstripe_base, stripe_on  # noqa: F401
from tests.factories import ProviderFactory, UserFactory

pytestmark = pytest.mark.django_db

PAGE = "/provider/onboard/"


@pytest.fixture
def person(client, user) -> Client:
    client.force_login(user)
    return client


def _provider_rows() -> tuple[int, int]:
    return Provider.objects.count(), Account.objects.filter(kind=AccountKind.PROVIDER).count()


def test_anonymous_visitors_are_sent_to_sign_in(client):
    page = client.get(PAGE)
    assert page.status_code == 302 and page["Location"].startswith("/accounts/login/")


def test_a_customer_becomes_a_provider_and_sees_the_next_steps(person, user):
    # Given a signed-in customer who owns no provider: the form and the host requirements
    page = person.get(PAGE).content.decode()
    assert 'id="provider-form"' in page
    for needed in ("NVIDIA driver", "NVIDIA Container Toolkit", "pip install 'gpumarket[agent]'"):
        assert needed in page
    assert "Become a provider" in person.get("/").content.decode()  # in the navigation

    # When they name their provider
    done = person.post(PAGE, {"name": "  Acme   GPUs "})

    # Then the profile and its earnings account exist, and the page shows the next steps
    assert (done.status_code, done["Location"]) == (302, PAGE)
    provider = Provider.objects.get(owner=user)
    assert provider.name == "Acme GPUs" and not provider.is_platform
    assert Account.objects.filter(kind=AccountKind.PROVIDER, provider=provider).count() == 1
    page = person.get(PAGE).content.decode()
    assert 'id="join-form"' in page and 'id="provider-form"' not in page
    assert 'href="/provider/"' in page
    # A second post changes nothing: one provider per page flow
    assert person.post(PAGE, {"name": "Second"}).status_code == 200
    assert Provider.objects.filter(owner=user).count() == 1


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("", "needs a name"),
        ("   ", "needs a name"),
        ("x" * 121, "at most 120"),
        ("TAKEN", "exists"),
    ],
)
def test_a_bad_provider_name_is_400_naming_it_and_creates_nothing(person, name, why):
    ProviderFactory(name="taken")
    before = _provider_rows()
    page = person.post(PAGE, {"name": name})
    assert page.status_code == 400
    html = page.content.decode()
    assert "name:" in html and why in html
    assert _provider_rows() == before


@pytest.fixture
def onboarded(person, user) -> Provider:
    person.post(PAGE, {"name": "Acme"})
    return Provider.objects.get(owner=user)


def test_the_join_token_step_prints_the_agents_command_once(person, onboarded):
    page = person.post(
        f"{PAGE}join-token/",
        {"region": "eu-west", "price_per_gpu_hour": "1.20", "min_bid_per_gpu_hour": "0.60"},
    )
    assert page.status_code == 200
    command = re.search(r'id="join-command">([^<]+)<', page.content.decode()).group(1)
    raw = re.fullmatch(
        r"gpumarket-agent --server http://testserver --join-token (gpj_\S+)", command
    ).group(1)
    token = JoinToken.objects.get(provider=onboarded)
    # Stored hashed, with what the form said
    assert token.key_hash == token_hash(raw) and raw not in token.key_hash
    assert (token.region, str(token.price_per_gpu_hour), str(token.min_bid_per_gpu_hour)) == (
        "eu-west",
        "1.2000",
        "0.6000",
    )


@pytest.mark.parametrize(
    ("form", "field"),
    [
        (
            {"region": "eu west!", "price_per_gpu_hour": "1", "min_bid_per_gpu_hour": "0.5"},
            "region",
        ),
        ({"region": "eu", "price_per_gpu_hour": "lots", "min_bid_per_gpu_hour": "0.5"}, "price"),
        ({"region": "eu", "price_per_gpu_hour": "1", "min_bid_per_gpu_hour": "2"}, "min_bid"),
        ({"region": "eu", "price_per_gpu_hour": "0", "min_bid_per_gpu_hour": "0"}, "price"),
    ],
)
def test_a_bad_join_token_form_is_400_naming_the_field_and_creates_nothing(
    person, onboarded, form, field
):
    page = person.post(f"{PAGE}join-token/", form)
    assert page.status_code == 400
    assert re.search(rf"{field}\w*:", page.content.decode())
    assert 'id="join-command"' not in page.content.decode()
    assert JoinToken.objects.count() == 0


def test_without_a_provider_the_later_steps_send_back_to_the_first(person):
    for step in ("join-token/", "payouts/"):
        page = person.post(f"{PAGE}{step}", {"region": "eu"})
        assert (page.status_code, page["Location"]) == (302, PAGE)
    assert JoinToken.objects.count() == 0


def test_another_owners_provider_is_never_the_one_onboarded(person, user):
    theirs = ProviderFactory(owner=UserFactory())
    person.post(PAGE, {"name": "Mine"})
    person.post(
        f"{PAGE}join-token/",
        {"region": "eu", "price_per_gpu_hour": "1", "min_bid_per_gpu_hour": "0.5"},
    )
    assert not JoinToken.objects.filter(provider=theirs).exists()
    assert JoinToken.objects.get().provider.owner == user


# Payouts.


def test_without_stripe_payouts_are_manual_and_the_page_says_so(person, onboarded, settings):
    settings.STRIPE_SECRET_KEY = ""
    page = person.get(PAGE).content.decode()
    assert 'id="payouts-manual"' in page and "Payouts are manual" in page
    assert 'id="payouts-start"' not in page
    refused = person.post(f"{PAGE}payouts/")
    assert refused.status_code == 503 and "not enabled" in refused.content.decode()
    account = Account.objects.get(provider=onboarded)
    assert account.stripe_connect_account_id == ""


def test_the_connect_account_request_is_created_once_per_account():
    params, options = connect_account_params(account_id=7, provider_id=3, email="p@example.com")
    assert params == {
        "type": "express",
        "email": "p@example.com",
        "capabilities": {"transfers": {"requested": True}},
        "metadata": {"account_id": "7", "provider_id": "3"},
    }
    assert options == {"idempotency_key": "connect-account:7"}


@pytest.mark.usefixtures("stripe_on")
def test_with_stripe_connect_the_page_offers_stripe_and_a_refusal_is_shown(
    settings, person, onboarded
):
    # localstripe has no Connect accounts: it refuses the account as Stripe refuses a platform
    # without Connect. The real SDK makes the call; the refusal is a 400 naming Stripe, and
    # no destination is stored.
    settings.STRIPE_CONNECT_ENABLED = True
    page = person.get(PAGE).content.decode()
    assert 'id="payouts-start"' in page and 'id="payouts-manual"' not in page
    refused = person.post(f"{PAGE}payouts/")
    assert refused.status_code == 400
    assert "stripe: Stripe refused the payout set-up" in refused.content.decode()
    assert Account.objects.get(provider=onboarded).stripe_connect_account_id == ""


@pytest.mark.usefixtures("stripe_on")
def test_a_provider_with_a_connect_account_continues_with_it(settings, person, onboarded):
    settings.STRIPE_CONNECT_ENABLED = True
    Account.objects.filter(provider=onboarded).update(stripe_connect_account_id="acct_123")
    page = person.get(PAGE).content.decode()
    assert "acct_123" in page and "Continue payout set-up with Stripe" in page


class _StripeConnectStandIn(BaseHTTPRequestHandler):
    """Answers the two Connect calls localstripe lacks (POST /v1/accounts, /v1/account_links)
    in the shape of Stripe's API reference, and records each request as the SDK sent it."""

    def do_POST(self):
        body = parse_qs(self.rfile.read(int(self.headers["Content-Length"] or 0)).decode())
        self.server.seen.append((self.path, self.headers.get("Idempotency-Key"), body))
        if self.server.fail:
            self._answer(500, {"error": {"type": "api_error", "message": "try later"}})
        elif self.path == "/v1/accounts":
            self._answer(200, {"id": "acct_1Onboard", "object": "account", "type": "express"})
        elif self.path == "/v1/account_links":
            url = f"https://connect.stripe.com/setup/e/{body['account'][0]}/{len(self.server.seen)}"
            self._answer(200, {"object": "account_link", "url": url, "created": 1, "expires_at": 2})
        else:
            self._answer(404, {"error": {"type": "invalid_request_error", "message": "no"}})

    def _answer(self, status: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def connect_server(settings):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _StripeConnectStandIn)
    server.seen, server.fail = [], False
    threading.Thread(target=server.serve_forever, daemon=True).start()
    settings.STRIPE_API_BASE = f"http://127.0.0.1:{server.server_port}"
    settings.STRIPE_SECRET_KEY = "sk_test_connect"
    settings.STRIPE_CONNECT_ENABLED = True
    settings.STRIPE_MAX_NETWORK_RETRIES = 1
    yield server
    server.shutdown()


def test_payout_onboarding_creates_the_connect_account_once_and_follows_stripes_link(
    connect_server, person, user, onboarded
):
    # When the provider asks to set up payouts
    first = person.post(f"{PAGE}payouts/")

    # Then the browser goes to Stripe's onboarding link for a new Express account
    assert first.status_code == 302
    assert first["Location"].startswith("https://connect.stripe.com/setup/e/acct_1Onboard/")
    account = Account.objects.get(provider=onboarded)
    assert account.stripe_connect_account_id == "acct_1Onboard"
    (create_path, create_key, create), (link_path, _, link) = connect_server.seen
    assert (create_path, create_key) == ("/v1/accounts", f"connect-account:{account.pk}")
    assert create["type"] == ["express"] and create["email"] == [user.email]
    assert create["capabilities[transfers][requested]"] == ["true"]
    assert create["metadata[provider_id]"] == [str(onboarded.pk)]
    assert link_path == "/v1/account_links"
    assert link["account"] == ["acct_1Onboard"] and link["type"] == ["account_onboarding"]
    assert link["return_url"] == ["http://testserver/provider/onboard/?payouts=returned"]
    assert link["refresh_url"] == ["http://testserver/provider/onboard/"]

    # A second click (or Stripe's refresh) makes a new link for the same account
    again = person.post(f"{PAGE}payouts/")
    assert again.status_code == 302 and again["Location"] != first["Location"]
    assert [path for path, _, _ in connect_server.seen] == [
        "/v1/accounts",
        "/v1/account_links",
        "/v1/account_links",
    ]
    back = person.get(f"{PAGE}?payouts=returned").content.decode()
    assert "Back from Stripe" in back and "acct_1Onboard" in back


def test_payout_onboarding_while_stripe_fails_is_503_and_stores_nothing(
    connect_server, person, onboarded
):
    connect_server.fail = True
    page = person.post(f"{PAGE}payouts/")
    assert page.status_code == 503 and "cannot be reached" in page.content.decode()
    # The SDK retried once with the same idempotency key, then gave up
    assert [(p, k) for p, k, _ in connect_server.seen] == [
        ("/v1/accounts", f"connect-account:{Account.objects.get(provider=onboarded).pk}")
    ] * 2
    assert Account.objects.get(provider=onboarded).stripe_connect_account_id == ""
