"""Sign-up, email verification, password reset and TOTP through django-allauth's real views,
with mail through a real SMTP server (aiosmtpd) whose links the tests follow; staff reach the
admin only with TOTP; django-axes keeps locking out allauth's sign-in form; without billing's
onboarding hook the checks refuse to start and nobody signs up."""

from __future__ import annotations

import time
from decimal import Decimal

import pytest
from allauth.account import app_settings as allauth_settings
from allauth.account.models import EmailAddress
from allauth.mfa.models import Authenticator
from django.conf import settings
from django.core import signing
from django.core.exceptions import ImproperlyConfigured
from django.core.management import call_command
from django.core.management.base import SystemCheckError
from django.test import Client
from django.urls import reverse

from accounts import signup
from accounts.checks import hooks_are_registered
from accounts.signup import EmailNotSent, email_send
from billing.models import Account, AccountKind, LedgerEntry
from marketplace.models import User
from tests.conftest import totp_code
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db

PASSWORD = "Quiet-Harbor-Lamp-93"


def _counts() -> tuple[int, int, int]:
    return (
        User.objects.count(),
        EmailAddress.objects.count(),
        Account.objects.filter(kind=AccountKind.CUSTOMER).count(),
    )


def _sign_up(client: Client, *, email: str, username: str, password: str = PASSWORD, again=None):
    return client.post(
        "/accounts/signup/",
        {
            "email": email,
            "username": username,
            "password1": password,
            "password2": again or password,
        },
    )


def _sign_in(client: Client, login: str, password: str = PASSWORD):
    return client.post("/accounts/login/", {"login": login, "password": password})


def _signed_in_as(client: Client) -> int | None:
    value = client.session.get("_auth_user_id")
    return int(value) if value else None


def _verified_customer(client: Client, smtp_server, *, username: str = "ada") -> User:
    address = f"{username}@example.com"
    assert _sign_up(client, email=address, username=username).status_code == 302
    link = smtp_server.link(address, r"/accounts/confirm-email/")
    assert client.post(link).status_code == 302
    assert _sign_in(client, username).status_code == 302
    return User.objects.get(username=username)


# Sign-up and verification.


def test_a_sign_up_verifies_the_address_by_mail_before_the_first_sign_in(client, smtp_server):
    # Given a visitor on the sign-up page
    assert client.get("/accounts/signup/").status_code == 200
    before = _counts()

    # When they sign up
    page = _sign_up(client, email="Ada@Example.com", username="ada")

    # Then the account exists with everything a customer starts with, not yet usable
    assert (page.status_code, page["Location"]) == (302, reverse("account_email_verification_sent"))
    user = User.objects.get(username="ada")
    assert _counts() == (before[0] + 1, before[1] + 1, before[2] + 1)
    assert (
        Account.objects.get(kind=AccountKind.CUSTOMER, team__personal_of=user).balance_micros == 0
    )
    assert list(EmailAddress.objects.filter(user=user).values_list("email", "verified")) == [
        ("ada@example.com", False)
    ]
    assert _signed_in_as(client) is None

    # And a mail with the verification link went through the SMTP server
    (mail,) = smtp_server.wait_for("ada@example.com")
    assert mail["Subject"].startswith("[gpumarket] ")
    assert mail["From"] == settings.DEFAULT_FROM_EMAIL
    link = smtp_server.link("ada@example.com", r"/accounts/confirm-email/[^/]+/$")

    # Signing in before following it is refused, and sends the link again
    refused = _sign_in(Client(), "ada")
    assert refused.status_code == 302
    assert refused["Location"] == reverse("account_email_verification_sent")
    assert len(smtp_server.wait_for("ada@example.com", count=2)) == 2

    # When they follow the link and confirm
    confirm_page = client.get(link)
    assert confirm_page.status_code == 200 and "ada@example.com" in confirm_page.content.decode()
    assert client.post(link).status_code == 302

    # Then the address is verified and they sign in, by username or by address
    assert EmailAddress.objects.get(user=user).verified
    fresh = Client()
    assert _sign_in(fresh, "ada").status_code == 302
    assert _signed_in_as(fresh) == user.pk
    other = Client()
    assert _sign_in(other, "ada@example.com").status_code == 302
    assert _signed_in_as(other) == user.pk
    assert fresh.get("/rentals/").status_code == 200


