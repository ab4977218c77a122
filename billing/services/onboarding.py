"""What a new customer and a new provider start with, in one place each: sign-up, the demo
seed and the provider page call these, so every path creates the same rows."""

from __future__ import annotations

import logging
import uuid

from django.conf import settings
from django.db import transaction

from accounts.services import team_personal_ensure
from billing import stripe_adapter
from billing.errors import PaymentsUnavailable
from billing.models import Account
from billing.services.ledger import account_adjust, account_for_provider, account_for_team
from billing.stripe_adapter import StripePermanentError, StripeRetryableError
from core.errors import NotFound, ValidationFailed
from marketplace.models import Provider, User
from marketplace.services import provider_create

log = logging.getLogger(__name__)


def customer_onboard(*, user: User) -> Account:
    """Everything a new customer needs: their personal team, which they own, and its billing
    account (no credit: top-ups or ops add that). Idempotent, so a seed run twice or a retried
    sign-up changes nothing."""
    with transaction.atomic():
        return account_for_team(team=team_personal_ensure(user=user))


def customer_signup(*, user: User) -> None:
    """A person who signed up: set up as a customer (customer_onboard) and given the sign-up
    credit (SIGNUP_CREDIT_USD), in the caller's transaction. The accounts app's sign-up calls
    this through the hook billing registers (accounts sits below billing)."""
    with transaction.atomic():
        account = customer_onboard(user=user)
        credit = settings.SIGNUP_CREDIT_USD
        if credit > 0:
            # Keyed by the user: a repeated save cannot credit twice.
            account_adjust(
                account_id=account.pk,
                amount_micros=int(credit * 1_000_000),
                reason="sign-up credit",
                actor=None,
                key=f"signup-credit-{user.pk}",
            )


def provider_onboard(*, owner: User, name: str) -> Provider:
    """A provider profile for `owner` and the account its earnings are posted to."""
    with transaction.atomic():
        provider = provider_create(owner=owner, name=name)
        account_for_provider(provider=provider)
    return provider


def provider_payouts_start(
    *, owner: User, provider_id: int, return_url: str, refresh_url: str
) -> str:
    """Start (or resume) Stripe Connect onboarding for the owner's provider: its Connect account
    is created once (the idempotency key is our account id, so a retry or a second click finds
    the same one) and a fresh single-use account link is returned for the browser to follow.
    A destination set already (by an earlier onboarding or by ops) is kept."""
    provider = Provider.objects.filter(pk=provider_id, owner=owner).first()
    if provider is None:
        raise NotFound("no such provider")
    if not stripe_adapter.connect_enabled():
        raise PaymentsUnavailable("payouts through Stripe are not enabled: ops pay out by hand")
    account = account_for_provider(provider=provider)
    try:
        if not account.stripe_connect_account_id:
            connect_id = stripe_adapter.connect_account_create(
                account_id=account.pk, provider_id=provider.pk, email=owner.email
            )
            Account.objects.filter(pk=account.pk, stripe_connect_account_id="").update(
                stripe_connect_account_id=connect_id
            )
            account.refresh_from_db(fields=["stripe_connect_account_id"])
        return stripe_adapter.account_link_create(
            connect_account_id=account.stripe_connect_account_id,
            return_url=return_url,
            refresh_url=refresh_url,
            link_id=str(uuid.uuid4()),
        )
    except StripeRetryableError as exc:
        raise PaymentsUnavailable(f"Stripe cannot be reached right now: {exc}") from exc
    except StripePermanentError as exc:
        raise ValidationFailed(f"Stripe refused the payout set-up: {exc}", field="stripe") from exc
