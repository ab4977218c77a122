"""The customer web UI in a real headless Chromium, against the live server, a real Celery
worker and a real node agent running the rental as a Docker container."""

from __future__ import annotations

import re
from decimal import Decimal
from urllib.parse import urlsplit

import pytest
from selenium.common.exceptions import (
    NoSuchElementException,
    StaleElementReferenceException,
    TimeoutException,
    WebDriverException,
)
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import Select, WebDriverWait

from accounts.models import ApiToken
from accounts.services import token_hash
from billing.models import TelemetrySample
from marketplace.models import Node, NodeStatus, Rental, RentalStatus
from provisioning.models import RunMetric
from provisioning.services import telemetry_flush
from tests.e2e.conftest import credit_customer, managed_containers, remove_managed, wait_for
from tests.factories import UserFactory

pytestmark = [pytest.mark.e2e, pytest.mark.browser, pytest.mark.django_db(transaction=True)]

PASSWORD = "pw-not-secret"  # tests.factories.UserFactory's


def _wait(driver, check, timeout: float = 30, what: str = ""):
    """Poll `check` while the page may be reloading under it (the rental page reloads itself when
    the state changes): an element gone with the old document is looked up again."""
    try:
        return WebDriverWait(
            driver,
            timeout,
            poll_frequency=0.2,
            ignored_exceptions=(
                NoSuchElementException,
                StaleElementReferenceException,
                WebDriverException,  # "node does not belong to the document" mid-reload
            ),
        ).until(check, what)
    except TimeoutException as exc:
        raise AssertionError(
            f"timed out waiting for {what or check}; at {driver.current_url}: "
            f"{driver.page_source[:600]}"
        ) from exc


def _text(driver, element_id: str) -> str:
    return driver.find_element(By.ID, element_id).text


def _log_in(driver, base: str, user, then: str) -> None:
    driver.get(f"{base}/accounts/login/?next={then}")
    _wait(driver, lambda d: d.find_element(By.ID, "id_login"), what="the login form")
    driver.find_element(By.ID, "id_login").send_keys(user.username)
    driver.find_element(By.ID, "id_password").send_keys(PASSWORD)
    driver.find_element(By.CSS_SELECTOR, "main form button[type=submit]").click()
    _landed(driver, then)


def _landed(driver, path: str) -> None:
    """Wait until a navigation that a click started has loaded `path`: a get() issued while it
    is still under way can lose to it."""
    _wait(
        driver,
        lambda d: (
            urlsplit(d.current_url).path == path
            and d.execute_script("return document.readyState") == "complete"
        ),
        what=f"the page {path}",
    )


def _log_out(driver) -> None:
    """Log out with the header's button and wait until the header offers "Log in": the log-out
    lands on "/", so waiting for the path alone returns at once when the page already was "/",
    and a get() issued then can still carry the old session."""
    driver.find_element(By.CSS_SELECTOR, "header .who form[action$='/logout/'] button").click()
    _wait(driver, lambda d: d.find_element(By.LINK_TEXT, "Log in"), what="the logged-out header")
    _landed(driver, "/")


def _status_badge(driver) -> str:
    return driver.find_element(By.ID, "status").text


@pytest.fixture
def funded(settings, user):
    """The real path: the funds check is on and the customer has credit from ops."""
    settings.BILLING_FUNDS_CHECK = True
    credit_customer(user)
    return user


@pytest.fixture(autouse=True)
def _no_leftover_containers(request):
    yield
    if "docker_client" in request.fixturenames:
        client = request.getfixturevalue("docker_client")
        remove_managed(client)


