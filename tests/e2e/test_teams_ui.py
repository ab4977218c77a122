"""Teams in a real headless Chromium against the live server, with the invitation delivered by
a real SMTP server (aiosmtpd): an owner invites a colleague, who signs in, accepts, sees the
team's rental, and, being a member without the billing role, is refused the top-up page."""

from __future__ import annotations

import re
import socket
from dataclasses import dataclass, field
from email import message_from_bytes
from email.message import Message

import pytest
from aiosmtpd.controller import Controller
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import Select

from marketplace.models import Membership, Team, TeamRole
from marketplace.services import user_create
from marketplace.services.rentals import RentalRequest, RuntimeSpec, rental_create
from tests.e2e.conftest import wait_for
from tests.e2e.test_web_ui import _landed, _wait

pytestmark = [pytest.mark.e2e, pytest.mark.browser, pytest.mark.django_db(transaction=True)]

PASSWORD = "a-long-enough-password"


@dataclass
class Inbox:
    """What the SMTP server received."""

    messages: list[Message] = field(default_factory=list)

    async def handle_DATA(self, server, session, envelope) -> str:
        self.messages.append(message_from_bytes(envelope.original_content))
        return "250 OK"


@pytest.fixture
def smtp(settings):
    """A real SMTP server on a free port; Django's SMTP backend sends to it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    inbox = Inbox()
    controller = Controller(inbox, hostname="127.0.0.1", port=port)
    controller.start()
    settings.EMAIL_BACKEND = "django.core.mail.backends.smtp.EmailBackend"
    settings.EMAIL_HOST, settings.EMAIL_PORT = "127.0.0.1", port
    settings.EMAIL_USE_TLS = settings.EMAIL_USE_SSL = False
    settings.EMAIL_TIMEOUT = 10
    yield inbox
    controller.stop()


def _sign_in(driver, person) -> None:
    """Fill the sign-in form the browser is on."""
    _wait(driver, lambda d: d.find_element(By.ID, "id_username"), what="the sign-in form")
    driver.find_element(By.ID, "id_username").send_keys(person.username)
    driver.find_element(By.ID, "id_password").send_keys(PASSWORD)
    driver.find_element(By.CSS_SELECTOR, "main form button[type=submit]").click()


def test_an_invited_colleague_sees_the_teams_rental_and_is_refused_the_top_up_page(
    browser, live_server, smtp, make_node
):
    base = live_server.url
    # Given two people made by the customer-creation service, and a free GPU
    owner = user_create(username="olga", email="olga@example.invalid", password=PASSWORD)
    colleague = user_create(username="carl", email="carl@example.invalid", password=PASSWORD)
    make_node(card="rtx4090-24gb", gpus=2, price="0.40", region="eu-west")

    # The owner signs in and makes a team from the Team page, then switches to it
    browser.get(f"{base}/accounts/login/?next=/team/")
    _sign_in(browser, owner)
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

    # The team has a rental, booked by the owner
    rental = rental_create(
        customer=owner,
        team=acme,
        request=RentalRequest(
            name="acme-training",
            gpus_per_node=1,
            duration_s=3600,
            runtime=RuntimeSpec(image="gpumarket/harness:dev"),
        ),
    )

    # The owner invites the colleague as a member; the mail reaches the SMTP server
    browser.find_element(By.ID, "i-email").send_keys(colleague.email)
    Select(browser.find_element(By.ID, "i-role")).select_by_value("member")
    browser.find_element(By.CSS_SELECTOR, "#invite-form button[type=submit]").click()
    _wait(browser, lambda d: d.find_element(By.ID, "invited").is_displayed(), what="sent")
    assert "mailed" in browser.find_element(By.ID, "invited-text").text
    message = wait_for(lambda: smtp.messages[:1], 30, "the invitation mail")[0]
    assert message["To"] == colleague.email
    body = message.get_payload(decode=True).decode()
    link = re.search(r"(http://\S+/teams/\d+/join/\S+/)", body).group(1)
    assert link.startswith(base)

    # The colleague opens the link in a fresh session: asked to sign in first
    browser.delete_all_cookies()
    browser.get(link)
    _sign_in(browser, colleague)
    _wait(browser, lambda d: d.find_element(By.ID, "invitation-text"), what="the invitation")
    assert "acme" in browser.find_element(By.ID, "invitation-text").text
    browser.find_element(By.ID, "accept").click()

    # Then they land on the team's rentals and see the owner's rental
    _landed(browser, "/rentals/")
    assert "acme-training" in browser.find_element(By.TAG_NAME, "main").text
    browser.get(f"{base}/rentals/{rental.pk}/")
    _wait(browser, lambda d: "acme-training" in d.find_element(By.TAG_NAME, "h1").text)
    assert Membership.objects.get(team=acme, user=colleague).role == TeamRole.MEMBER

    # And, a member without the billing role, they are refused the top-up page
    browser.get(f"{base}/billing/topup/")
    refused = _wait(browser, lambda d: d.find_element(By.ID, "refused"), what="the refusal")
    assert refused.text == "only the team's owners and billing members manage its money"
    assert not browser.find_elements(By.ID, "topup")

    # The link is spent: opening it again explains why
    browser.get(link)
    browser.find_element(By.ID, "accept").click()
    error = _wait(browser, lambda d: d.find_element(By.ID, "invitation-error"))
    assert "used already" in error.text
    assert Membership.objects.filter(team=acme).count() == 2
