"""Datasets through the REST API against a real SeaweedFS: single and multipart uploads through
presigned URLs, the server's checks, the quota (also under concurrency), URL sources, and every
bad input a clear 4xx that stores nothing."""

from __future__ import annotations

import hashlib
import http.server
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from django.db import close_old_connections
from rest_framework.test import APIClient

from accounts.services import api_token_create
from storage import services as storage_services
from storage.models import Dataset, DatasetFile, DatasetStatus, RentalDataset
from tests.factories import UserFactory, personal_team

pytestmark = pytest.mark.django_db

MIB = 1 << 20


def _spec(path: str, data: bytes) -> dict:
    return {"path": path, "size_bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def _put_all(uploads: list[dict], contents: dict[str, bytes]) -> dict[str, list[str]]:
    """PUT every file where the server said; returns the part ETags of multipart files."""
    parts: dict[str, list[str]] = {}
    for upload in uploads:
        data = contents[upload["path"]]
        if upload["url"]:
            assert requests.put(upload["url"], data=data, timeout=30).status_code == 200
            continue
        size = upload["part_size_bytes"]
        etags = []
        for n, url in enumerate(upload["part_urls"]):
            r = requests.put(url, data=data[n * size : (n + 1) * size], timeout=30)
            assert r.status_code == 200
            etags.append(r.headers["ETag"])
        parts[upload["path"]] = etags
    return parts


@pytest.fixture
def small_parts(settings):
    """Multipart from 5 MiB on, in parts of 5 MiB (S3's smallest), so tests stay small."""
    settings.STORAGE = {
        **settings.STORAGE,
        "MULTIPART_THRESHOLD_BYTES": 5 * MIB,
        "MULTIPART_PART_BYTES": 5 * MIB,
    }


@pytest.fixture
def stranger_api(db) -> APIClient:
    stranger = UserFactory()
    _, raw = api_token_create(user=stranger, team=personal_team(stranger), name="stranger")
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {raw}")
    return client


def _upload(auth_api, name: str, contents: dict[str, bytes]) -> dict:
    r = auth_api.post(
        "/api/v1/datasets/",
        {"name": name, "files": [_spec(p, d) for p, d in contents.items()]},
        format="json",
    )
    assert r.status_code == 201, r.content
    answer = r.json()
    parts = _put_all(answer["uploads"], contents)
    done = auth_api.post(
        f"/api/v1/datasets/{answer['dataset']['id']}/complete/", {"parts": parts}, format="json"
    )
    assert done.status_code == 200, done.content
    return done.json()


def test_a_small_and_a_multipart_file_upload_and_the_dataset_is_ready(
    auth_api, object_store, small_parts, bucket_keys
):
    # given one small file and one that goes up in two parts
    contents = {"train/a.csv": b"x,y\n1,2\n", "big.bin": b"\x07" * (5 * MIB + 100)}
    r = auth_api.post(
        "/api/v1/datasets/",
        {"name": "digits", "files": [_spec(p, d) for p, d in contents.items()]},
        format="json",
    )
    assert r.status_code == 201, r.content
    answer = r.json()
    by_path = {u["path"]: u for u in answer["uploads"]}
    assert by_path["train/a.csv"]["url"] and not by_path["train/a.csv"]["upload_id"]
    assert by_path["big.bin"]["upload_id"] and len(by_path["big.bin"]["part_urls"]) == 2
    assert answer["dataset"]["status"] == "uploading"
    assert answer["dataset"]["total_bytes"] == sum(len(d) for d in contents.values())
    # when the client PUTs the bytes and completes
    parts = _put_all(answer["uploads"], contents)
    dataset_id = answer["dataset"]["id"]
    done = auth_api.post(f"/api/v1/datasets/{dataset_id}/complete/", {"parts": parts})
    # then the dataset is ready, each file stored under the dataset's prefix
    assert done.status_code == 200, done.content
    assert done.json()["status"] == "ready"
    files = DatasetFile.objects.filter(dataset_id=dataset_id)
    assert all(f.stored_at is not None and not f.upload_id for f in files)
    assert bucket_keys(f"datasets/{dataset_id}/") == sorted(f.key for f in files)
    listed = auth_api.get("/api/v1/datasets/").json()["results"]
    assert [(d["name"], d["status"]) for d in listed] == [("digits", "ready")]


def test_complete_names_a_file_whose_bytes_are_not_the_declared_ones(auth_api, object_store):
    good = b"the declared bytes"
    r = auth_api.post("/api/v1/datasets/", {"name": "d1", "files": [_spec("f.txt", good)]})
    upload = r.json()["uploads"][0]
    requests.put(upload["url"], data=b"other bytes, same size!"[: len(good)], timeout=10)
    dataset_id = r.json()["dataset"]["id"]
    bad = auth_api.post(f"/api/v1/datasets/{dataset_id}/complete/", {})
    assert bad.status_code == 400
    assert "f.txt" in bad.json()["files"][0] and "sha256" in bad.json()["files"][0]
    assert Dataset.objects.get(pk=dataset_id).status == DatasetStatus.UPLOADING
    # the client uploads it again, with fresh URLs, and it checks out
    again = auth_api.post(f"/api/v1/datasets/{dataset_id}/uploads/", {"paths": ["f.txt"]})
    requests.put(again.json()["uploads"][0]["url"], data=good, timeout=10)
    assert auth_api.post(f"/api/v1/datasets/{dataset_id}/complete/", {}).json()["status"] == (
        "ready"
    )


def test_a_file_never_uploaded_keeps_the_dataset_uploading(auth_api, object_store):
    r = auth_api.post("/api/v1/datasets/", {"name": "d2", "files": [_spec("f", b"abc")]})
    bad = auth_api.post(f"/api/v1/datasets/{r.json()['dataset']['id']}/complete/", {})
    assert bad.status_code == 400 and "no object was uploaded" in bad.json()["detail"]


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"name": "..", "files": [_spec("a", b"a")]}, "name"),
        ({"name": "a..b", "files": [_spec("a", b"a")]}, "name"),
        ({"name": "has\x00nul", "files": [_spec("a", b"a")]}, "name"),
        ({"name": "ok", "files": [_spec("../etc/passwd", b"a")]}, "files[0].path"),
        ({"name": "ok", "files": [_spec("/abs", b"a")]}, "files[0].path"),
        ({"name": "ok", "files": [_spec("a/./b", b"a")]}, "files[0].path"),
        ({"name": "ok", "files": [_spec("nul\x00.txt", b"a")]}, "files"),
        ({"name": "ok", "files": [_spec("a", b"a"), _spec("a", b"b")]}, "files[1].path"),
        ({"name": "ok", "files": []}, "files"),
        ({"name": "ok", "files": [{**_spec("a", b"a"), "sha256": "XYZ"}]}, "files"),
        ({"name": "ok"}, "files"),
    ],
)
def test_bad_names_and_paths_are_refused_naming_the_field_and_nothing_is_stored(
    auth_api, object_store, bucket_keys, body, field
):
    before = bucket_keys("datasets/")
    r = auth_api.post("/api/v1/datasets/", body, format="json")
    assert r.status_code == 400, r.content
    assert field in r.json(), r.json()
    assert not Dataset.objects.exists() and not DatasetFile.objects.exists()
    assert bucket_keys("datasets/") == before


