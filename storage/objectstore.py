"""The object storage adapter: the one place the server talks S3 (boto3).

Agents, containers and browsers never hold storage credentials: they get presigned URLs for one
key (or one part of one multipart upload), with a short expiry (STORAGE["PRESIGN_EXPIRY_S"]).
Keys are built here from the owner's ids only (`datasets/<id>/files/<n>`, `rentals/<id>/...`),
never from a path a client sent, so a presigned URL reaches nothing outside its prefix.

Every call has connect and read timeouts and botocore's standard retry mode; a call that still
fails raises StorageUnavailable (503), so a storage outage is visible and never a 500.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError
from django.conf import settings

from core.errors import DomainError
from core.metrics import STORAGE_ERRORS

# S3 forbids more parts than this; the part size grows for bigger files so it is never exceeded.
MAX_PARTS = 10_000
MIN_PART_BYTES = 5 << 20


class StorageUnavailable(DomainError):
    """Object storage is not configured or did not answer (after retries)."""

    status = 503
    code = "storage_unavailable"


@dataclass(frozen=True, slots=True)
class StoredObject:
    key: str
    size_bytes: int
    etag: str


def configured() -> bool:
    return bool(settings.S3_BUCKET)


@functools.cache
def _client(
    endpoint: str,
    key_id: str,
    secret: str,
    region: str,
    addressing: str,
    timeouts: tuple[float, float],
    attempts: int,
) -> Any:
    return boto3.session.Session().client(
        "s3",
        endpoint_url=endpoint or None,
        aws_access_key_id=key_id or None,
        aws_secret_access_key=secret or None,
        region_name=region,
        config=Config(
            connect_timeout=timeouts[0],
            read_timeout=timeouts[1],
            retries={"max_attempts": attempts, "mode": "standard"},
            signature_version="s3v4",
            s3={"addressing_style": addressing},
        ),
    )


def client(
    *, public: bool = False, timeouts: tuple[float, float] | None = None, attempts: int = 0
) -> Any:
    """A client for S3_ENDPOINT_URL (`public`: for S3_PUBLIC_ENDPOINT_URL, the address agents
    and browsers reach, which presigned URLs are signed for); cached per settings, so a test's
    override takes effect."""
    if not configured():
        raise StorageUnavailable("object storage is not configured (S3_BUCKET)")
    endpoint = settings.S3_ENDPOINT_URL
    if public and settings.S3_PUBLIC_ENDPOINT_URL:
        endpoint = settings.S3_PUBLIC_ENDPOINT_URL
    return _client(
        endpoint,
        settings.S3_ACCESS_KEY_ID,
        settings.S3_SECRET_ACCESS_KEY,
        settings.S3_REGION,
        settings.S3_ADDRESSING_STYLE,
        timeouts or (settings.S3_CONNECT_TIMEOUT_S, settings.S3_READ_TIMEOUT_S),
        attempts or settings.S3_MAX_ATTEMPTS,
    )


def _signer() -> Any:
    """Signing is local: no request is made."""
    return client(public=True)


def _call(operation: str, fn, /, **kwargs) -> Any:
    try:
        return fn(Bucket=settings.S3_BUCKET, **kwargs)
    except ClientError:
        raise
    except BotoCoreError as exc:
        STORAGE_ERRORS.labels(operation=operation).inc()
        raise StorageUnavailable(f"object storage did not answer: {type(exc).__name__}") from exc


def _error_code(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))


def expiry_s() -> int:
    return int(settings.STORAGE["PRESIGN_EXPIRY_S"])


def expires_at() -> float:
    """When URLs presigned now stop working (unix time)."""
    return time.time() + expiry_s()


# Signing one URL costs botocore about a millisecond or more of CPU, and the heartbeat hands out
# a URL per dataset file and checkpoint every few seconds: a GET URL is reused while at least
# two thirds of its life is left, so an agent always gets one valid for most of the expiry.
_GET_CACHE: dict[tuple, tuple[str, float]] = {}
_GET_CACHE_LOCK = threading.Lock()
_GET_CACHE_MAX = 50_000


def presign_get(key: str, *, filename: str = "") -> str:
    cache_key = (
        key,
        filename,
        settings.S3_BUCKET,
        settings.S3_PUBLIC_ENDPOINT_URL or settings.S3_ENDPOINT_URL,
        settings.S3_ACCESS_KEY_ID,
        expiry_s(),
    )
    now = time.monotonic()
    with _GET_CACHE_LOCK:
        cached = _GET_CACHE.get(cache_key)
    if cached is not None and cached[1] > now:
        return cached[0]
    params: dict[str, Any] = {"Bucket": settings.S3_BUCKET, "Key": key}
    if filename:
        params["ResponseContentDisposition"] = f'attachment; filename="{filename}"'
    url = _signer().generate_presigned_url("get_object", Params=params, ExpiresIn=expiry_s())
    with _GET_CACHE_LOCK:
        if len(_GET_CACHE) >= _GET_CACHE_MAX:
            _GET_CACHE.clear()
        _GET_CACHE[cache_key] = (url, now + expiry_s() / 3)
    return url


def presign_put(key: str) -> str:
    return _signer().generate_presigned_url(
        "put_object", Params={"Bucket": settings.S3_BUCKET, "Key": key}, ExpiresIn=expiry_s()
    )


def part_size(size_bytes: int) -> int:
    """The part size for a file of this size: the setting, grown so there are at most
    MAX_PARTS parts, never under S3's 5 MiB minimum."""
    size = max(int(settings.STORAGE["MULTIPART_PART_BYTES"]), MIN_PART_BYTES)
    while -(-size_bytes // size) > MAX_PARTS:
        size *= 2
    return size


def part_count(size_bytes: int, part_bytes: int) -> int:
    return max(1, -(-size_bytes // part_bytes))


def uses_multipart(size_bytes: int) -> bool:
    return size_bytes > int(settings.STORAGE["MULTIPART_THRESHOLD_BYTES"])


def multipart_create(key: str) -> str:
    """Start a multipart upload of `key`; returns its upload id."""
    try:
        answer = _call("multipart_create", client().create_multipart_upload, Key=key)
    except ClientError as exc:
        STORAGE_ERRORS.labels(operation="multipart_create").inc()
        raise StorageUnavailable(f"object storage refused the upload: {_error_code(exc)}") from exc
    return answer["UploadId"]


def presign_parts(key: str, upload_id: str, count: int) -> list[str]:
    signer = _signer()
    return [
        signer.generate_presigned_url(
            "upload_part",
            Params={
                "Bucket": settings.S3_BUCKET,
                "Key": key,
                "UploadId": upload_id,
                "PartNumber": number,
            },
            ExpiresIn=expiry_s(),
        )
        for number in range(1, count + 1)
    ]


def multipart_complete(key: str, upload_id: str, etags: Sequence[str]) -> bool:
    """Join the uploaded parts; False when the store refuses (unknown upload, a missing or
    wrong part): the client's claim did not check out."""
    parts = [{"ETag": etag, "PartNumber": n} for n, etag in enumerate(etags, start=1)]
    try:
        _call(
            "multipart_complete",
            client().complete_multipart_upload,
            Key=key,
            UploadId=upload_id,
            MultipartUpload={"Parts": parts},
        )
    except ClientError:
        return False
    return True


def multipart_abort(key: str, upload_id: str) -> None:
    # Already completed or aborted is fine.
    with contextlib.suppress(ClientError):
        _call("multipart_abort", client().abort_multipart_upload, Key=key, UploadId=upload_id)


def head(key: str) -> StoredObject | None:
    """The object's size and ETag, or None when there is no such object."""
    try:
        answer = _call("head", client().head_object, Key=key)
    except ClientError as exc:
        if _error_code(exc) in ("404", "NoSuchKey", "NotFound"):
            return None
        STORAGE_ERRORS.labels(operation="head").inc()
        raise StorageUnavailable(f"object storage refused a HEAD: {_error_code(exc)}") from exc
    return StoredObject(key=key, size_bytes=int(answer["ContentLength"]), etag=answer["ETag"])


def put_stream(key: str, body, *, size_bytes: int) -> None:
    """Upload a readable stream (a dataset fetched from a URL) with boto3's managed transfer."""
    from boto3.s3.transfer import TransferConfig

    try:
        client().upload_fileobj(
            body,
            settings.S3_BUCKET,
            key,
            Config=TransferConfig(
                multipart_threshold=int(settings.STORAGE["MULTIPART_THRESHOLD_BYTES"]),
                multipart_chunksize=part_size(size_bytes),
                max_concurrency=4,
            ),
        )
    except (BotoCoreError, ClientError) as exc:
        STORAGE_ERRORS.labels(operation="put").inc()
        raise StorageUnavailable(f"object storage refused an upload: {exc}"[:300]) from exc


def delete_keys(keys: Iterable[str]) -> int:
    """Delete these objects (missing ones are not an error); returns how many were asked."""
    batch: list[str] = []
    done = 0
    for key in keys:
        batch.append(key)
        if len(batch) == 1000:
            done += _delete_batch(batch)
            batch = []
    if batch:
        done += _delete_batch(batch)
    return done


def _delete_batch(keys: list[str]) -> int:
    try:
        _call(
            "delete",
            client().delete_objects,
            Delete={"Objects": [{"Key": k} for k in keys], "Quiet": True},
        )
    except ClientError as exc:
        STORAGE_ERRORS.labels(operation="delete").inc()
        raise StorageUnavailable(f"object storage refused a delete: {_error_code(exc)}") from exc
    return len(keys)


def delete_prefix(prefix: str) -> int:
    """Delete every object under `prefix` (which must end with "/"); returns how many."""
    if not prefix.endswith("/"):
        raise ValueError("a prefix ends with /")
    paginator = client().get_paginator("list_objects_v2")
    keys: list[str] = []
    try:
        for page in paginator.paginate(Bucket=settings.S3_BUCKET, Prefix=prefix):
            keys.extend(item["Key"] for item in page.get("Contents", []))
    except (BotoCoreError, ClientError) as exc:
        STORAGE_ERRORS.labels(operation="list").inc()
        raise StorageUnavailable(f"object storage refused a listing: {exc}"[:300]) from exc
    return delete_keys(keys)


def bucket_check(*, timeout_s: float) -> None:
    """Raise unless the bucket answers a signed HEAD within timeout_s, once (readiness)."""
    try:
        _call("readiness", client(timeouts=(timeout_s, timeout_s), attempts=1).head_bucket)
    except ClientError as exc:
        STORAGE_ERRORS.labels(operation="readiness").inc()
        raise StorageUnavailable(f"bucket {settings.S3_BUCKET}: {_error_code(exc)}") from exc


def sha256_of(key: str) -> str:
    """Read the object back and hash it (the server checks small uploads this way)."""
    import hashlib

    digest = hashlib.sha256()
    try:
        body = _call("get", client().get_object, Key=key)["Body"]
        for chunk in iter(lambda: body.read(1 << 20), b""):
            digest.update(chunk)
    except (BotoCoreError, ClientError) as exc:
        STORAGE_ERRORS.labels(operation="get").inc()
        raise StorageUnavailable(f"object storage refused a read: {exc}"[:300]) from exc
    return digest.hexdigest()


def bucket_create() -> bool:
    """Create the bucket unless it exists; returns whether it was created."""
    try:
        _call("readiness", client().head_bucket)
        return False
    except ClientError as exc:
        if _error_code(exc) not in ("404", "NoSuchBucket", "NotFound"):
            raise StorageUnavailable(f"bucket {settings.S3_BUCKET}: {_error_code(exc)}") from exc
    try:
        _call("create_bucket", client().create_bucket)
    except ClientError as exc:
        raise StorageUnavailable(f"cannot create {settings.S3_BUCKET}: {_error_code(exc)}") from exc
    return True
