"""What a new person sees first on each page, in a real headless Chromium at 1400 x 1000 against
the live server: empty states, amounts, tables and the navigation that fit the window, commands
shown as they are typed, charts with their axes. Each test saves a screenshot under its tmp_path."""

from __future__ import annotations

import itertools
import re
import shlex
from decimal import Decimal
from pathlib import Path

import pytest
from django.conf import settings
from django.test import Client
from django.utils import timezone
from selenium.common.exceptions import (
    NoSuchElementException,
    StaleElementReferenceException,
    TimeoutException,
)
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import Select, WebDriverWait

from billing.models import TelemetrySample
from billing.services.ledger import account_adjust, account_for_team
from billing.services.rating import billing_pass_run
from billing.templatetags.billing_money import usd
from marketplace.models import Node
from marketplace.services.rentals import RentalRequest, RuntimeSpec, rental_create
from marketplace.templatetags.web_format import SIMULATED_HOST_FLAGS, shell_command
from nodeagent.config import load_config
from tests.billing.conftest import book, book_many, fund  # noqa: F401 (fixtures)
from tests.factories import ProviderFactory, UserFactory, personal_team

pytestmark = [pytest.mark.e2e, pytest.mark.browser, pytest.mark.django_db(transaction=True)]

PASSWORD = "pw-not-secret"  # tests.factories.UserFactory's


def _wait(driver, check, timeout: float = 20, what: str = ""):
    try:
        return WebDriverWait(
            driver,
            timeout,
            poll_frequency=0.2,
            ignored_exceptions=(NoSuchElementException, StaleElementReferenceException),
        ).until(check, what)
    except TimeoutException as exc:
        raise AssertionError(
            f"timed out waiting for {what or check} at {driver.current_url}"
        ) from exc


def _open(driver, base: str, user, path: str) -> None:
    """Open `path` signed in as `user`: a session made on the server, its cookie handed to the
    browser (the sign-in form has tests of its own)."""
    client = Client()
    client.force_login(user)
    driver.get(f"{base}/accounts/login/")
    driver.add_cookie(
        {
            "name": settings.SESSION_COOKIE_NAME,
            "value": client.cookies[settings.SESSION_COOKIE_NAME].value,
            "path": "/",
        }
    )
    driver.get(f"{base}{path}")
    _wait(driver, lambda d: d.execute_script("return document.readyState") == "complete")


def _shot(driver, tmp_path: Path, name: str) -> None:
    driver.save_screenshot(str(tmp_path / f"{name}.png"))


def _rect(driver, element) -> dict:
    return driver.execute_script("return arguments[0].getBoundingClientRect().toJSON();", element)


def _argv(command: str) -> list[str]:
    """A shown command as the shell reads it: continuation lines joined, then split in words."""
    return shlex.split(command.replace("\\\n", ""))


def _dollars(text: str) -> Decimal:
    """An amount as the pages print it ($1,234.5678, -$0.01) back to a number."""
    match = re.fullmatch(r"(-?)\$([0-9,]+\.[0-9]+)", text.strip())
    assert match, f"not an amount as the pages print them: {text!r}"
    return Decimal(match.group(1) + match.group(2).replace(",", ""))


def test_the_tokens_page_drops_its_empty_state_once_the_first_token_is_made(
    browser, live_server, user, tmp_path
):
    # Given a person without tokens: the table says so
    _open(browser, live_server.url, user, "/tokens/")
    empty = browser.find_element(By.CSS_SELECTOR, "#tokens tbody tr.empty")
    assert empty.is_displayed() and empty.text == "No tokens yet."
    # When the first token is made on the page
    browser.find_element(By.ID, "t-name").send_keys("laptop")
    browser.find_element(By.CSS_SELECTOR, "#token-form button").click()
    _wait(browser, lambda d: d.find_element(By.ID, "secret").text, what="the new token")
    _shot(browser, tmp_path, "tokens")
    # Then the table lists it, and no longer says it has none
    rows = browser.find_elements(By.CSS_SELECTOR, "#tokens tbody tr")
    assert [r.text.split(" ")[0] for r in rows if r.is_displayed()] == ["laptop"]
    assert not empty.is_displayed()
    assert "No tokens yet." not in browser.find_element(By.ID, "tokens").text


