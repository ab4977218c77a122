"""Stripe through the real SDK against localstripe: top-ups, signed webhooks, refunds, payouts."""

from __future__ import annotations

import json
import time
import uuid

import pytest
import requests
from django.db.models import Sum

from billing import stripe_adapter
from billing.models import (
    Account,
    AccountKind,
    EntryKind,
    LedgerEntry,
    MoneyOutStatus,
    Payout,
    PayoutMethod,
    Refund,
    StripeEvent,
    TopUp,
    TopUpStatus,
)
from billing.services import (
    account_adjust,
    account_for_provider,
    account_for_team,
    payments_retry_pending,
    payout_create,
    refund_create,
    topup_create,
)
from core.errors import Conflict, PaymentRequired
from tests.billing.conftest import WEBHOOK_SECRET, signed, stripe_events, usd
from tests.factories import UserFactory, personal_team

pytestmark = pytest.mark.django_db

WEBHOOK = "/billing/stripe/webhook/"


def _post(client, body: bytes, header: str | None):
    extra = {"HTTP_STRIPE_SIGNATURE": header} if header else {}
    return client.post(WEBHOOK, data=body, content_type="application/json", **extra)


def _browser_pays(stripe_on, intent_id: str, card: str = "pm_card_visa") -> None:
    """What Stripe.js does in the customer's browser: attach the card, confirm."""
    stripe_on.v1.payment_intents.update(intent_id, params={"payment_method": card})
    stripe_on.v1.payment_intents.confirm(intent_id)


def _state(user) -> tuple:
    account = account_for_team(team=personal_team(user))
    return (
        account.balance_micros,
        LedgerEntry.objects.count(),
        StripeEvent.objects.count(),
        list(TopUp.objects.order_by("created_at").values_list("status", flat=True)),
    )


def test_a_card_top_up_is_credited_once_by_its_signed_webhook(stripe_on, auth_api, user, client):
    # Given a top-up started through the API
    r = auth_api.post("/api/v1/billing/topups/", {"amount_cents": 2500}, format="json")
    assert r.status_code == 201
    body = r.json()
    assert body["client_secret"].startswith("pi_") and body["status"] == "pending"
    assert body["publishable_key"] == "pk_test_localstripe"
    topup = TopUp.objects.get(pk=body["id"])
    # When the browser pays and Stripe sends payment_intent.succeeded
    _browser_pays(stripe_on, topup.payment_intent_id)
    (event,) = stripe_events(stripe_on, "payment_intent.succeeded", topup.payment_intent_id)
    assert account_for_team(team=personal_team(user)).balance_micros == 0
    r = _post(client, *signed(event))
    # Then the account holds $25 exactly, and the top-up succeeded
    assert r.status_code == 200 and r.json()["outcome"] == "credited"
    assert account_for_team(team=personal_team(user)).balance_micros == usd("25.00")
    topup.refresh_from_db()
    assert topup.status == TopUpStatus.SUCCEEDED
    # A replay (same event id, freshly signed) changes nothing
    before = _state(user)
    r = _post(client, *signed(event))
    assert r.json() == {"received": True, "duplicate": True}
    assert _state(user) == before
    entry = LedgerEntry.objects.get(kind=EntryKind.TOPUP)
    assert (entry.key, entry.amount_micros) == (f"topup:{topup.payment_intent_id}", 25_000_000)


def test_a_saved_card_settles_at_once_and_its_webhook_is_then_a_no_op(stripe_on, user, client):
    started = topup_create(
        team=personal_team(user), user=user, amount_cents=1000, payment_method="pm_card_visa"
    )
    assert started.topup.status == TopUpStatus.SUCCEEDED
    assert account_for_team(team=personal_team(user)).balance_micros == usd("10.00")
    (event,) = stripe_events(stripe_on, "payment_intent.succeeded", started.topup.payment_intent_id)
    r = _post(client, *signed(event))
    assert r.json()["outcome"] == "already credited"
    assert account_for_team(team=personal_team(user)).balance_micros == usd("10.00")


def test_a_declined_card_is_402_and_credits_nothing(stripe_on, user):
    with pytest.raises(PaymentRequired, match="declined"):
        topup_create(
            team=personal_team(user),
            user=user,
            amount_cents=1000,
            payment_method="pm_card_chargeCustomerFail",
        )
    topup = TopUp.objects.get()
    assert topup.status == TopUpStatus.FAILED
    assert not LedgerEntry.objects.exists()


