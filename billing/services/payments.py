"""Money in and out through Stripe: top-ups, webhooks, refunds, provider payouts.

The ledger side of each movement is written in our transaction first and keyed by our own row
id; the Stripe call carries the same id as its idempotency key. So a retried call, a replayed
webhook, or a webhook that races the synchronous answer all land on the same ledger row.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any

from django.db import transaction
from django.db.models import Q, Sum
from django.utils import timezone

from accounts.models import Membership, Team, TeamRole
from billing import conf, selectors, stripe_adapter
from billing.errors import PaymentMismatch, PaymentsUnavailable
from billing.models import (
    Account,
    AccountKind,
    EntryKind,
    MoneyOutStatus,
    Payout,
    PayoutMethod,
    Refund,
    StripeEvent,
    TopUp,
    TopUpStatus,
)
from billing.services.ledger import account_for_team, ledger_post
from billing.stripe_adapter import PaymentIntentInfo, StripePermanentError, StripeRetryableError
from core.errors import Conflict, Forbidden, NotFound, PaymentRequired, ValidationFailed
from marketplace.models import User

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class TopUpStarted:
    """A top-up waiting for the customer's browser to confirm the card (or already paid)."""

    topup: TopUp
    client_secret: str


def _usd(micros: int) -> str:
    return f"${Decimal(micros) / conf.MICROS_PER_USD:.2f}"


def _uuid(value: Any) -> uuid.UUID | None:
    """Our id as echoed back in Stripe metadata; anything else matches nothing."""
    try:
        return uuid.UUID(str(value)) if value else None
    except ValueError:
        return None


def stripe_customer_ensure(*, account: Account) -> str:
    """The Stripe customer of a team's account, created once (idempotency key per account);
    its email is the team's first owner's, where Stripe sends receipts."""
    if account.stripe_customer_id:
        return account.stripe_customer_id
    owner = (
        Membership.objects.select_related("user")
        .filter(team_id=account.team_id, role=TeamRole.OWNER)
        .order_by("pk")
        .first()
    )
    customer_id = stripe_adapter.customer_create(
        account_id=account.pk, email=owner.user.email if owner else "", name=account.team.name
    )
    Account.objects.filter(pk=account.pk, stripe_customer_id="").update(
        stripe_customer_id=customer_id
    )
    account.refresh_from_db(fields=["stripe_customer_id"])
    return account.stripe_customer_id


def money_manager_require(*, team: Team, user: User) -> None:
    """Only the team's owners and billing members move its money (top-ups, invoices, budgets);
    a member who may not is refused (403), someone outside the team finds no team (404)."""
    membership = Membership.objects.filter(team=team, user=user).first()
    if membership is None:
        raise NotFound("no such team")
    if not membership.manages_money:
        raise Forbidden("only the team's owners and billing members manage its money")


def topup_create(
    *, team: Team, user: User, amount_cents: int, payment_method: str | None = None
) -> TopUpStarted:
    """Start a card top-up of the team's balance: a PaymentIntent whose client_secret the
    browser confirms with Stripe.js. With a saved payment method it is charged at once
    (off-session). Owners and billing members only."""
    money_manager_require(team=team, user=user)
    low, high = conf.topup_limits_cents()
    if isinstance(amount_cents, bool) or not isinstance(amount_cents, int):
        raise ValidationFailed("amount_cents must be an integer", field="amount_cents")
    if not low <= amount_cents <= high:
        raise ValidationFailed(
            f"amount_cents must be between {low} and {high}", field="amount_cents"
        )
    if not stripe_adapter.is_configured():
        raise PaymentsUnavailable("card payments are not configured; ask ops for a credit")
    account = account_for_team(team=team)
    topup = TopUp.objects.create(
        account=account, amount_cents=amount_cents, currency=conf.currency()
    )
    try:
        customer_id = stripe_customer_ensure(account=account)
        intent = stripe_adapter.payment_intent_create(
            amount_cents=amount_cents,
            currency=topup.currency,
            customer_id=customer_id,
            topup_id=str(topup.pk),
            account_id=account.pk,
            payment_method=payment_method,
        )
    except StripeRetryableError as exc:
        TopUp.objects.filter(pk=topup.pk).update(error=str(exc)[:500])
        raise PaymentsUnavailable("the payment provider is unreachable; try again") from exc
    except StripePermanentError as exc:
        TopUp.objects.filter(pk=topup.pk).update(status=TopUpStatus.FAILED, error=str(exc)[:500])
        if exc.declined:
            raise PaymentRequired(f"card declined: {exc}") from exc
        raise PaymentsUnavailable(f"the payment provider refused: {exc}") from exc
    TopUp.objects.filter(pk=topup.pk, payment_intent_id__isnull=True).update(
        payment_intent_id=intent.id
    )
    if intent.status == "succeeded":
        topup_settle(intent=intent)
    topup.refresh_from_db()
    return TopUpStarted(topup=topup, client_secret=intent.client_secret)


