"""The datasets page in a real headless Chromium: files go from the browser straight to
SeaweedFS through presigned URLs (a big one in parts), with a progress bar; the rental page
lists its synced output with download links."""

from __future__ import annotations

import hashlib

import pytest
import requests
from selenium.webdriver.common.by import By

from storage import objectstore
from storage import services as storage
from storage.models import Dataset, DatasetStatus
from tests.e2e.test_web_ui import _log_in, _wait

pytestmark = [pytest.mark.e2e, pytest.mark.browser, pytest.mark.django_db(transaction=True)]

MIB = 1 << 20


def test_a_customer_uploads_a_dataset_in_the_browser_with_a_progress_bar(
    browser, live_server, user, object_store, settings, tmp_path
):
    settings.STORAGE = {
        **settings.STORAGE,
        "MULTIPART_THRESHOLD_BYTES": 5 * MIB,
        "MULTIPART_PART_BYTES": 5 * MIB,
    }
    small, big = tmp_path / "labels.csv", tmp_path / "images.bin"
    small.write_bytes(b"id,label\n1,cat\n")
    big.write_bytes(b"\x42" * (6 * MIB))
    _log_in(browser, live_server.url, user, "/datasets/")
    browser.find_element(By.ID, "d-name").send_keys("pets")
    browser.find_element(By.ID, "d-files").send_keys(f"{small}\n{big}")
    browser.find_element(By.ID, "d-submit").click()
    # the page reloads once the upload completed and lists the dataset as ready
    _wait(
        browser,
        lambda d: "ready" in d.find_element(By.ID, "datasets").text,
        timeout=60,
        what="the dataset listed as ready",
    )
    dataset = Dataset.objects.get(name="pets")
    assert dataset.status == DatasetStatus.READY
    assert {f.path: (f.size_bytes, f.sha256) for f in dataset.files.all()} == {
        p.name: (p.stat().st_size, hashlib.sha256(p.read_bytes()).hexdigest()) for p in (small, big)
    }


def test_a_bad_name_is_named_in_the_page_and_nothing_is_stored(
    browser, live_server, user, object_store, tmp_path
):
    f = tmp_path / "one.txt"
    f.write_bytes(b"1")
    _log_in(browser, live_server.url, user, "/datasets/")
    browser.find_element(By.ID, "d-name").send_keys("..")
    browser.find_element(By.ID, "d-files").send_keys(str(f))
    browser.find_element(By.ID, "d-submit").click()
    _wait(browser, lambda d: "name" in d.find_element(By.ID, "errors").text, what="the error")
    assert not Dataset.objects.exists()


def test_the_rental_page_links_each_synced_file(
    browser, live_server, user, rent, make_node, object_store
):
    make_node(gpus=2)
    rental = rent(1)
    data = b"final weights"
    requests.put(
        objectstore.presign_put(f"rentals/{rental.pk}/output/model.pt"), data=data, timeout=10
    )
    storage.artifacts_commit(
        rental=rental,
        run_id="r1",
        reason="complete",
        files=[
            storage.UploadedFile(
                path="model.pt", size_bytes=len(data), sha256=hashlib.sha256(data).hexdigest()
            )
        ],
    )
    _log_in(browser, live_server.url, user, f"/rentals/{rental.pk}/")
    link = browser.find_element(By.CSS_SELECTOR, "#artifacts a")
    assert link.text == "model.pt"
    # the link is the API's download, which redirects to a presigned GET
    session = requests.Session()
    for cookie in browser.get_cookies():
        session.cookies.set(cookie["name"], cookie["value"])
    assert session.get(link.get_attribute("href"), timeout=10).content == data