def test_a_used_verification_link_is_refused_clearly(client, smtp_server):
    _sign_up(client, email="bo@example.com", username="bo")
    link = smtp_server.link("bo@example.com", r"/accounts/confirm-email/")
    assert client.post(link).status_code == 302
    again = client.get(link)
    assert again.status_code == 400
    assert "has been used already" in again.content.decode()
    assert client.post(link).status_code == 400
    assert EmailAddress.objects.filter(verified=True, email="bo@example.com").count() == 1


class _SignedLongAgo(signing.TimestampSigner):
    """Signs as the server would have, (expiry + 1) days ago."""

    def timestamp(self):
        days = allauth_settings.EMAIL_CONFIRMATION_EXPIRE_DAYS + 1
        return signing.b62_encode(int(time.time()) - days * 86400)


def test_an_expired_verification_link_is_refused_and_verifies_nothing(client, smtp_server):
    _sign_up(client, email="cy@example.com", username="cy")
    address = EmailAddress.objects.get(email="cy@example.com")
    # The same key the mail carries, but signed past its expiry with the server's secret.
    key = _SignedLongAgo(salt=allauth_settings.SALT).sign_object(address.pk, compress=False)
    link = reverse("account_confirm_email", args=[key])
    page = client.get(link)
    assert page.status_code == 400 and "has expired" in page.content.decode()
    assert client.post(link).status_code == 400
    address.refresh_from_db()
    assert address.verified is False
    # A link that was never ours is refused the same way.
    assert client.get(reverse("account_confirm_email", args=["not-a-key"])).status_code == 400


def test_a_taken_address_is_refused_by_name_and_creates_nothing(client, smtp_server):
    UserFactory(username="first", email="taken@example.com")
    before = _counts()
    page = _sign_up(client, email="TAKEN@example.com", username="second")
    assert page.status_code == 200
    assert "A user is already registered with this email address." in page.content.decode()
    assert page.context["form"].errors.keys() == {"email"}
    assert _counts() == before
    assert smtp_server.to("taken@example.com") == []


@pytest.mark.parametrize(
    ("password", "again", "field", "why"),
    [
        ("short1", None, "password1", "too short"),
        ("password123", None, "password1", "too common"),
        ("48213907613", None, "password1", "entirely numeric"),
        ("newcomer-9x", None, "password1", "too similar to the username"),
        (PASSWORD, "Other-Harbor-Lamp-93", "password2", "same password each time"),
    ],
)
def test_a_weak_or_mistyped_password_is_refused_by_name_and_creates_nothing(
    client, smtp_server, password, again, field, why
):
    before = _counts()
    page = _sign_up(
        client, email="newcomer@example.com", username="newcomer", password=password, again=again
    )
    assert page.status_code == 200
    errors = page.context["form"].errors
    assert field in errors and why in " ".join(errors[field])
    assert _counts() == before
    assert smtp_server.to("newcomer@example.com") == []


def test_a_taken_username_is_refused_by_name(client, smtp_server):
    UserFactory(username="dup")
    before = _counts()
    page = _sign_up(client, email="dup2@example.com", username="DUP")
    assert page.status_code == 200 and page.context["form"].errors.keys() == {"username"}
    assert _counts() == before


# Password reset.


def test_a_password_reset_by_mail_sets_a_new_password(client, smtp_server):
    user = UserFactory(username="dee", email="dee@example.com")
    page = client.post("/accounts/password/reset/", {"email": "dee@example.com"})
    assert page.status_code == 302
    link = smtp_server.link("dee@example.com", r"/accounts/password/reset/key/")
    form = client.get(link, follow=True)
    assert form.status_code == 200
    set_url = form.redirect_chain[-1][0] if form.redirect_chain else link

    # A weak new password is refused and the old one still works
    weak = client.post(set_url, {"password1": "12345678", "password2": "12345678"})
    assert weak.status_code == 200 and "password1" in weak.context["form"].errors
    user.refresh_from_db()
    assert user.check_password("pw-not-secret")

    done = client.post(set_url, {"password1": PASSWORD, "password2": PASSWORD})
    assert done.status_code == 302
    assert _sign_in(Client(), "dee", "pw-not-secret").status_code == 200  # refused
    assert _sign_in(Client(), "dee").status_code == 302
    # The link works once.
    assert "invalid" in client.get(link, follow=True).content.decode().lower()