def _topup_locked(*, payment_intent_id: str, topup_id: Any) -> TopUp | None:
    """The top-up of an intent, found by the intent id or by the id we put in its metadata
    (the webhook can arrive before our own call has stored the intent id)."""
    match = Q(payment_intent_id=payment_intent_id)
    if own_id := _uuid(topup_id):
        match |= Q(pk=own_id, payment_intent_id__isnull=True)
    return TopUp.objects.select_for_update().filter(match).first()


def _intent_mismatch(*, topup: TopUp, intent: PaymentIntentInfo) -> str | None:
    """How a PaymentIntent differs from the one this server created for the top-up, or None.

    Our intents carry the top-up's amount, currency, Stripe customer, and our top-up and
    account ids in their metadata; an intent that says otherwise is not the one we asked for,
    however validly signed its event is."""
    metadata = intent.metadata
    if metadata.get("topup_id") != str(topup.pk):
        return f"metadata topup_id {metadata.get('topup_id')!r} is not {topup.pk}"
    if metadata.get("account_id") != str(topup.account_id):
        return f"metadata account_id {metadata.get('account_id')!r} is not {topup.account_id}"
    if (intent.currency or "").lower() != topup.currency.lower():
        return f"currency {intent.currency!r} is not {topup.currency}"
    for name in ("amount", "amount_received"):
        value = getattr(intent, name)
        if value is not None and value != topup.amount_cents:
            return f"{name} {value} is not the top-up's {topup.amount_cents} cents"
    if intent.amount is None and intent.amount_received is None:
        return "no amount"
    expected_customer = topup.account.stripe_customer_id
    if expected_customer and intent.customer != expected_customer:
        return f"customer {intent.customer!r} is not {expected_customer}"
    return None


def _topup_matched(*, intent: PaymentIntentInfo) -> TopUp | None:
    """The locked top-up the intent belongs to (call inside atomic()); PaymentMismatch when the
    intent does not match it."""
    topup = _topup_locked(payment_intent_id=intent.id, topup_id=intent.metadata.get("topup_id"))
    if topup is None:
        return None
    if mismatch := _intent_mismatch(topup=topup, intent=intent):
        log.warning("payment intent %s does not match top-up %s: %s", intent.id, topup.pk, mismatch)
        raise PaymentMismatch(
            f"payment intent {intent.id} does not match top-up {topup.pk}: {mismatch}"
        )
    return topup


def topup_settle(*, intent: PaymentIntentInfo) -> str:
    """Credit a succeeded top-up once, with the amount of our own top-up row (the intent must
    match it: PaymentMismatch otherwise, and nothing is credited); returns what happened."""
    with transaction.atomic():
        topup = _topup_matched(intent=intent)
        if topup is None:
            return "unknown payment intent"
        entry = ledger_post(
            account_id=topup.account_id,
            kind=EntryKind.TOPUP,
            amount_micros=topup.amount_cents * conf.MICROS_PER_CENT,
            key=f"topup:{intent.id}",
            memo=f"card top-up {intent.id}",
        )
        topup.payment_intent_id = intent.id
        topup.status = TopUpStatus.SUCCEEDED
        topup.error = ""
        topup.save(update_fields=["payment_intent_id", "status", "error", "updated_at"])
        return "credited" if entry else "already credited"


def topup_fail(*, intent: PaymentIntentInfo, error: str) -> str:
    with transaction.atomic():
        topup = _topup_matched(intent=intent)
        if topup is None:
            return "unknown payment intent"
        if topup.status == TopUpStatus.SUCCEEDED:
            return "already succeeded"
        topup.payment_intent_id = intent.id
        topup.status = TopUpStatus.FAILED
        topup.error = error[:500]
        topup.save(update_fields=["payment_intent_id", "status", "error", "updated_at"])
        return "failed"


# --- webhooks ----------------------------------------------------------------------------------