def test_the_ledger_prints_amounts_exactly_with_the_sign_before_the_dollar(
    browser, live_server, user, tmp_path
):
    # Given a ledger with amounts of whole cents, sub-cent ones and ones below zero
    account = account_for_team(team=personal_team(user))
    for micros, memo in [
        (25_000_000, "welcome credit"),
        (-10_000, "one cent back"),
        (-4, "four micro-dollars"),
        (4_200, "a fraction of a cent"),
        (-1_234_567_891, "a large refund"),
    ]:
        account_adjust(account_id=account.pk, amount_micros=micros, reason=memo, actor=None)
    _open(browser, live_server.url, user, "/billing/")
    _shot(browser, tmp_path, "ledger")
    amounts = {
        row.find_element(By.CSS_SELECTOR, "td:last-child").text: row.find_element(
            By.CSS_SELECTOR, "td.num"
        ).text
        for row in browser.find_elements(By.CSS_SELECTOR, "#ledger tbody tr")
    }
    assert amounts == {
        "welcome credit": "$25.00",
        "one cent back": "-$0.01",
        "four micro-dollars": "-$0.000004",
        "a fraction of a cent": "$0.0042",
        "a large refund": "-$1,234.567891",
    }
    # The balance is the rows' sum, to the micro-dollar
    balance = _dollars(browser.find_element(By.ID, "balance-amount").text)
    assert balance == sum(_dollars(a) for a in amounts.values())
    assert "$-" not in browser.find_element(By.TAG_NAME, "main").text
    # And the pages' JavaScript formats every amount as the server's filter does
    samples = [0, 1, -1, -4, 4_200, -10_000, 10_000, 999_999, -1_000_000, 123_456_789_012]
    in_page = browser.execute_script("return arguments[0].map(usd);", samples)
    assert in_page == [usd(m) for m in samples]


def test_provider_earnings_rows_add_up_to_the_totals(
    browser,
    live_server,
    provider,
    make_node,
    book_many,  # noqa: F811 (the fixture imported above)
    tmp_path,
):
    # Given four short rentals on a cheap host: each earns the provider a fraction of a cent
    make_node(gpus=8, price="0.05")
    booked = book_many([{"gpus": 1, "hours": 1, "hours_ago": 2} for _ in range(4)])
    for one in booked:
        one.report(seq=1, confirmed_s=300)
    billing_pass_run()
    _open(browser, live_server.url, provider.owner, "/provider/")
    section = browser.find_element(By.CSS_SELECTOR, "section.provider")
    rows = _wait(
        browser,
        lambda d: section.find_elements(By.CSS_SELECTOR, "table.entries tbody tr:not(.empty)"),
        what="the earnings rows",
    )
    _shot(browser, tmp_path, "earnings")
    # Then no row shows as nothing, and the rows add up to what the totals say
    amounts = [_dollars(r.find_element(By.CSS_SELECTOR, "td.num").text) for r in rows]
    assert len(amounts) == 4 and all(Decimal(0) < a < Decimal("0.01") for a in amounts)
    total = _dollars(section.find_element(By.CSS_SELECTOR, ".e-total").text)
    assert total == sum(amounts)
    assert _dollars(section.find_element(By.CSS_SELECTOR, ".e-balance").text) == total


def test_the_offers_table_fits_a_1400_pixel_window_with_its_rent_links(
    browser, live_server, make_node, tmp_path
):
    # Given a realistic list: several cards, long host names, hosts of several providers
    for i, (card, gpus, price) in enumerate(
        [
            ("h100-sxm5-80gb", 8, "2.49"),
            ("a100-sxm4-80gb", 8, "1.29"),
            ("rtx4090-24gb", 2, "0.39"),
            ("a100-sxm4-80gb", 4, "1.35"),
            ("h100-sxm5-80gb", 8, "2.79"),
            ("rtx4090-24gb", 4, "0.44"),
        ]
    ):
        make_node(
            card=card,
            gpus=gpus,
            price=price,
            nvlink=gpus == 8,
            hostname=f"gpu-{card}-rack{i:02d}.dc-frankfurt-2.example-compute.net",
            region=["eu-west", "us-east-2", "ap-southeast-1"][i % 3],
        )
    browser.get(f"{live_server.url}/")
    assert browser.execute_script("return window.innerWidth") >= 1300  # the fixture's window
    _shot(browser, tmp_path, "offers")
    width = browser.execute_script("return document.documentElement.clientWidth")
    wrap = browser.find_element(By.ID, "offers-wrap")
    assert browser.execute_script(
        "return arguments[0].scrollWidth <= arguments[0].clientWidth", wrap
    )
    assert browser.execute_script("return document.documentElement.scrollWidth") <= width
    headers = browser.find_elements(By.CSS_SELECTOR, "#offers thead th")
    assert len(headers) == 13  # the interconnect column included
    for element in headers + browser.find_elements(By.CSS_SELECTOR, "#offers a.rent"):
        box = _rect(browser, element)
        assert box["left"] >= 0 and box["right"] <= width, (element.text, box)
    assert len(browser.find_elements(By.CSS_SELECTOR, "#offers a.rent")) == 6