def test_an_upload_over_the_quota_is_refused_and_nothing_is_stored(
    auth_api, user, object_store, settings
):
    settings.STORAGE = {**settings.STORAGE, "DATASET_QUOTA_BYTES": 1000}
    assert auth_api.post("/api/v1/datasets/", {"name": "a", "files": [_spec("f", b"x" * 600)]})
    r = auth_api.post("/api/v1/datasets/", {"name": "b", "files": [_spec("f", b"x" * 401)]})
    assert r.status_code == 413
    assert r.json()["code"] == "quota_exceeded" and "files" in r.json()
    assert list(Dataset.objects.values_list("name", flat=True)) == ["a"]
    # exactly up to the quota still fits
    ok = auth_api.post("/api/v1/datasets/", {"name": "c", "files": [_spec("f", b"x" * 400)]})
    assert ok.status_code == 201


def test_a_taken_name_is_a_conflict(auth_api, object_store):
    assert auth_api.post("/api/v1/datasets/", {"name": "a", "files": [_spec("f", b"1")]})
    r = auth_api.post("/api/v1/datasets/", {"name": "a", "files": [_spec("g", b"2")]})
    assert r.status_code == 409 and "name" in r.json()
    assert Dataset.objects.count() == 1


def test_another_accounts_dataset_is_404_everywhere_and_untouched(
    auth_api, stranger_api, object_store
):
    dataset = _upload(auth_api, "mine", {"f": b"secret"})
    base = f"/api/v1/datasets/{dataset['id']}/"
    assert stranger_api.get(base).status_code == 404
    assert stranger_api.delete(base).status_code == 404
    assert stranger_api.post(base + "complete/", {}).status_code == 404
    assert stranger_api.post(base + "uploads/", {}).status_code == 404
    assert stranger_api.get("/api/v1/datasets/").json()["results"] == []
    assert Dataset.objects.get(pk=dataset["id"]).status == DatasetStatus.READY