def test_a_customer_finds_a_card_books_the_advice_and_stops_it_in_the_browser(
    browser, live_server, funded, celery_worker, start_agent, docker_client
):
    base = live_server.url
    # Given a provider's host joined through the real agent: two (simulated) RTX 4090 at $0.60
    start_agent()
    wait_for(
        lambda: Node.objects.filter(region="e2e", status=NodeStatus.ONLINE).exists(),
        90,
        "the agent to join",
    )

    # The offers page lists it to anyone, and its filters narrow the list
    browser.get(f"{base}/")
    row = _wait(browser, lambda d: d.find_element(By.CSS_SELECTOR, "#offers tbody tr"))
    assert "RTX 4090" in row.text and "2 / 2" in row.text and "0.60" in row.text
    browser.find_element(By.ID, "f-max_price").send_keys("0.10")
    browser.find_element(By.CSS_SELECTOR, "#filters button[type=submit]").click()
    _wait(browser, lambda d: d.find_element(By.ID, "no-offers").is_displayed())

    # The advisor answers before login; booking needs an account
    _log_in(browser, base, funded, "/advisor/")
    # The booking runs the planned model: the harness's CPU-sized preset on a simulated host,
    # with tokens enough that it still trains when stopped.
    Select(browser.find_element(By.ID, "a-model")).select_by_value("tiny")
    tokens = browser.find_element(By.ID, "a-tokens_b")
    tokens.clear()
    tokens.send_keys("1")
    browser.find_element(By.ID, "a-submit").click()
    option = _wait(
        browser,
        lambda d: d.find_element(By.CSS_SELECTOR, "#options tr[data-card='rtx4090-24gb']"),
        what="the advisor's RTX 4090 answer",
    )
    assert "$" in option.find_element(By.CSS_SELECTOR, "td.cost").text

    # Book it in one step: the page of the new rental opens and follows it to RUNNING
    option.find_element(By.CSS_SELECTOR, "button.book").click()
    _wait(browser, lambda d: re.search(r"/rentals/[0-9a-f-]{36}/$", d.current_url), what="booking")
    rental_id = re.search(r"/rentals/([0-9a-f-]{36})/$", browser.current_url).group(1)
    rental = Rental.objects.get(pk=rental_id)
    assert rental.customer == funded and rental.gpu_models == ["rtx4090-24gb"]
    _wait(browser, lambda d: _status_badge(d) == "RUNNING", 180, "RUNNING on the page")
    rental.refresh_from_db()
    assert rental.status == RentalStatus.RUNNING
    assert str(rental.price_per_gpu_hour) == "0.6000"  # locked at booking
    assert "$0.6000/GPU-hour" in _text(browser, "price")
    assert len(managed_containers(docker_client, rental_id)) == 1
    gpus = browser.find_elements(By.CSS_SELECTOR, "#allocations tbody tr")
    assert len(gpus) == rental.gpus_per_node

    # Stop once it trains: the harness checkpoints, the rental completes, the container is gone
    wait_for(
        lambda: (
            RunMetric.objects.filter(rental_id=rental_id, event="step").exists()
            or print(_container_logs(docker_client, rental_id))
        ),
        120,
        "the first training step",
    )
    # The page shows the harness's progress as it comes: step, loss, throughput, a loss chart
    _wait(
        browser,
        lambda d: d.find_element(By.ID, "training").is_displayed() and int(_text(d, "m-step")) >= 1,
        60,
        "training progress on the page",
    )
    assert float(_text(browser, "m-loss")) > 0
    assert "tokens/s" in _text(browser, "m-speed")
    assert browser.find_element(By.CSS_SELECTOR, "#loss-chart polyline").get_attribute("points")

    # Per-GPU charts from the telemetry the agent sent (stored by the periodic flush, run here)
    # and the live log of the container's output
    def attributed_samples() -> int:
        telemetry_flush()
        return TelemetrySample.objects.filter(rental_id=rental_id).count()

    wait_for(lambda: attributed_samples() >= 2 * rental.gpus_per_node, 60, "GPU samples")

    def chart_points(d) -> dict[str, int]:
        lines = d.find_elements(By.CSS_SELECTOR, ".gpu-chart[data-kind=util] polyline")
        return {line.get_attribute("data-gpu"): len(line.get_attribute("points").split())
                for line in lines}  # fmt: skip

    _wait(
        browser,
        lambda d: (
            d.find_element(By.ID, "gpu-charts").is_displayed()
            and len(chart_points(d)) == rental.gpus_per_node
            and min(chart_points(d).values()) >= 2
        ),
        60,
        "a line per GPU with data points in the charts",
    )
    for kind in ("mem", "power", "temp"):
        assert (
            len(browser.find_elements(By.CSS_SELECTOR, f".gpu-chart[data-kind={kind}] polyline"))
            == rental.gpus_per_node
        )
    _wait(browser, lambda d: '"event"' in _text(d, "log-lines"), 60, "the live log")
    browser.find_element(By.ID, "stop").click()
    browser.switch_to.alert.accept()
    _wait(browser, lambda d: _status_badge(d) == "COMPLETED", 180, "COMPLETED")
    rental.refresh_from_db()
    assert (rental.status, rental.exit_code) == (RentalStatus.COMPLETED, 0)
    history = _text(browser, "events")
    for step in ("SCHEDULED", "PROVISIONING", "RUNNING", "STOPPING", "COMPLETED"):
        assert step in history
    wait_for(lambda: not managed_containers(docker_client, rental_id), 60, "the container to go")
    assert not browser.find_elements(By.ID, "stop")

    # The list of rentals shows it, and another customer cannot see it at all
    browser.get(f"{base}/rentals/")
    assert "COMPLETED" in _text(browser, "rentals")
    other = UserFactory()
    browser.get(f"{base}/")
    _log_out(browser)
    _log_in(browser, base, other, "/rentals/")
    browser.get(f"{base}/rentals/{rental_id}/")
    _landed(browser, f"/rentals/{rental_id}/")
    assert "Not Found" in browser.title or "Not Found" in browser.page_source
    assert not browser.find_elements(By.ID, "status")