def test_the_navigation_is_one_line_at_1400_pixels_with_every_link(browser, live_server, tmp_path):
    # Given the longest navigation: staff who own a provider, with two teams
    staff = UserFactory(username="operations-lead", is_staff=True, totp=False)
    ProviderFactory(owner=staff, name="Frankfurt GPU Cloud")
    _open(browser, live_server.url, staff, "/rentals/")
    _shot(browser, tmp_path, "navigation")
    links = browser.find_elements(By.CSS_SELECTOR, "header nav a")
    assert [a.text for a in links] == [
        "Offers", "Advisor", "Rentals", "Datasets", "Billing", "API tokens", "Team", "SSH keys",
        "Secrets", "Notifications", "Provider", "Admin", "API docs",
    ]  # fmt: skip
    width = browser.execute_script("return document.documentElement.clientWidth")
    tops = {round(_rect(browser, a)["top"]) for a in links}
    assert len(tops) == 1, tops
    for a in links:
        assert _rect(browser, a)["right"] <= width, a.text  # in sight, not scrolled away
    header = _rect(browser, browser.find_element(By.TAG_NAME, "header"))
    line = browser.execute_script(
        "return parseFloat(getComputedStyle(document.querySelector('header nav a')).lineHeight)"
    )
    assert header["height"] < 2 * line + 40  # one line of links plus the header's padding


def test_the_advisor_names_the_region_only_when_one_was_asked(
    browser, live_server, make_node, tmp_path
):
    # Given no offer at all
    browser.get(f"{live_server.url}/advisor/")
    browser.find_element(By.ID, "a-submit").click()
    reasons = _wait(browser, lambda d: d.find_element(By.ID, "reasons").text, what="the answer")
    _shot(browser, tmp_path, "advisor-anywhere")
    assert "region" not in reasons and "free" in reasons
    # With a region asked for, the answer names it
    browser.find_element(By.ID, "a-region").send_keys("mars-1")
    browser.find_element(By.ID, "a-submit").click()
    _wait(browser, lambda d: "mars-1" in d.find_element(By.ID, "reasons").text, what="the region")


def test_a_rentals_multi_line_command_is_shown_as_typed_and_copyable(
    browser, live_server, user, make_node, tmp_path
):
    # Given a rental whose command is a script of several lines
    make_node(gpus=8)
    script = "set -e\npython train.py --epochs 3 --lr 3e-4\necho done"
    argv = ["bash", "-c", script]
    rental = rental_create(
        customer=user,
        team=personal_team(user),
        request=RentalRequest(
            gpus_per_node=1,
            duration_s=3600,
            runtime=RuntimeSpec(image="gpumarket/harness:dev", command=argv),
        ),
    )
    _open(browser, live_server.url, user, f"/rentals/{rental.pk}/")
    _shot(browser, tmp_path, "rental-command")
    shown = browser.find_element(By.ID, "rental-command")
    # Then it is preformatted with its line breaks, and pasting it runs the same argv
    assert shown.tag_name == "pre"
    assert browser.execute_script("return arguments[0].textContent", shown) == shell_command(argv)
    assert _argv(shown.text) == argv
    assert len(shown.text.splitlines()) == 4
    copy = shown.find_element(By.XPATH, "../button[contains(@class, 'copy')]")
    assert copy.is_displayed()
    copy.click()
    _wait(browser, lambda d: copy.text in ("Copied", "Selected: Ctrl+C"), what="the copy")