def stripe_webhook_receive(*, payload: bytes, signature: str | None) -> StripeEvent | None:
    """Verify, store under the unique event id, and apply, all in one transaction.

    Applying is a handful of keyed ledger writes, so it is done inline rather than in a task:
    the event row and its effect commit together, a replay (or a concurrent duplicate
    delivery, which waits on the unique index) finds the row and returns None, and a failure
    rolls both back so Stripe delivers again. Raises WebhookSignatureInvalid for a forgery.
    """
    event = stripe_adapter.webhook_event_verify(payload=payload, signature=signature)
    with transaction.atomic():
        stored, created = StripeEvent.objects.get_or_create(
            event_id=event["id"], defaults={"type": event["type"], "payload": event}
        )
        if not created:
            return None
        try:
            stored.outcome = _event_apply(event)[:500]
        except PaymentMismatch as exc:
            # Stored, so a replay stays a no-op and ops can find it; nothing was credited.
            stored.outcome = f"suspicious: {exc.message}"[:500]
            stored.suspicious = True
        stored.save(update_fields=["outcome", "suspicious"])
    log.info("stripe event %s %s: %s", stored.event_id, stored.type, stored.outcome)
    return stored


def _event_apply(event: dict[str, Any]) -> str:
    # The adapter has checked the shape: an object with a string id, metadata of strings.
    obj = event["data"]["object"]
    metadata = obj.get("metadata") or {}
    kind = event["type"]
    if kind == "payment_intent.succeeded":
        return topup_settle(intent=stripe_adapter.payment_intent_info(obj))
    if kind == "payment_intent.payment_failed":
        last_error = obj.get("last_payment_error")
        error = (last_error.get("message") if isinstance(last_error, dict) else None) or ""
        return topup_fail(
            intent=stripe_adapter.payment_intent_info(obj), error=str(error) or "payment failed"
        )
    if kind in ("refund.failed", "refund.updated", "charge.refund.updated"):
        if obj.get("status") != "failed":
            return f"refund {obj.get('status')}"
        return refund_fail(
            stripe_refund_id=obj["id"],
            refund_id=metadata.get("refund_id"),
            error=obj.get("failure_reason") or "refund failed",
        )
    if kind == "transfer.reversed":
        return payout_reverse(
            stripe_transfer_id=obj["id"],
            payout_id=metadata.get("payout_id"),
            error="transfer reversed",
        )
    return "ignored"


# --- refunds -----------------------------------------------------------------------------------


def refund_create(
    *,
    account_id: int,
    amount_micros: int,
    reason: str,
    actor: User | None,
    topup_id: uuid.UUID | None = None,
    refund_id: uuid.UUID | None = None,
) -> Refund:
    """Give money back to a customer, with a required reason: to the card of a top-up through
    Stripe, or (no top-up named) out of band. Only the available balance can be refunded.
    `refund_id` (e.g. from the form) makes a re-submission return the first refund."""
    if refund_id is not None and (done := Refund.objects.filter(pk=refund_id).first()):
        return done
    reason = (reason or "").strip()
    if not reason:
        raise ValidationFailed("a reason is required", field="reason")
    if amount_micros <= 0:
        raise ValidationFailed("the amount must be positive", field="amount")
    with transaction.atomic():
        account = Account.objects.select_for_update().get(pk=account_id)
        if account.kind != AccountKind.CUSTOMER:
            raise ValidationFailed("only customers are refunded", field="account")
        topup = None
        if topup_id is not None:
            topup = TopUp.objects.filter(pk=topup_id, account=account).first()
            if topup is None or topup.status != TopUpStatus.SUCCEEDED:
                raise NotFound("no succeeded top-up of this account with that id")
            if not stripe_adapter.is_configured():
                raise PaymentsUnavailable("card refunds need Stripe keys")
            if amount_micros % conf.MICROS_PER_CENT:
                raise ValidationFailed("a card refund is whole cents", field="amount")
            refunded = (
                topup.refunds.exclude(status=MoneyOutStatus.FAILED).aggregate(
                    total=Sum("amount_micros")
                )["total"]
                or 0
            )
            left = topup.amount_cents * conf.MICROS_PER_CENT - refunded
            if amount_micros > left:
                raise Conflict(f"only {_usd(left)} of this top-up is left to refund")
        # Money held for booked rentals is not refundable until they end.
        available = selectors.team_available_micros(
            team_id=account.team_id, balance_micros=account.balance_micros
        )
        if amount_micros > available:
            raise Conflict(f"only {_usd(max(available, 0))} is available to refund")
        refund = Refund.objects.create(
            id=refund_id or uuid.uuid4(),
            account=account,
            topup=topup,
            amount_micros=amount_micros,
            reason=reason,
            actor=actor,
            status=MoneyOutStatus.PENDING if topup else MoneyOutStatus.SUCCEEDED,
        )
        ledger_post(
            account_id=account.pk,
            kind=EntryKind.REFUND,
            amount_micros=-amount_micros,
            key=f"refund:{refund.pk}",
            memo=reason,
            actor=actor,
        )
    if topup is not None:
        refund = refund_submit(refund_id=refund.pk)
    return refund


