"""A provider declares a cluster and puts a node in it on the provider page, in a real headless
Chromium against the live server (the page's actions call the provider API)."""

from __future__ import annotations

import pytest
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import Select

from marketplace.models import Cluster, Node
from tests.e2e.test_web_ui import _log_in, _text, _wait

pytestmark = [pytest.mark.e2e, pytest.mark.browser, pytest.mark.django_db(transaction=True)]


def _cluster_of(node) -> int | None:
    return Node.objects.values_list("cluster_id", flat=True).get(pk=node.pk)


def test_a_provider_declares_a_cluster_and_puts_a_node_in_it_in_the_browser(
    browser, live_server, provider, make_node
):
    node = make_node(hostname="host-a", cluster=None)
    _log_in(browser, live_server.url, provider.owner, "/provider/")

    def declare(name: str, gbps: str) -> None:
        form = browser.find_element(By.CSS_SELECTOR, "form.cluster-form")
        form.find_element(By.CSS_SELECTOR, ".c-name").clear()
        form.find_element(By.CSS_SELECTOR, ".c-name").send_keys(name)
        Select(form.find_element(By.CSS_SELECTOR, ".c-interconnect")).select_by_value("infiniband")
        form.find_element(By.CSS_SELECTOR, ".c-gbps").clear()
        form.find_element(By.CSS_SELECTOR, ".c-gbps").send_keys(gbps)
        # The server's checks, not the browser's: submit the form as a script would.
        browser.execute_script(
            "arguments[0].dispatchEvent(new Event('submit', {cancelable: true}))", form
        )

    # A bad name is named on the page and stores nothing
    declare("Not A Slug", "400")
    _wait(browser, lambda d: "name" in _text(d, "errors"), what="the refusal")
    assert not Cluster.objects.exists()

    # A good one is listed with its interconnect
    declare("h100-ib", "400")
    row = _wait(
        browser,
        lambda d: d.find_element(By.CSS_SELECTOR, "table.clusters tr[data-cluster]"),
        what="the new cluster",
    )
    assert "h100-ib" in row.text and "InfiniBand 400 Gb/s" in row.text
    cluster = Cluster.objects.get()

    # Choosing it in the node's select puts the node in it
    select = browser.find_element(By.CSS_SELECTOR, f"tr[data-node='{node.pk}'] .node-cluster")
    Select(select).select_by_value(str(cluster.pk))
    _wait(browser, lambda d: _cluster_of(node) == cluster.pk, what="the node in the cluster")
    _wait(
        browser,
        lambda d: (
            "host-a" in d.find_element(By.CSS_SELECTOR, f"tr[data-cluster='{cluster.pk}']").text
        ),
        what="the cluster listing its node",
    )

    # Removing the cluster leaves the node listed on its own
    browser.find_element(
        By.CSS_SELECTOR, f"tr[data-cluster='{cluster.pk}'] .cluster-delete"
    ).click()
    _wait(browser, lambda d: not Cluster.objects.exists(), what="the cluster removed")
    assert _cluster_of(node) is None
