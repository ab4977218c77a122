"""JupyterLab in a rental on the real stack: the live server, a Celery worker and a node agent on
the Docker Engine with the harness image (which carries JupyterLab: deploy/harness/).

In the browser, a customer rents with the form's JupyterLab box and a published port, the
rental page links "Open JupyterLab" (the agent's published port, with the rental's token) and
the port's URL, and the link opens a working JupyterLab. On the command line, `gpumarket
jupyter ID` opens a tunnel with Debian's OpenSSH client into the rental's sshd and prints the
local URL, through which the notebook server answers.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys

import pytest
import requests
from rest_framework.test import APIClient
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import Select

from accounts.services.sshkeys import ssh_key_add
from accounts.services.tokens import api_token_create
from marketplace import lifecycle
from marketplace.models import Node, NodeStatus, Rental
from tests.e2e.conftest import HARNESS_IMAGE, ROOT, credit_customer, remove_managed
from tests.e2e.conftest import wait_for as wait
from tests.e2e.test_ssh import _keypair
from tests.e2e.test_web_ui import _log_in, _wait
from tests.factories import personal_team
from tests.nodeagent.runtime.test_publish import free_range

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


@pytest.fixture(autouse=True)
def _no_leftover_containers(docker_client):
    yield
    remove_managed(docker_client)


@pytest.fixture
def publishing_agent(stack_env, start_agent, user, settings):
    """A funded customer and a joined agent publishing ports on loopback from a range."""
    settings.BILLING_FUNDS_CHECK = True
    credit_customer(user)
    first, last = free_range(8)
    stack_env.update(
        GPUMARKET_PUBLISH_PORTS=f"{first}-{last}",
        GPUMARKET_PUBLISH_ADDRESS="127.0.0.1",
        GPUMARKET_PUBLIC_HOST="127.0.0.1",
    )
    agent = start_agent(runtime="docker")
    wait(lambda: Node.objects.filter(region="e2e", status=NodeStatus.ONLINE).exists(), 120,
         "the agent to join")  # fmt: skip
    return agent, (first, last)


def _lab_loaded(driver) -> bool:
    """JupyterLab's shell is up: its launcher or main dock panel is in the page."""
    return bool(driver.find_elements(By.CSS_SELECTOR, "#jp-main-dock-panel, .jp-Launcher"))


@pytest.mark.browser
def test_the_rental_page_opens_jupyterlab_with_its_token(
    browser, live_server, user, celery_worker, publishing_agent, docker_client
):
    agent, (first, last) = publishing_agent
    base = live_server.url
    # given the new-rental form: own image, a small web server as the command, port 8000
    # published, and the JupyterLab box ticked
    _log_in(browser, base, user, "/rentals/new/")
    Select(browser.find_element(By.ID, "r-workload")).select_by_value("image")
    image = browser.find_element(By.ID, "r-image")
    image.clear()
    image.send_keys(HARNESS_IMAGE)
    browser.find_element(By.ID, "r-command").send_keys(
        "python3\n-m\nhttp.server\n8000\n--directory\n/tmp"
    )
    browser.find_element(By.ID, "r-ports").send_keys("8000")
    # this host's engine cannot filter the internet
    Select(browser.find_element(By.ID, "r-network")).select_by_value("internal")
    browser.find_element(By.ID, "r-jupyter").click()
    browser.find_element(By.ID, "r-submit").click()
    _wait(browser, lambda d: "/rentals/new/" not in d.current_url, what="the rental page")
    rental = Rental.objects.get()
    assert rental.jupyter and rental.ports == [8000] and len(rental.jupyter_token) >= 32
    page = browser.current_url

    # when it runs, the page lists the published port as a URL and links JupyterLab
    def link():
        browser.get(page)
        found = browser.find_elements(By.ID, "jupyter-open")
        ports = browser.find_elements(By.CSS_SELECTOR, "#ports a.port-url")
        return (found[0], ports) if found and ports else None

    opened, ports = wait(link, 300, f"the JupyterLab link (agent log: {agent.log()[-2000:]})")
    href = opened.get_attribute("href")
    assert href.startswith("http://127.0.0.1:") and href.endswith(
        f"/lab?token={rental.jupyter_token}"
    )
    assert first <= int(href.split(":")[2].split("/")[0]) <= last
    [port_url] = [a.get_attribute("href") for a in ports]
    assert requests.get(port_url, timeout=10).status_code == 200  # the run's own server
    # and the notebook's address without the token is refused
    bare = requests.get(href.split("?")[0].replace("/lab", "/api/contents"), timeout=10)
    assert bare.status_code == 403

    # then the link opens JupyterLab, logged in by the token
    opened.click()
    wait(lambda: len(browser.window_handles) == 2, 30, "the JupyterLab tab")
    browser.switch_to.window(browser.window_handles[1])
    _wait(browser, _lab_loaded, timeout=120, what="JupyterLab to load")
    assert "JupyterLab" in browser.title

    # when the rental is stopped, the link goes
    browser.switch_to.window(browser.window_handles[0])
    client = APIClient()
    client.force_authenticate(user)
    assert client.post(f"/api/v1/rentals/{rental.pk}/stop/").status_code == 200
    wait(lambda: Rental.objects.get(pk=rental.pk).status not in lifecycle.ACTIVE, 180, "the end")
    browser.get(page)
    assert not browser.find_elements(By.ID, "jupyter-open")