def refund_submit(*, refund_id: uuid.UUID) -> Refund:
    """Ask Stripe for a pending card refund (again: the idempotency key is the refund id)."""
    refund = Refund.objects.select_related("topup").get(pk=refund_id)
    if refund.status != MoneyOutStatus.PENDING or refund.topup is None:
        return refund
    try:
        info = stripe_adapter.refund_create(
            payment_intent_id=refund.topup.payment_intent_id,
            amount_cents=refund.amount_micros // conf.MICROS_PER_CENT,
            refund_id=str(refund.pk),
        )
    except StripeRetryableError as exc:
        Refund.objects.filter(pk=refund.pk).update(error=str(exc)[:500])
    except StripePermanentError as exc:
        refund_fail(stripe_refund_id="", refund_id=refund.pk, error=str(exc))
    else:
        status = MoneyOutStatus.FAILED if info.status == "failed" else MoneyOutStatus.SUCCEEDED
        if status == MoneyOutStatus.FAILED:
            refund_fail(stripe_refund_id=info.id, refund_id=refund.pk, error="refund failed")
        else:
            Refund.objects.filter(pk=refund.pk, status=MoneyOutStatus.PENDING).update(
                status=status, stripe_refund_id=info.id, error="", updated_at=timezone.now()
            )
    refund.refresh_from_db()
    return refund


def refund_fail(*, stripe_refund_id: str, refund_id: Any, error: str) -> str:
    """A refund Stripe could not make: the money goes back on the account, once."""
    match = Q(stripe_refund_id=stripe_refund_id) if stripe_refund_id else Q(pk__in=[])
    if own_id := _uuid(refund_id):
        match |= Q(pk=own_id)
    with transaction.atomic():
        refund = Refund.objects.select_for_update().filter(match).first()
        if refund is None:
            return "unknown refund"
        entry = ledger_post(
            account_id=refund.account_id,
            kind=EntryKind.REFUND_REVERSAL,
            amount_micros=refund.amount_micros,
            key=f"refund-reversal:{refund.pk}",
            memo=f"refund failed: {error}",
        )
        refund.status = MoneyOutStatus.FAILED
        refund.error = error[:500]
        refund.stripe_refund_id = refund.stripe_refund_id or stripe_refund_id
        refund.save(update_fields=["status", "error", "stripe_refund_id", "updated_at"])
        return "refund failed, credited back" if entry else "refund failure already recorded"


# --- payouts -----------------------------------------------------------------------------------


def payout_create(
    *,
    account_id: int,
    actor: User | None,
    amount_micros: int | None = None,
    reason: str,
    payout_id: uuid.UUID | None = None,
) -> Payout:
    """Pay a provider's earnings out, with a required reason: by default the whole balance in
    whole cents. Through a Stripe Connect transfer where enabled and the provider has a Connect
    account, otherwise recorded for ops to pay by bank transfer (then marked paid). `payout_id`
    makes a re-submission return the first payout."""
    if payout_id is not None and (done := Payout.objects.filter(pk=payout_id).first()):
        return done
    reason = (reason or "").strip()
    if not reason:
        raise ValidationFailed("a reason is required", field="reason")
    with transaction.atomic():
        account = Account.objects.select_for_update().get(pk=account_id)
        if account.kind != AccountKind.PROVIDER:
            raise ValidationFailed("only providers are paid out", field="account")
        if amount_micros is None:
            amount_micros = account.balance_micros - account.balance_micros % conf.MICROS_PER_CENT
        if amount_micros <= 0:
            raise Conflict("nothing to pay out")
        if amount_micros % conf.MICROS_PER_CENT:
            raise ValidationFailed("a payout is whole cents", field="amount")
        if amount_micros > account.balance_micros:
            raise Conflict(f"only {_usd(account.balance_micros)} is available to pay out")
        connect = stripe_adapter.connect_enabled() and bool(account.stripe_connect_account_id)
        payout = Payout.objects.create(
            id=payout_id or uuid.uuid4(),
            account=account,
            amount_micros=amount_micros,
            method=PayoutMethod.STRIPE_CONNECT if connect else PayoutMethod.MANUAL,
            destination=account.stripe_connect_account_id if connect else "",
            reason=reason,
            actor=actor,
        )
        ledger_post(
            account_id=account.pk,
            kind=EntryKind.PAYOUT,
            amount_micros=-amount_micros,
            key=f"payout:{payout.pk}",
            memo=reason,
            actor=actor,
        )
    if connect:
        payout = payout_submit(payout_id=payout.pk)
    return payout


