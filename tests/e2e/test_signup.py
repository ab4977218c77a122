"""Self-service in a real headless Chromium against the live server: a person signs up, gets the
verification mail from a real SMTP server, follows its link, signs in, and becomes a provider.

`sign_up` is the helper other browser tests start from: it returns the driver signed in as a
new, verified person."""

from __future__ import annotations

import re
from urllib.parse import urlsplit

import pytest
from selenium.webdriver.common.by import By

from billing.models import Account, AccountKind
from marketplace.models import Provider, User
from provisioning.models import JoinToken
from tests.e2e.test_web_ui import _landed, _log_out, _wait

pytestmark = [pytest.mark.e2e, pytest.mark.browser, pytest.mark.django_db(transaction=True)]

PASSWORD = "Quiet-Harbor-Lamp-93"


def _fill(driver, values: dict[str, str]) -> None:
    for element_id, value in values.items():
        field = driver.find_element(By.ID, element_id)
        field.clear()
        field.send_keys(value)


def _submit(driver) -> None:
    driver.find_element(By.CSS_SELECTOR, "main form button[type=submit]").click()


def sign_in(driver, base: str, *, login: str, password: str = PASSWORD, then: str = "/") -> None:
    driver.get(f"{base}/accounts/login/?next={then}")
    _wait(driver, lambda d: d.find_element(By.ID, "id_login"), what="the sign-in form")
    _fill(driver, {"id_login": login, "id_password": password})
    _submit(driver)
    _landed(driver, then)


def sign_up(driver, base: str, mailbox, *, username: str, password: str = PASSWORD):
    """Sign up as `username` (<username>@example.com) through the pages, follow the link of the
    verification mail the SMTP server received, sign in; returns the signed-in driver."""
    address = f"{username}@example.com"
    driver.get(f"{base}/")
    driver.find_element(By.LINK_TEXT, "Sign up").click()
    _wait(driver, lambda d: d.find_element(By.ID, "id_email"), what="the sign-up form")
    _fill(
        driver,
        {
            "id_email": address,
            "id_username": username,
            "id_password1": password,
            "id_password2": password,
        },
    )
    _submit(driver)
    _landed(driver, "/accounts/confirm-email/")
    assert "verification" in driver.page_source.lower()

    link = mailbox.link(address, r"/accounts/confirm-email/[^/]+/$")
    assert urlsplit(link).netloc == urlsplit(base).netloc  # built for the server that sent it
    driver.get(link)
    _wait(driver, lambda d: d.find_element(By.ID, "confirm-email"), what="the confirm button")
    assert address in driver.page_source
    driver.find_element(By.ID, "confirm-email").click()
    _wait(
        driver,
        lambda d: urlsplit(d.current_url).path != urlsplit(link).path,
        what="the confirmation",
    )
    sign_in(driver, base, login=username, password=password)
    return driver


def test_a_person_signs_up_verifies_by_mail_and_signs_in(browser, live_server, smtp_server):
    base = live_server.url
    driver = sign_up(browser, base, smtp_server, username="grace")

    # Signed in: the header names them and the customer pages open
    assert driver.find_element(By.CSS_SELECTOR, "header .who a").text == "grace"
    user = User.objects.get(username="grace")
    assert Account.objects.filter(kind=AccountKind.CUSTOMER, team__personal_of=user).count() == 1
    driver.get(f"{base}/rentals/")
    _landed(driver, "/rentals/")
    assert driver.find_element(By.TAG_NAME, "h1").text == "Rentals · team grace"
    # Exactly one mail, the verification
    (mail,) = smtp_server.to("grace@example.com")
    assert "confirm" in mail["Subject"].lower()


def test_a_taken_address_is_named_on_the_form_in_the_browser(browser, live_server, smtp_server):
    base = live_server.url
    sign_up(browser, base, smtp_server, username="hal")
    _log_out(browser)
    browser.get(f"{base}/accounts/signup/")
    _wait(browser, lambda d: d.find_element(By.ID, "id_email"), what="the sign-up form")
    _fill(
        browser,
        {
            "id_email": "hal@example.com",
            "id_username": "hal2",
            "id_password1": PASSWORD,
            "id_password2": PASSWORD,
        },
    )
    _submit(browser)
    error = _wait(browser, lambda d: d.find_element(By.CSS_SELECTOR, "main ul.errorlist"))
    assert "already registered with this email" in error.text
    assert User.objects.filter(username="hal2").count() == 0


def test_a_new_person_becomes_a_provider_and_gets_a_join_command(
    browser, live_server, smtp_server, settings
):
    settings.STRIPE_SECRET_KEY = ""
    base = live_server.url
    driver = sign_up(browser, base, smtp_server, username="ida")
    driver.find_element(By.LINK_TEXT, "Become a provider").click()
    _landed(driver, "/provider/onboard/")
    assert "NVIDIA Container Toolkit" in driver.page_source
    _fill(driver, {"id_name": "Ida Compute"})
    _submit(driver)
    _wait(driver, lambda d: d.find_element(By.ID, "join-form"), what="the join-token step")
    assert driver.find_element(By.ID, "payouts-manual").is_displayed()
    _fill(driver, {"id_region": "eu-west", "id_price": "1.10", "id_min_bid": "0.40"})
    driver.find_element(By.CSS_SELECTOR, "#join-form button[type=submit]").click()
    command = _wait(driver, lambda d: d.find_element(By.ID, "join-command")).text
    assert re.fullmatch(
        rf"gpumarket-agent --server {re.escape(base)} --join-token gpj_\S+", command
    )
    provider = Provider.objects.get(name="Ida Compute")
    assert provider.owner.username == "ida"
    assert JoinToken.objects.filter(provider=provider, region="eu-west").count() == 1
    # The navigation now leads to the provider page
    assert (
        driver.find_element(By.LINK_TEXT, "Provider").get_attribute("href").endswith("/provider/")
    )
