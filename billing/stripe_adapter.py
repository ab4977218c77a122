"""The one place that talks to Stripe, through the official SDK.

Every mutating call carries an idempotency key derived from our own row id, so a retry (by the
SDK's max_network_retries, or by our periodic retry task) can never charge, refund or transfer
twice. Timeouts come from settings.STRIPE_TIMEOUT_S; errors leave this module typed as
retryable (try again later with the same key) or permanent (do not retry), with Stripe's message.
Pointing settings.STRIPE_API_BASE at a Stripe-compatible server (localstripe) redirects the SDK.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import stripe
from django.conf import settings

from billing import conf
from core.metrics import STRIPE_ERRORS

log = logging.getLogger(__name__)


class StripeNotConfigured(Exception):
    """No secret key: card payments are off (ops credits still work)."""


class StripeRetryableError(Exception):
    """Network trouble, rate limiting or a Stripe-side error: retry with the same key."""


class StripePermanentError(Exception):
    """Stripe refused the request (card declined, invalid request, auth): do not retry."""

    def __init__(self, message: str, *, code: str | None = None, declined: bool = False) -> None:
        super().__init__(message)
        self.code = code
        # The customer's card said no (as opposed to a request we got wrong).
        self.declined = declined


class WebhookSignatureInvalid(Exception):
    """The payload was not signed by Stripe with our endpoint secret (or is too old)."""


class WebhookEventMalformed(Exception):
    """Signed with our secret, but not shaped like a Stripe event this server can read (no id,
    no type, no object or an object without an id, fields of the wrong type)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PaymentIntentInfo:
    """A PaymentIntent as Stripe described it, in our call's answer or in a webhook event."""

    id: str
    status: str
    amount: int | None
    # None while nothing is received; a compatible server may report only `amount`.
    amount_received: int | None
    currency: str | None
    customer: str | None
    metadata: dict[str, str]
    client_secret: str = ""


@dataclass(frozen=True, slots=True)
class RefundInfo:
    id: str
    status: str


def is_configured() -> bool:
    return bool(settings.STRIPE_SECRET_KEY)


def connect_enabled() -> bool:
    return is_configured() and bool(settings.STRIPE_CONNECT_ENABLED)


@lru_cache(maxsize=4)
def _client_for(api_key: str, api_base: str, timeout_s: float, retries: int) -> stripe.StripeClient:
    return stripe.StripeClient(
        api_key,
        base_addresses={"api": api_base} if api_base else None,
        max_network_retries=retries,
        http_client=stripe.RequestsClient(timeout=timeout_s),
    )


def _client() -> stripe.StripeClient:
    if not is_configured():
        raise StripeNotConfigured("STRIPE_SECRET_KEY is not set")
    return _client_for(
        settings.STRIPE_SECRET_KEY,
        settings.STRIPE_API_BASE,
        float(settings.STRIPE_TIMEOUT_S),
        conf.stripe_max_network_retries(),
    )


def _retryable(exc: stripe.StripeError) -> bool:
    """Worth retrying with the same key: the network, rate limits, Stripe's own 5xx, and
    Stripe's lock_timeout. A 4xx (even one with an unreadable body) will fail again."""
    if isinstance(exc, stripe.APIConnectionError | stripe.RateLimitError):
        return True
    if exc.code == "lock_timeout":
        return True
    return isinstance(exc, stripe.APIError) and (exc.http_status or 500) >= 500


def _call(operation: str, fn, params: dict[str, Any], idempotency_key: str):
    try:
        result = fn(params=params, options={"idempotency_key": idempotency_key})
    except stripe.StripeError as exc:
        retryable = _retryable(exc)
        STRIPE_ERRORS.labels(
            operation=operation, kind="retryable" if retryable else "permanent"
        ).inc()
        if retryable:
            log.warning(
                "stripe %s failed, retryable: %s", operation, exc, extra={"key": idempotency_key}
            )
            raise StripeRetryableError(f"{operation}: {exc.user_message or exc}") from exc
        log.warning("stripe %s refused: %s", operation, exc, extra={"key": idempotency_key})
        raise StripePermanentError(
            exc.user_message or str(exc) or f"{operation} refused",
            code=exc.code,
            declined=isinstance(exc, stripe.CardError),
        ) from exc
    log.info("stripe %s ok: %s", operation, getattr(result, "id", ""))
    return result


def customer_create(*, account_id: int, email: str, name: str) -> str:
    """Create the Stripe customer of one of our accounts; returns its id."""
    customer = _call(
        "customer.create",
        _client().v1.customers.create,
        {"email": email, "name": name, "metadata": {"account_id": str(account_id)}},
        f"customer:{account_id}",
    )
    return customer.id


def payment_intent_params(
    *,
    amount_cents: int,
    currency: str,
    customer_id: str,
    topup_id: str,
    account_id: int,
    payment_method: str | None = None,
) -> dict[str, Any]:
    """The PaymentIntent of a top-up; with a saved payment method it is confirmed at once."""
    params: dict[str, Any] = {
        "amount": amount_cents,
        "currency": currency,
        "customer": customer_id,
        "payment_method_types": ["card"],
        "metadata": {"topup_id": topup_id, "account_id": str(account_id)},
    }
    if payment_method:
        params.update(payment_method=payment_method, confirm=True, off_session=True)
    return params


def payment_intent_create(
    *,
    amount_cents: int,
    currency: str,
    customer_id: str,
    topup_id: str,
    account_id: int,
    payment_method: str | None = None,
) -> PaymentIntentInfo:
    intent = _call(
        "payment_intent.create",
        _client().v1.payment_intents.create,
        payment_intent_params(
            amount_cents=amount_cents,
            currency=currency,
            customer_id=customer_id,
            topup_id=topup_id,
            account_id=account_id,
            payment_method=payment_method,
        ),
        f"topup:{topup_id}",
    )
    return payment_intent_info(intent.to_dict())


