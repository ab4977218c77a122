"""The "become a provider" page: the provider profile, a join token for the first host with the
host's requirements, and payout onboarding (Stripe Connect where enabled, else manual payouts).
It lives here because it spans three apps: the profile (marketplace), the join token (here) and
the payout account (billing)."""

from __future__ import annotations

from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.urls import reverse
from django.views.decorators.http import require_http_methods, require_POST

from billing import selectors as billing_selectors
from billing import services as billing_services
from core.errors import DomainError
from marketplace import selectors
from marketplace.models import Provider
from provisioning.api.serializers import JoinTokenCreateSerializer
from provisioning.services import join_token_create

JOIN_FIELDS = ("region", "price_per_gpu_hour", "min_bid_per_gpu_hour")


def _server_url(request: HttpRequest) -> str:
    return request.build_absolute_uri("/").rstrip("/")


def _page(
    request: HttpRequest,
    *,
    provider: Provider | None,
    status: int = 200,
    errors: dict[str, str] | None = None,
    join_command: str = "",
    form: dict[str, str] | None = None,
) -> HttpResponse:
    return render(
        request,
        "provisioning/onboard.html",
        {
            "provider": provider,
            "payouts": billing_selectors.provider_payout_setup(provider=provider)
            if provider
            else None,
            "errors": errors or {},
            "join_command": join_command,
            "form": form or {},
            "server_url": _server_url(request),
            "stripe_returned": request.GET.get("payouts") == "returned",
        },
        status=status,
    )


def _own_provider(request: HttpRequest) -> Provider | None:
    return selectors.provider_list(owner=request.user).first()


def _errors(exc: DomainError) -> dict[str, str]:
    return {exc.field or "detail": exc.message}


@require_http_methods(["GET", "POST"])
@login_required
def onboard(request: HttpRequest) -> HttpResponse:
    """GET: the form (no provider yet) or the next steps; POST: create the provider."""
    provider = _own_provider(request)
    if request.method == "GET" or provider is not None:
        return _page(request, provider=provider)
    name = request.POST.get("name", "")
    try:
        billing_services.provider_onboard(owner=request.user, name=name)
    except DomainError as exc:
        return _page(
            request, provider=None, status=exc.status, errors=_errors(exc), form={"name": name}
        )
    return redirect("provider-onboard")


@require_POST
@login_required
def onboard_join_token(request: HttpRequest) -> HttpResponse:
    """A one-time join token for the owner's provider, validated as the API validates it; the
    page prints the agent's command line."""
    provider = _own_provider(request)
    if provider is None:
        return redirect("provider-onboard")
    form = {k: request.POST.get(k, "") for k in JOIN_FIELDS}
    body = JoinTokenCreateSerializer(data={**form, "provider": provider.name})
    if not body.is_valid():
        errors = {field: " ".join(str(m) for m in why) for field, why in body.errors.items()}
        return _page(request, provider=provider, status=400, errors=errors, form=form)
    data = dict(body.validated_data)
    data.pop("provider")
    try:
        _, raw = join_token_create(provider=provider, created_by=request.user, **data)
    except DomainError as exc:
        return _page(request, provider=provider, status=exc.status, errors=_errors(exc), form=form)
    command = f"gpumarket-agent --server {_server_url(request)} --join-token {raw}"
    return _page(request, provider=provider, join_command=command)


@require_POST
@login_required
def onboard_payouts(request: HttpRequest) -> HttpResponse:
    """Stripe Connect onboarding: send the browser to Stripe's hosted form."""
    provider = _own_provider(request)
    if provider is None:
        return redirect("provider-onboard")
    back = request.build_absolute_uri(reverse("provider-onboard"))
    try:
        url = billing_services.provider_payouts_start(
            owner=request.user,
            provider_id=provider.pk,
            return_url=f"{back}?payouts=returned",
            refresh_url=back,
        )
    except DomainError as exc:
        return _page(request, provider=provider, status=exc.status, errors=_errors(exc))
    return redirect(url)