def test_delete_removes_rows_and_objects_and_frees_the_quota(
    auth_api, object_store, bucket_keys, settings
):
    settings.STORAGE = {**settings.STORAGE, "DATASET_QUOTA_BYTES": 10}
    dataset = _upload(auth_api, "gone", {"f": b"123456"})
    assert bucket_keys(f"datasets/{dataset['id']}/")
    assert auth_api.delete(f"/api/v1/datasets/{dataset['id']}/").status_code == 204
    assert not Dataset.objects.exists() and not DatasetFile.objects.exists()
    assert bucket_keys(f"datasets/{dataset['id']}/") == []
    assert auth_api.post("/api/v1/datasets/", {"name": "x", "files": [_spec("f", b"1234567")]})


def test_a_dataset_an_active_rental_reads_cannot_be_deleted(
    auth_api, object_store, make_node, rent, user
):
    make_node(gpus=2)
    dataset = _upload(auth_api, "used", {"f": b"abc"})
    rental = rent(1, datasets=("used",))
    links = [(r, str(d)) for r, d in RentalDataset.objects.values_list("rental_id", "dataset_id")]
    assert links == [(rental.pk, dataset["id"])]
    r = auth_api.delete(f"/api/v1/datasets/{dataset['id']}/")
    assert r.status_code == 409
    assert Dataset.objects.filter(pk=dataset["id"]).exists()


# -- URL sources -----------------------------------------------------------------------------------


@pytest.fixture
def web_server():
    """A local HTTP server: /data.bin answers 4 KiB, anything else 404."""
    body = bytes(range(256)) * 16

    class Handler(http.server.BaseHTTPRequestHandler):
        def _answer(self, with_body: bool) -> None:
            if self.path != "/data.bin":
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if with_body:
                self.wfile.write(body)

        def do_HEAD(self):
            self._answer(False)

        def do_GET(self):
            self._answer(True)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    server.body = body
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture
def private_sources(settings):
    settings.STORAGE = {**settings.STORAGE, "FETCH_ALLOW_PRIVATE": True}


def test_a_source_url_that_answers_404_is_refused_and_nothing_is_stored(
    auth_api, object_store, web_server, private_sources, bucket_keys
):
    before = bucket_keys("datasets/")
    url = f"http://127.0.0.1:{web_server.server_port}/missing.bin"
    r = auth_api.post("/api/v1/datasets/", {"name": "web", "source_url": url})
    assert r.status_code == 400
    assert r.json()["source_url"] == ["the URL answered 404"]
    assert not Dataset.objects.exists() and bucket_keys("datasets/") == before