def test_gpumarket_jupyter_opens_a_tunnel_with_ssh(
    user, live_server, celery_worker, publishing_agent, tmp_path
):
    assert shutil.which("ssh"), "the OpenSSH client is missing: run the README's test command"
    agent, _ = publishing_agent
    team = personal_team(user)
    ssh_key_add(team=team, owner=user, public_key=_keypair(tmp_path / "mine"))
    _, token = api_token_create(user=user, team=team, name="cli")
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("GPUMARKET_")},
        "PYTHONPATH": str(ROOT),
    }
    cli = [sys.executable, "-m", "gpumarket_cli", "--server", live_server.url, "--token", token]

    # given a rental with JupyterLab and SSH and no command (the notebook is the work)
    rented = subprocess.run(
        [*cli, "rent", "--gpus", "1", "--image", HARNESS_IMAGE, "--jupyter", "--ssh",
         "--network", "internal"],
        capture_output=True, text=True, timeout=60, env=env, cwd=ROOT, check=False,
    )  # fmt: skip
    assert rented.returncode == 0, rented.stderr
    rental_id = rented.stdout.split()[0]
    rental = Rental.objects.get(pk=rental_id)
    assert rental.command == ["sleep", "infinity"]
    client = APIClient()
    client.force_authenticate(user)

    def published() -> bool:
        ports = {a["container_port"] for a in client.get(f"/api/v1/rentals/{rental_id}/").json()
                 ["access"]}  # fmt: skip
        return {22, 8888} <= ports

    wait(published, 300, f"sshd and JupyterLab to listen (agent log: {agent.log()[-2000:]})")

    # when `gpumarket jupyter ID` runs
    tunnel = subprocess.Popen(
        [*cli, "jupyter", rental_id, "-i", str(tmp_path / "mine"),
         "-o", "BatchMode=yes", "-o", "IdentitiesOnly=yes", "-o", "StrictHostKeyChecking=no",
         "-o", "UserKnownHostsFile=/dev/null"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
    )  # fmt: skip
    try:
        url = tunnel.stdout.readline().strip()
        # then it prints the local URL with the rental's token
        assert url.startswith("http://127.0.0.1:"), (url, tunnel.stderr)
        assert url.endswith(f"/lab?token={rental.jupyter_token}")

        # and the notebook server answers through the tunnel, with the token only
        def lab() -> requests.Response | None:
            try:
                answer = requests.get(url, timeout=10)
            except requests.ConnectionError:
                return None
            return answer if answer.status_code == 200 else None

        page = wait(lab, 60, "JupyterLab through the tunnel")
        assert "JupyterLab" in page.text
        status = requests.get(url.replace("/lab?", "/api/status?"), timeout=10)
        assert status.status_code == 200 and "started" in status.json()
        contents = url.split("/lab")[0] + "/api/contents"
        assert requests.get(contents, timeout=10).status_code == 403
    finally:
        tunnel.send_signal(signal.SIGINT)
        tunnel.wait(30)
    # when the command is interrupted, the tunnel is closed
    local = url.split("/lab")[0]
    with pytest.raises(requests.ConnectionError):
        requests.get(local, timeout=5)