def test_a_reset_for_an_unknown_address_sends_nothing(client, smtp_server):
    page = client.post("/accounts/password/reset/", {"email": "nobody@example.com"})
    assert page.status_code == 200 and "email" in page.context["form"].errors
    assert smtp_server.messages == []


# TOTP.


def _activate_totp(client: Client, password: str = PASSWORD) -> str:
    # Turning TOTP on is sensitive: allauth asks for the password again first.
    asked = client.get(reverse("mfa_activate_totp"))
    assert asked.status_code == 302
    assert asked["Location"].startswith(reverse("account_reauthenticate"))
    wrong = client.post(asked["Location"], {"password": "not-it"})
    assert wrong.status_code == 200 and "password" in wrong.context["form"].errors
    assert client.post(asked["Location"], {"password": password}).status_code == 302
    page = client.get(reverse("mfa_activate_totp"))
    assert page.status_code == 200
    secret = page.context["form"].secret
    wrong = client.post(reverse("mfa_activate_totp"), {"code": "000000"})
    assert wrong.status_code == 200 and "code" in wrong.context["form"].errors
    ok = client.post(reverse("mfa_activate_totp"), {"code": totp_code(secret)})
    assert ok.status_code == 302
    return secret


def test_with_totp_on_a_sign_in_needs_the_code_and_a_wrong_one_is_refused(client, smtp_server):
    user = _verified_customer(client, smtp_server, username="eve")
    assert not Authenticator.objects.filter(user=user).exists()
    secret = _activate_totp(client)
    assert Authenticator.objects.filter(user=user, type=Authenticator.Type.TOTP).count() == 1

    # The password alone does not sign in any more
    browser = Client()
    page = _sign_in(browser, "eve")
    assert (page.status_code, page["Location"]) == (302, reverse("mfa_authenticate"))
    assert _signed_in_as(browser) is None

    # A wrong code is refused
    wrong = browser.post(reverse("mfa_authenticate"), {"code": "123456"})
    assert wrong.status_code == 200 and "code" in wrong.context["form"].errors
    assert _signed_in_as(browser) is None

    # The next period's code (the current one was spent on activation) signs in
    ok = browser.post(reverse("mfa_authenticate"), {"code": totp_code(secret, steps_ahead=1)})
    assert ok.status_code == 302
    assert _signed_in_as(browser) == user.pk


# Staff and the admin.


def test_staff_without_totp_are_sent_to_set_it_up_before_the_admin(client, smtp_server):
    staff = UserFactory(username="opsy", is_staff=True, is_superuser=True, totp=False)
    assert _sign_in(client, "opsy", "pw-not-secret").status_code == 302
    for path in ("/admin/", "/admin/marketplace/node/"):
        page = client.get(path)
        assert (page.status_code, page["Location"]) == (302, reverse("mfa_activate_totp"))

    # With an authenticator app set up, the admin opens
    secret = _activate_totp(client, "pw-not-secret")
    assert client.get("/admin/").status_code == 200

    # And the next sign-in asks for the code before anything, the admin included
    fresh = Client()
    assert _sign_in(fresh, "opsy", "pw-not-secret")["Location"] == reverse("mfa_authenticate")
    assert fresh.get("/admin/").status_code == 302
    fresh.post(reverse("mfa_authenticate"), {"code": totp_code(secret, steps_ahead=1)})
    assert _signed_in_as(fresh) == staff.pk
    assert fresh.get("/admin/").status_code == 200


def test_the_admin_login_form_is_not_a_way_around_totp(client):
    UserFactory(username="opsz", is_staff=True, is_superuser=True)  # with TOTP
    page = client.get("/admin/login/?next=/admin/")
    assert page.status_code == 302 and page["Location"].startswith("/accounts/login/")
    posted = client.post("/admin/login/", {"username": "opsz", "password": "pw-not-secret"})
    assert posted.status_code == 302 and _signed_in_as(client) is None