def test_bad_input_is_named_in_the_page_and_stores_nothing(browser, live_server, user, make_node):
    base = live_server.url
    make_node(card="a100-sxm4-80gb", gpus=8, price="1.50")
    # A filter that is not a number: the page names it and lists nothing
    browser.get(f"{base}/?max_price=cheap")
    assert "max_price" in _text(browser, "errors")
    assert not browser.find_elements(By.ID, "offers")

    _log_in(browser, base, user, "/rentals/new/")
    # Zero GPUs: refused by the API, the page names the field, no rental row exists
    count = browser.find_element(By.ID, "r-gpus_per_node")
    count.clear()
    count.send_keys("0")
    browser.find_element(By.ID, "r-submit").click()
    _wait(browser, lambda d: "gpus_per_node" in _text(d, "errors"), what="the field error")
    # More GPUs per node than any node has: refused at create with the reason
    count.clear()
    count.send_keys("16")
    browser.find_element(By.ID, "r-submit").click()
    _wait(browser, lambda d: "16" in _text(d, "errors"), what="the never-fits reason")
    assert Rental.objects.count() == 0

    # A request that fits is created and opens its page
    count.clear()
    count.send_keys("2")
    Select(browser.find_element(By.ID, "r-gpu_model")).select_by_value("a100-sxm4-80gb")
    browser.find_element(By.ID, "r-submit").click()
    _wait(browser, lambda d: "/rentals/new/" not in d.current_url, what="the rental page")
    rental = Rental.objects.get()
    assert (rental.customer, rental.gpus_per_node, rental.gpu_models) == (
        user,
        2,
        ["a100-sxm4-80gb"],
    )
    _wait(browser, lambda d: _status_badge(d).lower() in RentalStatus.values, what="its status")


def test_an_api_token_is_shown_once_stored_hashed_and_revoked_in_the_browser(
    browser, live_server, user
):
    base = live_server.url
    _log_in(browser, base, user, "/tokens/")
    browser.find_element(By.ID, "t-name").send_keys("laptop")
    browser.find_element(By.CSS_SELECTOR, "#token-form button").click()
    secret = _wait(browser, lambda d: _text(d, "secret"), what="the new token")
    token = ApiToken.objects.get(user=user, name="laptop")
    # Stored as a hash only; the page shows it once
    assert token.key_hash == token_hash(secret) and secret not in token.key_hash
    browser.refresh()
    assert secret not in browser.page_source
    assert token.prefix in _text(browser, "tokens")
    # Bad input is named and stores nothing
    browser.find_element(By.ID, "t-name").send_keys("ci")
    browser.find_element(By.ID, "t-days").send_keys("soon")
    browser.find_element(By.CSS_SELECTOR, "#token-form button").click()
    _wait(browser, lambda d: "expires_in_days" in _text(d, "errors"))
    assert not ApiToken.objects.filter(name="ci").exists()
    # Revoke: the token stops working at once
    browser.find_element(By.CSS_SELECTOR, f"tr[data-token='{token.pk}'] button.revoke").click()
    _wait(browser, lambda d: "revoked" in _text(d, "tokens"))
    token.refresh_from_db()
    assert token.revoked_at is not None