def payout_submit(*, payout_id: uuid.UUID) -> Payout:
    """Send a pending Connect payout (again: the idempotency key is the payout id)."""
    payout = Payout.objects.get(pk=payout_id)
    if payout.status != MoneyOutStatus.PENDING or payout.method != PayoutMethod.STRIPE_CONNECT:
        return payout
    try:
        transfer_id = stripe_adapter.transfer_create(
            amount_cents=payout.amount_micros // conf.MICROS_PER_CENT,
            currency=conf.currency(),
            destination=payout.destination,
            payout_id=str(payout.pk),
        )
    except StripeRetryableError as exc:
        Payout.objects.filter(pk=payout.pk).update(error=str(exc)[:500])
    except StripePermanentError as exc:
        payout_reverse(stripe_transfer_id="", payout_id=payout.pk, error=str(exc))
    else:
        Payout.objects.filter(pk=payout.pk, status=MoneyOutStatus.PENDING).update(
            status=MoneyOutStatus.SUCCEEDED,
            stripe_transfer_id=transfer_id,
            error="",
            updated_at=timezone.now(),
        )
    payout.refresh_from_db()
    return payout


def payout_mark_paid(*, payout_id: uuid.UUID, actor: User) -> Payout:
    """Ops paid a manual payout by bank transfer."""
    with transaction.atomic():
        payout = Payout.objects.select_for_update().get(pk=payout_id)
        if payout.method != PayoutMethod.MANUAL or payout.status != MoneyOutStatus.PENDING:
            raise Conflict(f"a {payout.status} {payout.method} payout cannot be marked paid")
        payout.status = MoneyOutStatus.SUCCEEDED
        payout.actor = actor
        payout.save(update_fields=["status", "actor", "updated_at"])
    return payout


def payout_reverse(*, stripe_transfer_id: str, payout_id: Any, error: str) -> str:
    """A transfer refused or reversed: the earnings go back on the provider's account, once."""
    match = Q(stripe_transfer_id=stripe_transfer_id) if stripe_transfer_id else Q(pk__in=[])
    if own_id := _uuid(payout_id):
        match |= Q(pk=own_id)
    with transaction.atomic():
        payout = Payout.objects.select_for_update().filter(match).first()
        if payout is None:
            return "unknown payout"
        entry = ledger_post(
            account_id=payout.account_id,
            kind=EntryKind.PAYOUT_REVERSAL,
            amount_micros=payout.amount_micros,
            key=f"payout-reversal:{payout.pk}",
            memo=f"payout returned: {error}",
        )
        payout.status = (
            MoneyOutStatus.REVERSED
            if payout.status == MoneyOutStatus.SUCCEEDED
            else MoneyOutStatus.FAILED
        )
        payout.error = error[:500]
        payout.save(update_fields=["status", "error", "updated_at"])
        return "payout returned to the provider" if entry else "payout return already recorded"


def payments_retry_pending(*, now: datetime | None = None, min_age_s: int = 60) -> int:
    """Re-send refunds and payouts left pending by a retryable Stripe error."""
    if not stripe_adapter.is_configured():
        return 0
    before = (now or timezone.now()) - timedelta(seconds=min_age_s)
    retried = 0
    for refund_id in Refund.objects.filter(
        status=MoneyOutStatus.PENDING, topup__isnull=False, updated_at__lt=before
    ).values_list("pk", flat=True)[:100]:
        refund_submit(refund_id=refund_id)
        retried += 1
    for payout_id in Payout.objects.filter(
        status=MoneyOutStatus.PENDING,
        method=PayoutMethod.STRIPE_CONNECT,
        updated_at__lt=before,
    ).values_list("pk", flat=True)[:100]:
        payout_submit(payout_id=payout_id)
        retried += 1
    return retried