def test_a_source_url_on_a_private_address_is_refused_unless_allowed(
    auth_api, object_store, web_server
):
    url = f"http://127.0.0.1:{web_server.server_port}/data.bin"
    r = auth_api.post("/api/v1/datasets/", {"name": "web", "source_url": url})
    assert r.status_code == 400 and "private" in r.json()["source_url"][0]
    assert not Dataset.objects.exists()


def test_a_source_url_is_fetched_into_the_bucket_and_hashed(
    auth_api, object_store, web_server, private_sources
):
    url = f"http://127.0.0.1:{web_server.server_port}/data.bin"
    r = auth_api.post("/api/v1/datasets/", {"name": "web", "source_url": url})
    assert r.status_code == 202, r.content
    assert r.json()["status"] == "uploading" and r.json()["total_bytes"] == len(web_server.body)
    # the worker's task, run here
    dataset = storage_services.dataset_fetch(dataset_id=r.json()["id"])
    assert dataset.status == DatasetStatus.READY
    f = dataset.files.get()
    assert (f.path, f.size_bytes) == ("data.bin", len(web_server.body))
    assert f.sha256 == hashlib.sha256(web_server.body).hexdigest()
    stored = object_store.get_object(Bucket=object_store.bucket, Key=f.key)["Body"].read()
    assert stored == web_server.body


# -- quota under concurrency -----------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_concurrent_uploads_never_pass_the_quota_together(object_store, settings):
    # given a quota that holds 3 uploads of 100 bytes and 8 concurrent creates
    settings.STORAGE = {**settings.STORAGE, "DATASET_QUOTA_BYTES": 300}
    owner = UserFactory()
    team = personal_team(owner)
    barrier = threading.Barrier(8)

    def create(i: int) -> str:
        close_old_connections()
        try:
            barrier.wait(timeout=30)
            storage_services.dataset_upload_create(
                team=team,
                owner=owner,
                name=f"d{i}",
                files=[storage_services.FileSpec(path="f", size_bytes=100, sha256="0" * 64)],
            )
            return "ok"
        except storage_services.QuotaExceeded:
            return "quota"
        finally:
            close_old_connections()

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(create, range(8)))
    # then exactly three got in, and the stored total is the quota
    assert sorted(results) == ["ok"] * 3 + ["quota"] * 5
    assert sum(Dataset.objects.filter(team=team).values_list("total_bytes", flat=True)) == 300


def test_an_upload_left_unfinished_for_a_day_is_abandoned_and_its_quota_freed(
    auth_api, user, object_store, small_parts, bucket_keys
):
    from datetime import timedelta

    from django.utils import timezone

    # given a multipart upload with one part sent, and a fresh upload
    big = b"\x05" * (6 * MIB)
    r = auth_api.post("/api/v1/datasets/", {"name": "stale", "files": [_spec("big", big)]})
    upload = r.json()["uploads"][0]
    requests.put(upload["part_urls"][0], data=big[: 5 * MIB], timeout=30)
    stale_id = r.json()["dataset"]["id"]
    Dataset.objects.filter(pk=stale_id).update(created_at=timezone.now() - timedelta(hours=25))
    auth_api.post("/api/v1/datasets/", {"name": "fresh", "files": [_spec("f", b"1")]})
    # when the periodic task runs
    assert storage_services.dataset_uploads_abandon() == 1
    # then the stale one failed, counts nothing, and its upload is gone; the fresh one is left
    stale = Dataset.objects.get(pk=stale_id)
    assert (stale.status, stale.total_bytes) == (DatasetStatus.FAILED, 0)
    assert "not finished" in stale.status_reason
    uploads = object_store.list_multipart_uploads(
        Bucket=object_store.bucket, Prefix=f"datasets/{stale_id}/"
    )
    assert uploads.get("Uploads", []) == []
    assert Dataset.objects.get(name="fresh").status == DatasetStatus.UPLOADING
    assert storage_services.dataset_uploads_abandon() == 0
