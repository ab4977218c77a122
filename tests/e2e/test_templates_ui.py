"""Rental templates in the browser: saved on the templates page, a rental started from one on
the new-rental page, and deleted; a bad template is named and stores nothing."""

from __future__ import annotations

import pytest
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import Select

from marketplace.models import Rental, RentalTemplate
from tests.e2e.test_web_ui import _log_in, _text, _wait

pytestmark = [pytest.mark.e2e, pytest.mark.browser, pytest.mark.django_db(transaction=True)]


def _fill(driver, element_id: str, text: str) -> None:
    field = driver.find_element(By.ID, element_id)
    field.clear()
    field.send_keys(text)


def test_a_template_is_saved_used_and_deleted_in_the_browser(browser, live_server, user, make_node):
    base = live_server.url
    make_node(card="a100-sxm4-80gb", gpus=8, price="1.50")
    _log_in(browser, base, user, "/templates/")
    assert _text(browser, "no-templates") == "No templates yet."

    # A bad name is named, and nothing is saved
    _fill(browser, "t-name", "Not a slug!")
    browser.find_element(By.ID, "t-submit").click()
    _wait(browser, lambda d: "name" in _text(d, "errors"), what="the field error")
    assert not RentalTemplate.objects.exists()

    _fill(browser, "t-name", "gpt-text")
    _fill(browser, "t-description", "GPT on the bundled text")
    _fill(browser, "t-env", "WANDB_MODE=offline\nSEED=3")
    _fill(browser, "t-ports", "8888")
    _fill(browser, "t-harness_config", '{"model": {"name": "gpt"}, "data": {"name": "text"}}')
    browser.find_element(By.ID, "t-submit").click()
    _wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "#templates tr[data-name]"),
          what="the saved template")  # fmt: skip
    row = browser.find_element(By.CSS_SELECTOR, "#templates tr[data-name='gpt-text']")
    assert "GPT on the bundled text" in row.text and "ports 8888" in row.text

    # Rent from it: the new-rental page opens with it chosen
    row.find_element(By.CSS_SELECTOR, "a.rent").click()
    _wait(browser, lambda d: d.find_element(By.ID, "r-template"), what="the rental form")
    chosen = Select(browser.find_element(By.ID, "r-template")).first_selected_option
    assert chosen.get_attribute("value") == "gpt-text"
    Select(browser.find_element(By.ID, "r-workload")).select_by_value("image")  # not used
    browser.find_element(By.ID, "r-submit").click()
    _wait(browser, lambda d: "/rentals/new/" not in d.current_url, what="the rental page")
    rental = Rental.objects.get()
    assert rental.harness_config == {"model": {"name": "gpt"}, "data": {"name": "text"}}
    assert rental.env == {"WANDB_MODE": "offline", "SEED": "3"} and rental.ports == [8888]

    # Deleted
    browser.get(f"{base}/templates/")
    browser.find_element(By.CSS_SELECTOR, "button.delete[data-name='gpt-text']").click()
    browser.switch_to.alert.accept()
    _wait(browser, lambda d: d.find_elements(By.ID, "no-templates"), what="the empty list")
    assert not RentalTemplate.objects.exists()
