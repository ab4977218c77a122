"""Web endpoints outside the REST API: Stripe's webhook, the billing page and card top-ups."""

from __future__ import annotations

import logging

from django.conf import settings
from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import render
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_GET, require_POST

from accounts.tenancy import request_membership, request_team, team_page
from billing import conf, selectors, services, stripe_adapter

log = logging.getLogger(__name__)


@csrf_exempt
@require_POST
def stripe_webhook(request: HttpRequest) -> JsonResponse:
    """Stripe's callback: the signature is checked on the raw body before anything is read."""
    try:
        event = services.stripe_webhook_receive(
            payload=request.body, signature=request.headers.get("Stripe-Signature")
        )
    except stripe_adapter.WebhookSignatureInvalid as exc:
        log.warning("stripe webhook refused: %s", exc)
        return JsonResponse({"detail": "invalid signature"}, status=400)
    except stripe_adapter.WebhookEventMalformed as exc:
        log.warning("stripe webhook refused: %s", exc)
        return JsonResponse({"detail": f"malformed event: {exc}"}, status=400)
    if event is None:
        return JsonResponse({"received": True, "duplicate": True})
    return JsonResponse({"received": True, "duplicate": False, "outcome": event.outcome})


def _stripe_js_url() -> str:
    # localstripe serves its Stripe.js stand-in under the API base.
    if settings.STRIPE_API_BASE:
        return f"{settings.STRIPE_API_BASE.rstrip('/')}/js.stripe.com/v3/"
    return "https://js.stripe.com/v3/"


@require_GET
@login_required
@team_page
def topup_page(request: HttpRequest) -> HttpResponse:
    """Add funds to the team's balance by card with Stripe Elements; the webhook credits the
    account. Owners and billing members only: other members get the refusal page (403)."""
    team = request_team(request, money=True)
    low, high = conf.topup_limits_cents()
    return render(
        request,
        "billing/topup.html",
        {
            "publishable_key": settings.STRIPE_PUBLISHABLE_KEY,
            "stripe_js_url": _stripe_js_url(),
            "enabled": stripe_adapter.is_configured() and bool(settings.STRIPE_PUBLISHABLE_KEY),
            "team": team,
            "min_usd": low / 100,
            "max_usd": high / 100,
        },
    )


LEDGER_ROWS = 50


@require_GET
@login_required
@team_page
def account_page(request: HttpRequest) -> HttpResponse:
    """The team's balance and what its running rentals cost (every member); statements and the
    latest ledger entries for owners and billing members."""
    team = request_team(request)
    money = request_membership(request).manages_money
    summary = selectors.account_summary(team=team)
    entries = list(selectors.ledger_list(team=team)[: LEDGER_ROWS + 1]) if money else []
    burn = summary.hourly_burn_micros
    return render(
        request,
        "billing/account.html",
        {
            "summary": summary,
            # Held money is what the running rentals burn: the runway counts it.
            "runway_hours": max(0, summary.balance_micros - summary.accrued_micros) / burn
            if burn > 0
            else None,
            "manages_money": money,
            "budget": selectors.budget_summary(team=team),
            "notices": selectors.notice_list(team=team)[:5],
            "invoices": selectors.invoice_list(team=team)[:24] if money else [],
            "entries": entries[:LEDGER_ROWS],
            "more_entries": len(entries) > LEDGER_ROWS,
        },
    )
