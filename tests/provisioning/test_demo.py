"""The demo seed of `dev.py up` makes its people as sign-up would, minus the mail: verified
addresses (so they sign in), the customer's account through the same onboarding service."""

from __future__ import annotations

import pytest
from allauth.account.models import EmailAddress
from django.test import Client

from billing.models import Account, AccountKind
from marketplace.models import User
from provisioning.demo import load_demo

pytestmark = pytest.mark.django_db


def test_the_demo_people_sign_in_and_a_second_load_changes_nothing(tmp_path):
    load_demo(var_dir=tmp_path)
    load_demo(var_dir=tmp_path)
    demo = User.objects.get(username="demo")
    account = Account.objects.get(kind=AccountKind.CUSTOMER, user=demo)
    assert account.balance_micros == 100_000_000
    for name in ("ops", "demo"):
        assert list(EmailAddress.objects.filter(user__username=name).values_list("verified")) == [
            (True,)
        ]
    client = Client()
    password = (tmp_path / "demo_password").read_text().strip()
    page = client.post("/accounts/login/", {"login": "demo", "password": password})
    assert (page.status_code, page["Location"]) == (302, "/")