def test_the_webhook_that_arrives_before_our_call_returns_still_credits(stripe_on, user, client):
    # The intent id is not stored yet (our call has not returned): the metadata finds it.
    started = topup_create(team=personal_team(user), user=user, amount_cents=700)
    intent_id = started.topup.payment_intent_id
    TopUp.objects.filter(pk=started.topup.pk).update(payment_intent_id=None)
    _browser_pays(stripe_on, intent_id)
    (event,) = stripe_events(stripe_on, "payment_intent.succeeded", intent_id)
    assert _post(client, *signed(event)).json()["outcome"] == "credited"
    assert TopUp.objects.get().payment_intent_id == intent_id
    assert account_for_team(team=personal_team(user)).balance_micros == usd("7.00")


@pytest.mark.parametrize(
    "forge",
    [
        "wrong_secret",
        "tampered_body",
        "no_header",
        "stale_timestamp",
        "garbage_header",
        "not_json",
    ],
)
def test_a_forged_webhook_is_400_and_changes_nothing(stripe_on, user, client, forge):
    started = topup_create(team=personal_team(user), user=user, amount_cents=900)
    _browser_pays(stripe_on, started.topup.payment_intent_id)
    (event,) = stripe_events(stripe_on, "payment_intent.succeeded", started.topup.payment_intent_id)
    body, header = signed(event)
    if forge == "wrong_secret":
        body, header = signed(event, secret="whsec_not_ours")
    elif forge == "tampered_body":
        event["data"]["object"]["amount"] = event["data"]["object"]["amount_received"] = 10**8
        body = json.dumps(event).encode()
    elif forge == "no_header":
        header = None
    elif forge == "stale_timestamp":
        body, header = signed(event, timestamp=int(time.time()) - 3600)
    elif forge == "garbage_header":
        header = "t=abc,v1=zzz"
    elif forge == "not_json":
        body, header = signed(b"not json")
    before = _state(user)
    r = _post(client, body, header)
    assert r.status_code == 400
    assert r.json() == {"detail": "invalid signature"}
    assert _state(user) == before


def test_a_refund_to_the_card_goes_through_stripe_and_debits_the_ledger(stripe_on, user):
    started = topup_create(
        team=personal_team(user), user=user, amount_cents=5000, payment_method="pm_card_visa"
    )
    account = account_for_team(team=personal_team(user))
    refund = refund_create(
        account_id=account.pk,
        amount_micros=usd("12.34"),
        reason="customer asked",
        actor=None,
        topup_id=started.topup.pk,
    )
    assert refund.status == MoneyOutStatus.SUCCEEDED
    remote = stripe_on.v1.refunds.retrieve(refund.stripe_refund_id)
    assert (remote.amount, remote.payment_intent) == (1234, started.topup.payment_intent_id)
    assert remote.metadata["refund_id"] == str(refund.pk)
    account.refresh_from_db()
    assert account.balance_micros == usd("37.66")
    # More than is left of the top-up, or than is available, is refused without a trace.
    before = _state(user)
    with pytest.raises(Conflict, match=r"\$37.66 of this top-up"):
        refund_create(
            account_id=account.pk,
            amount_micros=usd("40.00"),
            reason="too much",
            actor=None,
            topup_id=started.topup.pk,
        )
    assert _state(user) == before
    assert Refund.objects.count() == 1


def test_a_refund_beyond_the_available_balance_is_refused(stripe_on, user):
    account = account_for_team(team=personal_team(user))
    account_adjust(account_id=account.pk, amount_micros=usd("3.00"), reason="credit", actor=None)
    with pytest.raises(Conflict, match=r"only \$3.00 is available"):
        refund_create(account_id=account.pk, amount_micros=usd("3.01"), reason="x", actor=None)
    out_of_band = refund_create(
        account_id=account.pk, amount_micros=usd("3.00"), reason="returned by bank", actor=None
    )
    assert (out_of_band.status, out_of_band.topup) == (MoneyOutStatus.SUCCEEDED, None)
    account.refresh_from_db()
    assert account.balance_micros == 0


