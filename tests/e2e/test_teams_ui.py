"""Teams in a real headless Chromium against the live server, every mail through a real SMTP
server (aiosmtpd): two people sign up and verify by mail; one makes a team and invites the
other, who accepts the mailed link, sees the team's rental and, as a member without the billing
role, is refused the top-up page."""

from __future__ import annotations

import pytest
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import Select

from accounts.models import Membership, Team, TeamRole
from marketplace.models import User
from marketplace.services.rentals import RentalRequest, RuntimeSpec, rental_create
from tests.e2e.test_signup import sign_in, sign_up
from tests.e2e.test_web_ui import _landed, _wait

pytestmark = [pytest.mark.e2e, pytest.mark.browser, pytest.mark.django_db(transaction=True)]


def _log_out(driver, base: str) -> None:
    driver.find_element(By.CSS_SELECTOR, "header .who form[action$='logout/'] button").click()
    _landed(driver, "/")


def test_an_invited_colleague_sees_the_teams_rental_and_is_refused_the_top_up_page(
    browser, live_server, smtp_server, make_node
):
    base = live_server.url
    make_node(card="rtx4090-24gb", gpus=2, price="0.40", region="eu-west")
    # Two people sign up through the pages and verify their address by mail
    sign_up(browser, base, smtp_server, username="carl")
    _log_out(browser, base)
    sign_up(browser, base, smtp_server, username="olga")
    olga, carl = User.objects.get(username="olga"), User.objects.get(username="carl")

    # Olga makes a team on the Team page and switches to it in the header
    browser.get(f"{base}/team/")
    _landed(browser, "/team/")
    browser.find_element(By.ID, "t-name").send_keys("acme")
    browser.find_element(By.CSS_SELECTOR, "#team-form button[type=submit]").click()
    _wait(
        browser,
        lambda d: "acme" in [o.text for o in Select(d.find_element(By.ID, "team-select")).options],
        what="the new team in the switcher",
    )
    acme = Team.objects.get(name="acme")
    Select(browser.find_element(By.ID, "team-select")).select_by_value(str(acme.pk))
    _wait(browser, lambda d: d.find_element(By.TAG_NAME, "h1").text == "Team acme", what="acme")

    # The team has a rental, booked by Olga
    rental = rental_create(
        customer=olga,
        team=acme,
        request=RentalRequest(
            name="acme-training",
            gpus_per_node=1,
            duration_s=3600,
            runtime=RuntimeSpec(image="gpumarket/harness:dev"),
        ),
    )

    # Olga invites Carl as a member; the mail reaches the SMTP server
    browser.find_element(By.ID, "i-email").send_keys(carl.email)
    Select(browser.find_element(By.ID, "i-role")).select_by_value("member")
    browser.find_element(By.CSS_SELECTOR, "#invite-form button[type=submit]").click()
    _wait(browser, lambda d: d.find_element(By.ID, "invited").is_displayed(), what="sent")
    assert "mailed" in browser.find_element(By.ID, "invited-text").text
    link = smtp_server.link(carl.email, rf"/teams/{acme.pk}/join/[^/]+/$")
    assert link.startswith(base)

    # Carl opens the link signed out: asked to sign in first, then shown the team
    _log_out(browser, base)
    browser.get(link)
    _wait(browser, lambda d: d.find_element(By.ID, "id_login"), what="the sign-in form")
    sign_in(browser, base, login="carl", then=link.removeprefix(base))
    text = _wait(browser, lambda d: d.find_element(By.ID, "invitation-text"), what="invitation")
    assert "acme" in text.text
    browser.find_element(By.ID, "accept").click()

    # Then he lands on the team's rentals and sees Olga's rental
    _landed(browser, "/rentals/")
    assert browser.find_element(By.TAG_NAME, "h1").text == "Rentals · team acme"
    assert "acme-training" in browser.find_element(By.ID, "rentals").text
    browser.get(f"{base}/rentals/{rental.pk}/")
    _wait(browser, lambda d: "acme-training" in d.find_element(By.TAG_NAME, "h1").text)
    assert Membership.objects.get(team=acme, user=carl).role == TeamRole.MEMBER

    # And, a member without the billing role, he is refused the top-up page
    browser.get(f"{base}/billing/topup/")
    refused = _wait(browser, lambda d: d.find_element(By.ID, "refused"), what="the refusal")
    assert refused.text == "only the team's owners and billing members manage its money"
    assert not browser.find_elements(By.ID, "topup")

    # The link is spent: opening it again explains why, and changes nothing
    browser.get(link)
    browser.find_element(By.ID, "accept").click()
    error = _wait(browser, lambda d: d.find_element(By.ID, "invitation-error"))
    assert "used already" in error.text
    assert Membership.objects.filter(team=acme).count() == 2