def test_customers_without_totp_are_not_asked_for_it(client, smtp_server):
    _verified_customer(client, smtp_server, username="fay")
    assert client.get("/rentals/").status_code == 200
    assert client.get("/admin/").status_code == 302  # the admin's own refusal: not staff


# Mail delivery.


def test_a_mail_to_a_server_that_does_not_answer_fails_after_the_attempts(settings, mailoutbox):
    from django.core.mail import EmailMessage

    settings.EMAIL_BACKEND = "django.core.mail.backends.smtp.EmailBackend"
    settings.EMAIL_HOST, settings.EMAIL_PORT = "127.0.0.1", 9  # nothing listens on discard
    with pytest.raises(EmailNotSent):
        email_send(EmailMessage("s", "b", to=["x@example.com"]), attempts=2)


def test_a_sign_up_while_the_mail_server_is_down_keeps_the_account_and_says_so(client, settings):
    settings.EMAIL_BACKEND = "django.core.mail.backends.smtp.EmailBackend"
    settings.EMAIL_HOST, settings.EMAIL_PORT = "127.0.0.1", 9
    page = _sign_up(client, email="gil@example.com", username="gil")
    assert page.status_code == 302
    shown = client.get(page["Location"]).content.decode()
    assert "could not send the mail" in shown
    assert User.objects.filter(username="gil").exists()


# People who existed before sign-up had verification.


def test_the_migration_verifies_the_addresses_of_people_who_existed_before(client):
    import importlib

    from django.apps import apps

    before = UserFactory(username="old", email="Old@Example.com", email_verified=False)
    already = UserFactory(username="known")
    assert not EmailAddress.objects.filter(user=before).exists()
    migration = importlib.import_module(
        "marketplace.migrations.0006_existing_users_verified_addresses"
    )
    migration.verify_existing(apps, None)
    assert list(EmailAddress.objects.filter(user=before).values_list("email", "verified")) == [
        ("old@example.com", True)
    ]
    assert EmailAddress.objects.filter(user=already).count() == 1
    assert _sign_in(client, "old", "pw-not-secret")["Location"] == "/"


def test_the_lockout_counts_sign_ins_by_address_as_well(settings):
    settings.AXES_FAILURE_LIMIT = 2
    UserFactory(username="kim", email="kim@example.com")
    for _ in range(2):
        last = _sign_in(Client(), "KIM@example.com", "wrong")
    assert last.status_code == 429
    assert _sign_in(Client(), "kim@example.com", "pw-not-secret").status_code == 429


@pytest.mark.parametrize(("credit", "balance_micros"), [("0", 0), ("12.50", 12_500_000)])
def test_a_new_account_gets_the_operators_sign_up_credit_once(
    client, smtp_server, settings, credit, balance_micros
):
    settings.SIGNUP_CREDIT_USD = Decimal(credit)
    user = _verified_customer(client, smtp_server)
    account = Account.objects.get(kind=AccountKind.CUSTOMER, team__personal_of=user)
    assert account.balance_micros == balance_micros
    entries = LedgerEntry.objects.filter(account=account)
    assert [e.amount_micros for e in entries] == ([balance_micros] if balance_micros else [])


def test_with_billing_ready_the_sign_up_hook_is_registered():
    assert hooks_are_registered(None) == []


def test_without_billings_onboarding_the_checks_refuse_to_start_and_nobody_signs_up(
    client, monkeypatch
):
    # Given no onboarding handed to sign-up
    monkeypatch.setattr(signup, "_signup_onboard", None)
    assert [e.id for e in hooks_are_registered(None)] == ["accounts.E001"]
    with pytest.raises(SystemCheckError, match="sign-up onboarding is not registered"):
        call_command("check")
    before = _counts()
    # When someone signs up, then it is refused and nothing was written
    with pytest.raises(ImproperlyConfigured):
        _sign_up(client, email="cy@example.invalid", username="cy")
    assert _counts() == before