def test_a_refund_that_fails_later_is_credited_back_once(stripe_on, user, client):
    started = topup_create(
        team=personal_team(user), user=user, amount_cents=2000, payment_method="pm_card_visa"
    )
    account = account_for_team(team=personal_team(user))
    refund = refund_create(
        account_id=account.pk,
        amount_micros=usd("5.00"),
        reason="asked",
        actor=None,
        topup_id=started.topup.pk,
    )
    failed = {
        "id": "evt_refund_failed_1",
        "object": "event",
        "type": "refund.failed",
        "data": {
            "object": {
                "id": refund.stripe_refund_id,
                "object": "refund",
                "status": "failed",
                "failure_reason": "expired_or_canceled_card",
                "metadata": {"refund_id": str(refund.pk)},
            }
        },
    }
    assert _post(client, *signed(failed)).json()["outcome"] == "refund failed, credited back"
    assert _post(client, *signed(failed)).json()["duplicate"] is True
    account.refresh_from_db()
    assert account.balance_micros == usd("20.00")
    refund.refresh_from_db()
    assert refund.status == MoneyOutStatus.FAILED


def test_stripe_unreachable_is_retryable_and_the_retry_uses_the_same_key(stripe_on, settings, user):
    started = topup_create(
        team=personal_team(user), user=user, amount_cents=3000, payment_method="pm_card_visa"
    )
    account = account_for_team(team=personal_team(user))
    good_base = settings.STRIPE_API_BASE
    settings.STRIPE_API_BASE = "http://127.0.0.1:9"  # nothing listens on the discard port
    settings.STRIPE_MAX_NETWORK_RETRIES = 0
    refund = refund_create(
        account_id=account.pk,
        amount_micros=usd("10.00"),
        reason="asked",
        actor=None,
        topup_id=started.topup.pk,
    )
    # The money is held (debited) while the refund waits; the error is visible.
    assert refund.status == MoneyOutStatus.PENDING and "refund.create" in refund.error
    account.refresh_from_db()
    assert account.balance_micros == usd("20.00")
    settings.STRIPE_API_BASE = good_base
    assert payments_retry_pending(min_age_s=-60) == 1
    refund.refresh_from_db()
    assert refund.status == MoneyOutStatus.SUCCEEDED and refund.stripe_refund_id


def test_without_stripe_keys_top_ups_are_503_and_ops_credits_work(stripe_off, auth_api, user):
    r = auth_api.post("/api/v1/billing/topups/", {"amount_cents": 2500}, format="json")
    assert r.status_code == 503
    assert r.json()["code"] == "payments_unavailable"
    assert not TopUp.objects.exists()
    account_adjust(
        account_id=account_for_team(team=personal_team(user)).pk,
        amount_micros=usd("50.00"),
        reason="invoice paid by bank transfer",
        actor=None,
    )
    assert auth_api.get("/api/v1/billing/account/").json()["available_micros"] == 50_000_000


def test_the_connect_transfer_is_exactly_what_stripe_expects():
    params, options = stripe_adapter.transfer_params(
        amount_cents=12345, currency="usd", destination="acct_123", payout_id="p-1"
    )
    assert params == {
        "amount": 12345,
        "currency": "usd",
        "destination": "acct_123",
        "transfer_group": "payout:p-1",
        "metadata": {"payout_id": "p-1"},
    }
    assert options == {"idempotency_key": "payout:p-1"}
    assert stripe_adapter.payment_intent_params(
        amount_cents=500,
        currency="usd",
        customer_id="cus_1",
        topup_id="t-1",
        account_id=7,
        payment_method="pm_1",
    ) == {
        "amount": 500,
        "currency": "usd",
        "customer": "cus_1",
        "payment_method_types": ["card"],
        "metadata": {"topup_id": "t-1", "account_id": "7"},
        "payment_method": "pm_1",
        "confirm": True,
        "off_session": True,
    }


def _provider_with_earnings(provider, amount: str) -> Account:
    account = account_for_provider(provider=provider)
    account_adjust(account_id=account.pk, amount_micros=usd(amount), reason="earned", actor=None)
    account.refresh_from_db()
    return account


def test_a_payout_without_connect_is_recorded_for_ops(provider):
    account = _provider_with_earnings(provider, "12.345678")
    payout = payout_create(account_id=account.pk, actor=None, reason="monthly")
    # Whole cents leave; the fraction of a cent stays on the account.
    assert (payout.method, payout.status, payout.amount_micros) == (
        PayoutMethod.MANUAL,
        MoneyOutStatus.PENDING,
        12_340_000,
    )
    account.refresh_from_db()
    assert account.balance_micros == 5678