def test_the_provider_page_prints_the_gpu_host_and_the_simulated_host_commands(
    browser, live_server, provider, tmp_path
):
    _open(browser, live_server.url, provider.owner, "/provider/")
    form = browser.find_element(By.CSS_SELECTOR, "form.join-form")
    form.find_element(By.CSS_SELECTOR, ".j-region").send_keys("eu-west")
    form.find_element(By.CSS_SELECTOR, ".j-price").send_keys("0.70")
    form.find_element(By.CSS_SELECTOR, ".j-bid").send_keys("0.30")
    form.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
    real = _wait(browser, lambda d: d.find_element(By.CSS_SELECTOR, "pre.join-command").text)
    _shot(browser, tmp_path, "provider-commands")
    simulated = browser.find_element(By.CSS_SELECTOR, "pre.join-command-simulated").text
    # Both are multi-line commands with a copy button, told apart by when to use them
    result = browser.find_element(By.CSS_SELECTOR, ".join-result").text
    assert "On a GPU host" in result and "Simulated host (development)" in result
    assert "NVML Shared Library Not Found" in result
    assert len(browser.find_elements(By.CSS_SELECTOR, ".join-result .command button.copy")) == 2
    assert len(real.splitlines()) == 3 and len(simulated.splitlines()) > 3
    real_argv, simulated_argv = _argv(real), _argv(simulated)
    token = real_argv[real_argv.index("--join-token") + 1]
    assert real_argv == ["gpumarket-agent", "--server", live_server.url, "--join-token", token]
    assert simulated_argv == [*real_argv, *SIMULATED_HOST_FLAGS]
    # The agent takes the simulated one as it is: simulated GPUs on the local-process runtime
    config = load_config(simulated_argv[1:], environ={})
    assert (config.runtime, config.gpu_mode, config.telemetry) == ("process", "none", "simulated")
    assert config.simulate_gpus == "rtx4090-24gb:2"
    assert "--simulate-gpus" not in real_argv and "--runtime" not in real_argv


def test_the_totp_set_up_page_shows_the_whole_secret(browser, live_server, tmp_path):
    # Given staff without an authenticator app, asked for the password again before set-up
    staff = UserFactory(username="ops", is_staff=True, totp=False)
    _open(browser, live_server.url, staff, "/accounts/2fa/totp/activate/")
    if browser.find_elements(By.ID, "id_password"):
        browser.find_element(By.ID, "id_password").send_keys(PASSWORD)
        browser.find_element(By.CSS_SELECTOR, "main form button[type=submit]").click()
    field = _wait(browser, lambda d: d.find_element(By.ID, "authenticator_secret"))
    _shot(browser, tmp_path, "totp")
    secret = field.get_attribute("value")
    assert re.fullmatch(r"[A-Z2-7]{16,}", secret)
    fits = "return arguments[0].scrollWidth <= arguments[0].clientWidth"
    assert browser.execute_script(fits, field), "the secret is cut off in its field"
    assert _rect(browser, field)["right"] <= browser.execute_script("return innerWidth")


def test_the_rental_charts_have_a_time_axis_and_titled_axes(
    browser, live_server, user, make_node, rent, tmp_path
):
    # Given a rental's GPUs measured every 20 s for the last half hour
    make_node(gpus=8)
    rental = rent(2)
    node = Node.objects.first()
    now = timezone.now().replace(microsecond=0)
    TelemetrySample.objects.bulk_create(
        TelemetrySample(
            node_id=node.pk,
            gpu_index=gpu,
            ts=now - timezone.timedelta(seconds=20 * i),
            util_pct=60 + 30 * gpu - i % 7,
            mem_used_mb=40_000 + 100 * i,
            power_w=250 + gpu * 40 + i % 5,
            temp_c=55 + gpu * 5,
            rental_id=rental.pk,
        )
        for gpu in range(2)
        for i in range(90)
    )
    _open(browser, live_server.url, user, f"/rentals/{rental.pk}/")
    util = _wait(
        browser,
        lambda d: (
            d.find_element(By.CSS_SELECTOR, ".gpu-chart[data-kind=util]")
            if d.find_element(By.ID, "gpu-charts").is_displayed()
            else None
        ),
        what="the charts",
    )
    browser.execute_script("arguments[0].scrollIntoView()", util)
    _shot(browser, tmp_path, "charts")
    titles = {"util": "Utilisation (%)", "mem": "Memory used (MB)", "power": "Power (W)",
              "temp": "Temperature (°C)"}  # fmt: skip
    for kind, title in titles.items():
        chart = browser.find_element(By.CSS_SELECTOR, f".gpu-chart[data-kind={kind}]")
        ticks = [t.text for t in chart.find_elements(By.CSS_SELECTOR, ".x-tick")]
        assert 3 <= len(ticks) <= 7 and all(re.fullmatch(r"\d\d:\d\d", t) for t in ticks), ticks
        assert ticks == sorted(ticks) or ticks[0] > ticks[-1]  # in order (past midnight wraps)
        assert chart.find_element(By.CSS_SELECTOR, ".x-title").text == "Time (UTC)"
        assert chart.find_element(By.CSS_SELECTOR, ".y-title").text == title
        assert len(chart.find_elements(By.CSS_SELECTOR, ".y-tick")) >= 3
        assert len(chart.find_elements(By.CSS_SELECTOR, "polyline")) == 2
        # no label overlaps the next one
        boxes = [_rect(browser, t) for t in chart.find_elements(By.CSS_SELECTOR, ".x-tick")]
        assert all(a["right"] < b["left"] for a, b in itertools.pairwise(boxes))


