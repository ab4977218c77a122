"""Where django-allauth meets the project: new people become customers through the one service
that sets a customer up (billing's, handed over as a hook), mail leaves with a timeout and a
bounded retry, django-axes counts sign-ins by what was typed into allauth's form, and staff
reach the admin only with TOTP on."""

from __future__ import annotations

import logging
import smtplib
import time
from collections.abc import Callable
from typing import Protocol

from allauth.account.adapter import DefaultAccountAdapter
from allauth.account.views import ConfirmEmailView as BaseConfirmEmailView
from allauth.core import context as allauth_context
from allauth.mfa.models import Authenticator
from allauth.mfa.utils import is_mfa_enabled
from django.conf import settings
from django.contrib import messages
from django.contrib.sites.shortcuts import get_current_site
from django.core.exceptions import ImproperlyConfigured
from django.core.mail import EmailMessage
from django.db import transaction
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect
from django.urls import reverse

log = logging.getLogger(__name__)

# Worth another try: the connection, not the message (a refused recipient fails again).
_TRANSIENT_SMTP = (
    smtplib.SMTPServerDisconnected,
    smtplib.SMTPConnectError,
    smtplib.SMTPHeloError,
    ConnectionError,
    TimeoutError,
)


class EmailNotSent(Exception):
    """The SMTP server could not be reached after every attempt."""


def email_send(message: EmailMessage, *, attempts: int | None = None) -> None:
    """Send one message; each SMTP call is bounded by EMAIL_TIMEOUT, and a connection failure
    is tried again (1 s, then 2 s, ... apart) up to EMAIL_SEND_ATTEMPTS times."""
    attempts = attempts or max(1, int(settings.EMAIL_SEND_ATTEMPTS))
    for attempt in range(1, attempts + 1):
        try:
            message.send()
            return
        except _TRANSIENT_SMTP as exc:
            log.warning("mail to %s failed (attempt %d/%d): %s", message.to, attempt, attempts, exc)
            if attempt == attempts:
                raise EmailNotSent(str(exc)) from exc
            time.sleep(2 ** (attempt - 1))


class SignupOnboarder(Protocol):
    def __call__(self, *, user) -> None: ...


_signup_onboard: SignupOnboarder | None = None
MISSING_SIGNUP_ONBOARD = "billing's sign-up onboarding is not registered: is billing installed?"


def signup_onboard_registered() -> bool:
    return _signup_onboard is not None


def signup_onboard_register(onboard: SignupOnboarder) -> None:
    """Billing, which depends on this app and not the reverse, hands over what a new sign-up
    gets (its personal team, billing account and sign-up credit) when its app is ready."""
    global _signup_onboard
    _signup_onboard = onboard


class AccountAdapter(DefaultAccountAdapter):
    """A new account is a customer with everything a customer needs (billing's
    customer_signup, registered as the sign-up hook), made in the same transaction as the
    user row."""

    def save_user(self, request, user, form, commit=True):
        if not commit:
            return super().save_user(request, user, form, commit=False)
        if _signup_onboard is None:
            # Fail closed: an account without a team or a billing account could not rent.
            raise ImproperlyConfigured(MISSING_SIGNUP_ONBOARD)
        with transaction.atomic():
            user = super().save_user(request, user, form, commit=True)
            _signup_onboard(user=user)
        return user

    def send_mail(self, template_prefix: str, email: str, context: dict) -> None:
        request = allauth_context.request
        ctx = {"request": request, "email": email, "current_site": get_current_site(request)}
        ctx.update(context)
        try:
            email_send(self.render_mail(template_prefix, email, ctx))
        except EmailNotSent:
            if request is None:
                raise
            # The account exists; signing in again sends a new verification link.
            messages.error(
                request,
                "We could not send the mail just now. Try again in a few minutes "
                "(signing in sends a new verification link).",
            )


class ConfirmEmailView(BaseConfirmEmailView):
    """A verification link that expired, was used already or was never ours: the page says so,
    with a 400 instead of allauth's 200, and nothing changes."""

    def get(self, *args, **kwargs) -> HttpResponse:
        response = super().get(*args, **kwargs)
        if self.object is None:
            response.status_code = 400
        return response

    def post(self, *args, **kwargs) -> HttpResponse:
        try:
            return super().post(*args, **kwargs)
        except Http404:
            self.object = None
            return self.render_to_response(self.get_context_data(), status=400)


def axes_username(request: HttpRequest, credentials: dict | None = None) -> str | None:
    """What the person typed to sign in: allauth's "login" field (a username or an address),
    so the lockout counts the same key whichever way allauth then authenticates."""
    data = getattr(request, "POST", None) or {}
    typed = data.get("login") or data.get("username")
    if typed:
        return str(typed).strip().lower()
    credentials = credentials or {}
    found = credentials.get("username") or credentials.get("email")
    return str(found).strip().lower() if found else None


class StaffTwoFactorMiddleware:
    """Staff must have an authenticator app (TOTP) before the admin opens: without one, every
    admin page sends them to set it up. (allauth then asks for the code at each sign-in.)"""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        user = getattr(request, "user", None)
        if (
            user is not None
            and user.is_authenticated
            and user.is_staff
            and request.path.startswith(reverse("admin:index"))
            and not is_mfa_enabled(user, [Authenticator.Type.TOTP])
        ):
            messages.warning(
                request,
                "Staff accounts need two-factor authentication for the admin: "
                "set up an authenticator app first.",
            )
            return redirect("mfa_activate_totp")
        return self.get_response(request)