def test_a_connect_payout_refused_by_stripe_returns_the_money(stripe_on, settings, provider):
    # localstripe has no Connect: the transfer is refused, as a real account without the
    # capability would be, and the earnings go back on the provider's account.
    settings.STRIPE_CONNECT_ENABLED = True
    account = _provider_with_earnings(provider, "30.00")
    Account.objects.filter(pk=account.pk).update(stripe_connect_account_id="acct_test")
    payout = payout_create(account_id=account.pk, actor=None, reason="monthly")
    assert (payout.method, payout.status) == (PayoutMethod.STRIPE_CONNECT, MoneyOutStatus.FAILED)
    account.refresh_from_db()
    assert account.balance_micros == usd("30.00")
    assert list(
        LedgerEntry.objects.filter(account=account).order_by("id").values_list("kind", flat=True)
    ) == [EntryKind.ADJUSTMENT, EntryKind.PAYOUT, EntryKind.PAYOUT_REVERSAL]


def test_a_reversed_transfer_webhook_returns_the_payout_once(stripe_on, provider, client):
    account = _provider_with_earnings(provider, "8.00")
    payout = payout_create(account_id=account.pk, actor=None, reason="monthly")
    Payout.objects.filter(pk=payout.pk).update(
        method=PayoutMethod.STRIPE_CONNECT,
        status=MoneyOutStatus.SUCCEEDED,
        stripe_transfer_id="tr_1",
    )
    reversed_event = {
        "id": f"evt_{uuid.uuid4().hex}",
        "object": "event",
        "type": "transfer.reversed",
        "data": {"object": {"id": "tr_1", "object": "transfer", "metadata": {}}},
    }
    assert _post(client, *signed(reversed_event)).json()["outcome"] == (
        "payout returned to the provider"
    )
    assert _post(client, *signed(reversed_event)).json()["duplicate"] is True
    account.refresh_from_db()
    assert account.balance_micros == usd("8.00")
    assert Payout.objects.get().status == MoneyOutStatus.REVERSED


@pytest.mark.django_db(transaction=True)
def test_localstripe_delivers_the_signed_webhook_to_the_live_server(
    stripe_on, settings, live_server, user
):
    # Given localstripe sending payment_intent.succeeded to our endpoint, signed with our secret
    hook = f"{settings.STRIPE_API_BASE}/_config/webhooks/gpumarket-test"
    requests.post(
        hook,
        json={
            "url": f"{live_server.url}{WEBHOOK}",
            "secret": WEBHOOK_SECRET,
            "events": ["payment_intent.succeeded"],
        },
        timeout=5,
    ).raise_for_status()
    try:
        started = topup_create(team=personal_team(user), user=user, amount_cents=1500)
        _browser_pays(stripe_on, started.topup.payment_intent_id)
        deadline = time.monotonic() + 15
        while not LedgerEntry.objects.filter(kind=EntryKind.TOPUP).exists():
            assert time.monotonic() < deadline, "localstripe did not deliver the webhook"
            time.sleep(0.2)
    finally:
        # Later tests' events must not reach this (session-wide) live server.
        requests.post(
            hook,
            json={"url": f"{live_server.url}{WEBHOOK}", "secret": WEBHOOK_SECRET, "events": []},
            timeout=5,
        ).raise_for_status()
    assert account_for_team(team=personal_team(user)).balance_micros == usd("15.00")
    # (Events of earlier tests still in localstripe's one-second delivery delay may arrive too;
    # they name intents this database does not know and credit nothing.)
    intent_id = started.topup.payment_intent_id
    assert StripeEvent.objects.get(payload__data__object__id=intent_id).outcome == "credited"
    assert (
        LedgerEntry.objects.filter(account__kind=AccountKind.CUSTOMER).aggregate(
            s=Sum("amount_micros")
        )["s"]
        == 15_000_000
    )


def test_the_top_up_page_confirms_cards_with_stripe_elements(stripe_on, settings, client, user):
    client.force_login(user)
    r = client.get("/billing/topup/")
    assert r.status_code == 200
    html = r.content.decode()
    assert f"{settings.STRIPE_API_BASE}/js.stripe.com/v3/" in html
    assert 'Stripe("pk_test_localstripe")' in html and "/api/v1/billing/topups/" in html