def test_the_onboarding_page_prints_the_simulated_host_variant_too(
    browser, live_server, provider, tmp_path
):
    _open(browser, live_server.url, provider.owner, "/provider/onboard/")
    form = browser.find_element(By.ID, "join-form")
    form.find_element(By.ID, "id_region").send_keys("eu-west")
    form.find_element(By.ID, "id_price").send_keys("0.70")
    form.find_element(By.ID, "id_min_bid").send_keys("0.30")
    form.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
    real = _wait(browser, lambda d: d.find_element(By.ID, "join-command").text)
    _shot(browser, tmp_path, "onboard-commands")
    simulated = browser.find_element(By.ID, "join-command-simulated").text
    assert _argv(simulated) == [*_argv(real), *SIMULATED_HOST_FLAGS]
    assert len(browser.find_elements(By.CSS_SELECTOR, "#join-result .command button.copy")) == 2


def test_the_advisor_prints_estimates_in_the_shared_money_format(
    browser, live_server, make_node, tmp_path
):
    make_node(card="rtx4090-24gb", gpus=2, price="0.60")
    browser.get(f"{live_server.url}/advisor/")
    Select(browser.find_element(By.ID, "a-model")).select_by_value("gpt2-124m")
    browser.find_element(By.ID, "a-submit").click()
    cost = _wait(browser, lambda d: d.find_element(By.CSS_SELECTOR, "#options td.cost").text)
    _shot(browser, tmp_path, "advisor")
    assert re.fullmatch(r"\$[0-9,]+\.[0-9]{2}", cost)
    assert browser.execute_script("return document.documentElement.scrollWidth") <= 1400


def test_the_advisor_shows_what_a_booking_holds_beside_the_estimate(
    browser, live_server, make_node, tmp_path
):
    # The case behind it: "$0.04 and 0.0-0.1 h" on the page, and the booking held $0.13 for
    # 0.17 h. A short run's time reads as seconds or minutes, and the booked time and the held
    # amount stand beside the estimate, with why they differ.
    make_node(card="rtx4090-24gb", gpus=2, price="0.60")
    browser.get(f"{live_server.url}/advisor/")
    Select(browser.find_element(By.ID, "a-model")).select_by_value("gpt2-124m")
    tokens = browser.find_element(By.ID, "a-tokens_b")
    tokens.clear()
    tokens.send_keys("0.0001")
    browser.find_element(By.ID, "a-submit").click()
    row = _wait(browser, lambda d: d.find_element(By.CSS_SELECTOR, "#options tbody tr"))
    _shot(browser, tmp_path, "advisor-hold")
    cells = {c: row.find_element(By.CSS_SELECTOR, f"td.{c}").text for c in ("hours", "booked")}
    assert re.fullmatch(r"[0-9]+ (s|min)", cells["hours"]), cells
    assert cells["booked"] == "10 min"  # the shortest booking
    held = row.find_element(By.CSS_SELECTOR, "td.held").text
    gpus = int(row.find_elements(By.CSS_SELECTOR, "td")[1].text)
    # 10 minutes of the plan's GPUs at $0.60 per GPU-hour: $0.10 a GPU, exactly
    assert held == f"${gpus / 10:.2f}"
    assert (
        "only the GPU-seconds the run uses are charged"
        in browser.find_element(By.ID, "hold-note").text
    )
