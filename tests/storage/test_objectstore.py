"""The object storage adapter against a real SeaweedFS: presigned URLs work for what they were
signed for and nothing else, and readiness checks the real bucket."""

from __future__ import annotations

import hashlib

import pytest
import requests

from storage import objectstore


def test_presigned_put_then_get_round_trips_the_bytes(object_store):
    # given a presigned PUT of one key
    url = objectstore.presign_put("roundtrip/a.bin")
    body = b"\x00\x01 bytes" * 1000
    # when a client without credentials PUTs, then GETs through a presigned GET
    assert requests.put(url, data=body, timeout=10).status_code == 200
    got = requests.get(objectstore.presign_get("roundtrip/a.bin"), timeout=10)
    # then it reads what it wrote, and HEAD sees the size
    assert got.status_code == 200 and got.content == body
    assert objectstore.head("roundtrip/a.bin").size_bytes == len(body)
    assert objectstore.sha256_of("roundtrip/a.bin") == hashlib.sha256(body).hexdigest()


def test_a_presigned_url_is_for_its_key_only_and_a_forged_signature_is_refused(object_store):
    url = objectstore.presign_put("scoped/mine.bin")
    other = url.replace("scoped/mine.bin", "scoped/other.bin")
    assert requests.put(other, data=b"x", timeout=10).status_code == 403
    forged = url.replace("X-Amz-Signature=", "X-Amz-Signature=0")
    assert requests.put(forged, data=b"x", timeout=10).status_code == 403
    bare = url.split("?", 1)[0]
    assert requests.put(bare, data=b"x", timeout=10).status_code == 403
    assert objectstore.head("scoped/other.bin") is None
    assert objectstore.head("scoped/mine.bin") is None


def test_multipart_upload_through_presigned_part_urls(object_store):
    key = "multi/big.bin"
    size = objectstore.MIN_PART_BYTES + 1234
    data = bytes(range(256)) * (size // 256) + b"z" * (size % 256)
    part = objectstore.MIN_PART_BYTES
    upload_id = objectstore.multipart_create(key)
    urls = objectstore.presign_parts(key, upload_id, objectstore.part_count(size, part))
    assert len(urls) == 2
    etags = []
    for n, url in enumerate(urls):
        r = requests.put(url, data=data[n * part : (n + 1) * part], timeout=30)
        assert r.status_code == 200
        etags.append(r.headers["ETag"])
    # parts in the wrong order do not make the object
    assert not objectstore.multipart_complete(key, upload_id, list(reversed(etags)))
    assert objectstore.multipart_complete(key, upload_id, etags)
    assert objectstore.head(key).size_bytes == size
    assert requests.get(objectstore.presign_get(key), timeout=30).content == data


def test_delete_prefix_removes_only_that_prefix(object_store, bucket_keys):
    for key in ("del/a/1", "del/a/2", "del/b/1"):
        requests.put(objectstore.presign_put(key), data=b"x", timeout=10)
    assert objectstore.delete_prefix("del/a/") == 2
    assert bucket_keys("del/") == ["del/b/1"]


def test_part_size_grows_so_no_file_needs_more_than_10000_parts(settings):
    settings.STORAGE = {**settings.STORAGE, "MULTIPART_PART_BYTES": 8 << 20}
    assert objectstore.part_size(1 << 30) == 8 << 20
    big = 200 * 1024**3
    assert objectstore.part_count(big, objectstore.part_size(big)) <= objectstore.MAX_PARTS


def test_without_a_bucket_storage_is_unavailable_not_a_crash(settings):
    settings.S3_BUCKET = ""
    with pytest.raises(objectstore.StorageUnavailable):
        objectstore.presign_get("x")


@pytest.mark.django_db
def test_readyz_checks_the_real_bucket(client, object_store, settings):
    assert client.get("/readyz").json()["checks"]["object_storage"]["status"] == "ok"
    settings.S3_BUCKET = "no-such-bucket-here"
    response = client.get("/readyz")
    assert response.status_code == 503
    assert response.json()["checks"]["object_storage"]["status"] == "fail"
    settings.S3_BUCKET = object_store.bucket
    settings.S3_SECRET_ACCESS_KEY = "wrong"
    assert client.get("/readyz").json()["checks"]["object_storage"]["status"] == "fail"


def test_the_bucket_command_creates_a_missing_bucket_once(object_store, settings):
    from io import StringIO

    from django.core.management import call_command

    settings.S3_BUCKET = f"{object_store.bucket}-extra"
    out = StringIO()
    call_command("storage_bucket", stdout=out)
    call_command("storage_bucket", stdout=out)
    assert out.getvalue().split() == ["created", "exists"]
    object_store.delete_bucket(Bucket=settings.S3_BUCKET)


def test_a_get_url_is_reused_while_most_of_its_life_is_left(object_store, settings):
    requests.put(objectstore.presign_put("reuse/x"), data=b"x", timeout=10)
    first = objectstore.presign_get("reuse/x")
    assert objectstore.presign_get("reuse/x") == first
    assert requests.get(first, timeout=10).content == b"x"
    # another expiry (or store, or key) signs anew
    settings.STORAGE = {**settings.STORAGE, "PRESIGN_EXPIRY_S": 60}
    assert objectstore.presign_get("reuse/x") != first