def test_the_top_up_page_without_stripe_says_so(stripe_off, client, user):
    client.force_login(user)
    assert b"Card payments are not configured" in client.get("/billing/topup/").content
    client.logout()
    assert client.get("/billing/topup/").status_code == 302


def _tamper(event: dict, what: str, other_account: Account, other_topup: TopUp) -> dict:
    tampered = json.loads(json.dumps(event))
    tampered["id"] = f"evt_{uuid.uuid4().hex}"
    obj = tampered["data"]["object"]
    if what == "amount":
        obj["amount"] = obj["amount_received"] = 10**8
    elif what == "amount_received":
        obj["amount_received"] = obj["amount"] + 1
    elif what == "currency":
        obj["currency"] = "eur"
    elif what == "account":
        obj["metadata"]["account_id"] = str(other_account.pk)
    elif what == "topup":
        obj["metadata"]["topup_id"] = str(other_topup.pk)
    elif what == "no_metadata":
        obj["metadata"] = {}
    elif what == "customer":
        obj["customer"] = "cus_someone_else"
    return tampered


@pytest.mark.parametrize(
    "what",
    ["amount", "amount_received", "currency", "account", "topup", "no_metadata", "customer"],
)
def test_a_signed_event_that_does_not_match_our_top_up_credits_nothing(
    stripe_on, user, client, what
):
    # Given a $9.00 top-up paid in the browser, and another customer's pending top-up
    started = topup_create(team=personal_team(user), user=user, amount_cents=900)
    other = topup_create(
        team=personal_team(them := UserFactory()), user=them, amount_cents=900
    ).topup
    _browser_pays(stripe_on, started.topup.payment_intent_id)
    (event,) = stripe_events(stripe_on, "payment_intent.succeeded", started.topup.payment_intent_id)
    before = _state(user)
    # When a validly signed event about that intent says something our intent did not
    r = _post(client, *signed(_tamper(event, what, other.account, other)))
    # Then it is stored as suspicious, and nothing is credited to anyone
    assert r.status_code == 200
    assert r.json()["outcome"].startswith("suspicious: ")
    assert StripeEvent.objects.get(suspicious=True).outcome == r.json()["outcome"]
    balance, entries, events, statuses = before
    assert _state(user) == (balance, entries, events + 1, statuses)
    assert not LedgerEntry.objects.filter(kind=EntryKind.TOPUP).exists()
    other.refresh_from_db()
    assert other.status == TopUpStatus.PENDING
    # And Stripe's own event still credits exactly the top-up's amount
    assert _post(client, *signed(event)).json()["outcome"] == "credited"
    assert account_for_team(team=personal_team(user)).balance_micros == usd("9.00")


@pytest.mark.parametrize(
    "shape",
    [
        "object_without_id",
        "object_id_not_a_string",
        "event_without_id",
        "event_without_type",
        "no_data",
        "object_is_a_list",
        "metadata_not_strings",
        "amount_is_text",
        "refund_without_id",
    ],
)
def test_a_signed_event_of_the_wrong_shape_is_400_and_stores_nothing(
    stripe_on, user, client, shape
):
    started = topup_create(team=personal_team(user), user=user, amount_cents=900)
    _browser_pays(stripe_on, started.topup.payment_intent_id)
    (event,) = stripe_events(stripe_on, "payment_intent.succeeded", started.topup.payment_intent_id)
    obj = event["data"]["object"]
    if shape == "object_without_id":
        del obj["id"]
    elif shape == "object_id_not_a_string":
        obj["id"] = 12
    elif shape == "event_without_id":
        del event["id"]
    elif shape == "event_without_type":
        event["type"] = None
    elif shape == "no_data":
        del event["data"]
    elif shape == "object_is_a_list":
        event["data"]["object"] = [obj]
    elif shape == "metadata_not_strings":
        obj["metadata"] = {"topup_id": {"$ne": ""}}
    elif shape == "amount_is_text":
        obj["amount_received"] = "900"
    elif shape == "refund_without_id":
        event["type"] = "refund.failed"
        event["data"]["object"] = {"object": "refund", "status": "failed", "metadata": {}}
    before = _state(user)
    r = _post(client, *signed(event))
    assert r.status_code == 400
    assert r.json()["detail"].startswith("malformed event: ")
    assert _state(user) == before