def payment_intent_info(obj: dict[str, Any]) -> PaymentIntentInfo:
    """Read a PaymentIntent object (a webhook's object is checked by webhook_event_verify)."""
    customer = obj.get("customer")
    return PaymentIntentInfo(
        id=obj["id"],
        status=str(obj.get("status") or ""),
        amount=obj.get("amount"),
        amount_received=obj.get("amount_received"),
        currency=obj.get("currency"),
        # Expanded, the customer is an object; otherwise its id.
        customer=customer.get("id") if isinstance(customer, dict) else customer,
        metadata=dict(obj.get("metadata") or {}),
        client_secret=str(obj.get("client_secret") or ""),
    )


def refund_create(*, payment_intent_id: str, amount_cents: int, refund_id: str) -> RefundInfo:
    refund = _call(
        "refund.create",
        _client().v1.refunds.create,
        {
            "payment_intent": payment_intent_id,
            "amount": amount_cents,
            "metadata": {"refund_id": refund_id},
        },
        f"refund:{refund_id}",
    )
    return RefundInfo(id=refund.id, status=refund.status)


def transfer_params(
    *, amount_cents: int, currency: str, destination: str, payout_id: str
) -> tuple[dict[str, Any], dict[str, str]]:
    """The exact request of a provider payout: a Connect transfer to the provider's account."""
    return (
        {
            "amount": amount_cents,
            "currency": currency,
            "destination": destination,
            "transfer_group": f"payout:{payout_id}",
            "metadata": {"payout_id": payout_id},
        },
        {"idempotency_key": f"payout:{payout_id}"},
    )


def transfer_create(*, amount_cents: int, currency: str, destination: str, payout_id: str) -> str:
    params, options = transfer_params(
        amount_cents=amount_cents, currency=currency, destination=destination, payout_id=payout_id
    )
    transfer = _call(
        "transfer.create", _client().v1.transfers.create, params, options["idempotency_key"]
    )
    return transfer.id


def connect_account_params(
    *, account_id: int, provider_id: int, email: str
) -> tuple[dict[str, Any], dict[str, str]]:
    """The exact request that creates a provider's Express Connect account, able to receive
    transfers; the key is our account id, so it is created once whatever the retries."""
    return (
        {
            "type": "express",
            "email": email,
            "capabilities": {"transfers": {"requested": True}},
            "metadata": {"account_id": str(account_id), "provider_id": str(provider_id)},
        },
        {"idempotency_key": f"connect-account:{account_id}"},
    )


def connect_account_create(*, account_id: int, provider_id: int, email: str) -> str:
    params, options = connect_account_params(
        account_id=account_id, provider_id=provider_id, email=email
    )
    account = _call(
        "account.create", _client().v1.accounts.create, params, options["idempotency_key"]
    )
    return account.id


def account_link_create(
    *, connect_account_id: str, return_url: str, refresh_url: str, link_id: str
) -> str:
    """A single-use link to Stripe's hosted onboarding of a Connect account; Stripe sends the
    browser back to return_url when done, to refresh_url when the link expired."""
    link = _call(
        "account_link.create",
        _client().v1.account_links.create,
        {
            "account": connect_account_id,
            "type": "account_onboarding",
            "return_url": return_url,
            "refresh_url": refresh_url,
        },
        f"account-link:{link_id}",
    )
    return link.url


def webhook_event_verify(*, payload: bytes, signature: str | None) -> dict[str, Any]:
    """Check the Stripe-Signature header over the raw body; returns the event as a dict."""
    secret = settings.STRIPE_WEBHOOK_SECRET
    if not secret:
        raise WebhookSignatureInvalid("STRIPE_WEBHOOK_SECRET is not set")
    try:
        stripe.Webhook.construct_event(payload, signature, secret)
    except (stripe.SignatureVerificationError, ValueError) as exc:
        raise WebhookSignatureInvalid(str(exc)) from exc
    # The verified bytes themselves, not the SDK's object: what is stored is what Stripe sent.
    event = json.loads(payload)
    if problem := _event_shape_problem(event):
        raise WebhookEventMalformed(problem)
    return event


def _is_text(value: Any) -> bool:
    return isinstance(value, str) and bool(value)


def _event_shape_problem(event: Any) -> str | None:
    """What makes a verified body unusable as an event, or None. Only the fields the services
    read are checked; Stripe adds fields freely."""
    if not isinstance(event, dict):
        return "the event is not an object"
    for name in ("id", "type"):
        if not _is_text(event.get(name)):
            return f"{name} is missing or not a string"
    data = event.get("data")
    obj = data.get("object") if isinstance(data, dict) else None
    if not isinstance(obj, dict):
        return "data.object is missing or not an object"
    if not _is_text(obj.get("id")):
        return "data.object.id is missing or not a string"
    metadata = obj.get("metadata")
    if metadata is not None and not (
        isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())
    ):
        return "data.object.metadata is not an object of strings"
    for name in ("amount", "amount_received"):
        value = obj.get(name)
        if value is not None and (type(value) is not int or value < 0):
            return f"data.object.{name} is not a whole number of cents"
    for name in ("currency", "status", "failure_reason"):
        if obj.get(name) is not None and not isinstance(obj[name], str):
            return f"data.object.{name} is not a string"
    customer = obj.get("customer")
    if customer is not None and not (
        isinstance(customer, str) or (isinstance(customer, dict) and _is_text(customer.get("id")))
    ):
        return "data.object.customer is neither an id nor a customer"
    return None