def test_a_provider_joins_a_host_prices_and_drains_it_in_the_browser(
    browser, live_server, provider, make_node, stack_env, tmp_path
):
    from tests.e2e.conftest import AgentProcess

    base = live_server.url
    listed = make_node(hostname="listed-host", price="1.00", min_bid="0.50")
    _log_in(browser, base, provider.owner, "/provider/")
    row = browser.find_element(By.CSS_SELECTOR, f"tr[data-node='{listed.pk}']")
    assert "listed-host" in row.text and "ONLINE" in row.text

    # A bad price is named and changes nothing; a good one is saved
    price = row.find_element(By.CSS_SELECTOR, "input.price")
    price.clear()
    price.send_keys("0")
    row.find_element(By.CSS_SELECTOR, "button.save-price").click()
    _wait(browser, lambda d: "price_per_gpu_hour" in _text(d, "errors"))
    listed.refresh_from_db()
    assert listed.price_per_gpu_hour == Decimal("1.0000")
    row = browser.find_element(By.CSS_SELECTOR, f"tr[data-node='{listed.pk}']")
    price = row.find_element(By.CSS_SELECTOR, "input.price")
    price.clear()
    price.send_keys("1.25")
    row.find_element(By.CSS_SELECTOR, "button.save-price").click()
    _wait(browser, lambda d: _node_price(listed) == Decimal("1.2500"), what="the new price")
    # the page is drawn again with the stored price (a click on the old one could be lost)
    price_input = f"tr[data-node='{listed.pk}'] input.price"
    _wait(
        browser,
        lambda d: d.find_element(By.CSS_SELECTOR, price_input).get_attribute("value") == "1.2500",
        what="the page with the new price",
    )

    # Drain: the host leaves the offers
    row = _wait(browser, lambda d: d.find_element(By.CSS_SELECTOR, f"tr[data-node='{listed.pk}']"))
    row.find_element(By.CSS_SELECTOR, "button[data-action='drain']").click()
    _wait(
        browser,
        lambda d: (
            "DRAINING" in d.find_element(By.CSS_SELECTOR, f"tr[data-node='{listed.pk}']").text
        ),
    )
    assert Node.objects.get(pk=listed.pk).status == NodeStatus.DRAINING

    # A join token made on the page lets a real agent join the host
    form = browser.find_element(By.CSS_SELECTOR, "form.join-form")
    form.find_element(By.CSS_SELECTOR, ".j-region").send_keys("e2e")
    form.find_element(By.CSS_SELECTOR, ".j-price").send_keys("0.70")
    form.find_element(By.CSS_SELECTOR, ".j-bid").send_keys("0.30")
    form.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
    command = _wait(browser, lambda d: d.find_element(By.CSS_SELECTOR, ".join-command").text)
    token = re.search(r"--join-token (\S+)", command).group(1)
    assert f"--server {base}" in command
    (tmp_path / "agent").mkdir()
    agent = AgentProcess(
        server=base, join_token=token, state=tmp_path / "agent", runtime="process", env=stack_env
    ).start()
    try:
        joined = wait_for(
            lambda: Node.objects.filter(region="e2e", status=NodeStatus.ONLINE).first(),
            90,
            "the agent to join with the page's token",
        )
        assert joined.provider == provider and joined.price_per_gpu_hour == Decimal("0.7000")
        browser.refresh()
        new_row = _wait(
            browser, lambda d: d.find_element(By.CSS_SELECTOR, f"tr[data-node='{joined.pk}']")
        )
        assert "ONLINE" in new_row.text and "0 / 2" in new_row.text
    finally:
        agent.stop()


def _node_price(node) -> Decimal:
    return Node.objects.values_list("price_per_gpu_hour", flat=True).get(pk=node.pk)


def _container_logs(client, rental_id) -> str:
    return "".join(
        c.logs(tail=30).decode(errors="replace") for c in managed_containers(client, rental_id)
    )
