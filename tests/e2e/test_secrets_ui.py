"""The Secrets page in a real browser: set (and replace) by name, listed without its value,
used by the rental form, deleted."""

from __future__ import annotations

import pytest
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import Select

from accounts.models import TeamSecret
from marketplace.models import Rental
from tests.e2e.test_web_ui import _log_in, _text, _wait

pytestmark = [pytest.mark.e2e, pytest.mark.browser, pytest.mark.django_db(transaction=True)]

VALUE = "wandb-k3y-0123456789abcdef"


def _fill(driver, element_id: str, text: str) -> None:
    field = driver.find_element(By.ID, element_id)
    field.clear()
    field.send_keys(text)


def test_a_secret_is_set_listed_used_and_deleted_in_the_browser(
    browser, live_server, user, make_node
):
    base = live_server.url
    make_node(card="a100-sxm4-80gb", gpus=8, price="1.50")
    _log_in(browser, base, user, "/secrets/")
    assert browser.find_element(By.CSS_SELECTOR, "nav a[aria-current=page]").text == "Secrets"

    # A bad name is named, and nothing is stored
    _fill(browser, "s-name", "NO-DASHES")
    _fill(browser, "s-value", VALUE)
    browser.find_element(By.CSS_SELECTOR, "#secret-form button[type=submit]").click()
    _wait(browser, lambda d: "name" in _text(d, "errors"), what="the field error")
    assert not TeamSecret.objects.exists()

    _fill(browser, "s-name", "WANDB_API_KEY")
    browser.find_element(By.CSS_SELECTOR, "#secret-form button[type=submit]").click()
    _wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "tr[data-secret]"),
          what="the listed secret")  # fmt: skip
    assert "WANDB_API_KEY" in _text(browser, "secrets")
    assert VALUE not in browser.page_source

    # The rental form offers it; the rental gets it by name
    browser.get(f"{base}/rentals/new/")
    Select(browser.find_element(By.ID, "r-secrets")).select_by_value("WANDB_API_KEY")
    browser.find_element(By.ID, "r-submit").click()
    _wait(browser, lambda d: "/rentals/new/" not in d.current_url, what="the rental page")
    assert Rental.objects.get().secrets == [
        {"name": "WANDB_API_KEY", "env": "WANDB_API_KEY", "file": ""}
    ]
    assert VALUE not in browser.page_source

    # Deleted
    browser.get(f"{base}/secrets/")
    browser.find_element(By.CSS_SELECTOR, "tr[data-secret='WANDB_API_KEY'] button.remove").click()
    _wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "tr.empty"), what="the empty list")
    assert not TeamSecret.objects.exists()
