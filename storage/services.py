"""Writes of what lives in object storage: datasets (uploaded or fetched from a URL) and the
artifacts rentals sync out.

Uploads go straight from the client to the bucket through presigned URLs; the server only signs,
then checks what arrived (HEAD for the size; small files are read back for the SHA-256) before
it records a file. A file is single PUT up to STORAGE["MULTIPART_THRESHOLD_BYTES"], else a
multipart upload with one presigned URL per part.

Datasets belong to a team and are free within STORAGE["DATASET_QUOTA_BYTES"] per team: the
declared size counts from the moment an upload starts, checked with the team's row locked, so
two concurrent uploads of its members cannot both pass a quota that holds one.
"""

from __future__ import annotations

import hashlib
import ipaddress
import logging
import re
import socket
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import PurePosixPath

import requests
from django.conf import settings
from django.db import transaction
from django.utils import timezone

from accounts.models import Team
from core.errors import Conflict, DomainError, ValidationFailed
from core.locks import advisory_lock
from core.untrusted_text import text_check, url_parse
from marketplace import lifecycle
from marketplace.models import Rental, User
from storage import objectstore
from storage.models import (
    Artifact,
    Dataset,
    DatasetFile,
    DatasetStatus,
    RentalDataset,
    artifact_key,
)
from storage.selectors import dataset_bytes_used, dataset_owned, datasets_owned

log = logging.getLogger(__name__)

DATASET_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,79}$")
SHA256 = re.compile(r"^[0-9a-f]{64}$")
MAX_PATH = 1024
ARTIFACT_REASONS = ("", "checkpoint", "stop", "complete", "preempt", "fail")
# An upload left unfinished this long is abandoned: its objects and its quota are freed.
UPLOAD_ABANDON_AFTER = timedelta(hours=24)
# A file up to this size is read back and hashed when its upload completes.
VERIFY_HASH_MAX_BYTES = 64 << 20


class QuotaExceeded(DomainError):
    status = 413
    code = "quota_exceeded"


@dataclass(frozen=True, slots=True, kw_only=True)
class FileSpec:
    """A file a client means to upload: where, how big, its SHA-256 (hex)."""

    path: str
    size_bytes: int
    sha256: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Upload:
    """Where to put one file: one presigned PUT (`url`) or a multipart upload (`upload_id`,
    one URL per part of `part_size_bytes`); `skip` when the store already has it."""

    path: str
    url: str = ""
    upload_id: str = ""
    part_urls: tuple[str, ...] = ()
    part_size_bytes: int = 0
    skip: bool = False
    expires_at: float = 0.0


@dataclass(frozen=True, slots=True, kw_only=True)
class UploadedFile:
    """A client says this file is uploaded; for a multipart upload, the parts' ETags in order."""

    path: str
    size_bytes: int = -1
    sha256: str = ""
    upload_id: str = ""
    etags: tuple[str, ...] = ()


@dataclass(slots=True)
class CommitResult:
    stored: int = 0
    refused: dict[str, str] = field(default_factory=dict)


# -- validation ----------------------------------------------------------------------------------


def path_check(path: object, *, field_name: str) -> str:
    """A relative POSIX path inside a directory: no absolute path, no `..` or `.` component, no
    empty component, no NUL, control, bidi or invisible character, at most MAX_PATH
    characters."""
    if not isinstance(path, str) or not path:
        raise ValidationFailed("a path is required", field=field_name)
    if len(path) > MAX_PATH:
        raise ValidationFailed(f"longer than {MAX_PATH} characters", field=field_name)
    if any(ord(c) < 32 or ord(c) == 127 for c in path):
        raise ValidationFailed(
            "control characters (NUL included) are not allowed", field=field_name
        )
    # A bidi override shows `exe.txt` as `txt.exe`; invisible characters hide a name's end.
    text_check(path, field=field_name)
    if path.startswith("/") or "\\" in path:
        raise ValidationFailed("must be relative, with / between names", field=field_name)
    parts = path.split("/")
    if any(part in ("", ".", "..") for part in parts):
        raise ValidationFailed("no empty, `.` or `..` component is allowed", field=field_name)
    return path


def dataset_name_check(name: object) -> str:
    if not isinstance(name, str) or not DATASET_NAME.match(name) or ".." in name:
        raise ValidationFailed(
            "1-80 letters, digits, `.`, `_` or `-`, starting with a letter or digit, no `..`",
            field="name",
        )
    return name


def files_check(files: Sequence[FileSpec], *, field_name: str = "files") -> list[FileSpec]:
    """Every file's path, size and hash, and no path twice."""
    limit = int(settings.STORAGE["MAX_FILES_PER_REQUEST"])
    if not files:
        raise ValidationFailed("at least one file", field=field_name)
    if len(files) > limit:
        raise ValidationFailed(f"at most {limit} files in one request", field=field_name)
    seen: set[str] = set()
    max_bytes = int(settings.STORAGE["MAX_FILE_BYTES"])
    for i, f in enumerate(files):
        where = f"{field_name}[{i}]"
        path_check(f.path, field_name=f"{where}.path")
        if f.path in seen:
            raise ValidationFailed("this path is given twice", field=f"{where}.path")
        seen.add(f.path)
        if not 0 <= f.size_bytes <= max_bytes:
            raise ValidationFailed(f"must be 0 to {max_bytes}", field=f"{where}.size_bytes")
        if not SHA256.match(f.sha256):
            raise ValidationFailed("64 lowercase hex digits", field=f"{where}.sha256")
    return list(files)


# -- presigning ----------------------------------------------------------------------------------


def _upload_for(key: str, path: str, size_bytes: int, upload_id: str = "") -> Upload:
    """Presigned URLs for one file; a big one gets a multipart upload (`upload_id` continues an
    existing one, for URLs that expired)."""
    expires = objectstore.expires_at()
    if not objectstore.uses_multipart(size_bytes):
        return Upload(path=path, url=objectstore.presign_put(key), expires_at=expires)
    part = objectstore.part_size(size_bytes)
    upload_id = upload_id or objectstore.multipart_create(key)
    urls = objectstore.presign_parts(key, upload_id, objectstore.part_count(size_bytes, part))
    return Upload(
        path=path,
        upload_id=upload_id,
        part_urls=tuple(urls),
        part_size_bytes=part,
        expires_at=expires,
    )


def _stored_checks_out(key: str, size_bytes: int, sha256: str) -> str:
    """Why the object at `key` is not the declared file ("" when it is)."""
    found = objectstore.head(key)
    if found is None:
        return "no object was uploaded"
    if found.size_bytes != size_bytes:
        return f"stored {found.size_bytes} bytes, declared {size_bytes}"
    if sha256 and size_bytes <= VERIFY_HASH_MAX_BYTES and objectstore.sha256_of(key) != sha256:
        return "the stored bytes do not have the declared sha256"
    return ""


# -- datasets ------------------------------------------------------------------------------------


def _quota_reserve(*, team: Team, total_bytes: int) -> None:
    """Inside the creating transaction: lock the team's row, so concurrent uploads of its
    members are counted one after the other, and refuse what goes over the team's quota."""
    Team.objects.select_for_update().filter(pk=team.pk).first()
    quota = int(settings.STORAGE["DATASET_QUOTA_BYTES"])
    used = dataset_bytes_used(team)
    if used + total_bytes > quota:
        raise QuotaExceeded(
            f"{total_bytes} more bytes would exceed your team's dataset quota of {quota} bytes "
            f"({used} used)",
            field="files",
        )


def _name_free(*, team: Team, name: str) -> None:
    if Dataset.objects.filter(team=team, name=name).exists():
        raise Conflict(f"your team already has a dataset named {name}", field="name")


def dataset_upload_create(
    *, team: Team, owner: User, name: str, files: Sequence[FileSpec]
) -> tuple[Dataset, list[Upload]]:
    """Start uploading a dataset of the team (`owner`: the member uploading it): its rows
    (status UPLOADING, its size counted against the team's quota) and where to put each file.
    Nothing is written when any check fails."""
    dataset_name_check(name)
    files = files_check(files)
    total = sum(f.size_bytes for f in files)
    started: list[tuple[str, str]] = []
    try:
        with transaction.atomic():
            _quota_reserve(team=team, total_bytes=total)
            _name_free(team=team, name=name)
            dataset = Dataset.objects.create(
                team=team, owner=owner, name=name, total_bytes=total, file_count=len(files)
            )
            rows = DatasetFile.objects.bulk_create(
                [
                    DatasetFile(
                        dataset=dataset, path=f.path, size_bytes=f.size_bytes, sha256=f.sha256
                    )
                    for f in files
                ]
            )
            uploads = []
            for row in rows:
                upload = _upload_for(row.key, row.path, row.size_bytes)
                if upload.upload_id:
                    started.append((row.key, upload.upload_id))
                    row.upload_id, row.part_bytes = upload.upload_id, upload.part_size_bytes
                    row.save(update_fields=["upload_id", "part_bytes"])
                uploads.append(upload)
    except BaseException:
        for key, upload_id in started:
            objectstore.multipart_abort(key, upload_id)
        raise
    return dataset, uploads


def dataset_upload_urls(
    *, team: Team, dataset_id, paths: Iterable[str] = ()
) -> tuple[Dataset, list[Upload]]:
    """Fresh URLs for the files of an upload not yet stored (all, or those named)."""
    dataset = dataset_owned(team=team, dataset_id=dataset_id)
    if dataset.status != DatasetStatus.UPLOADING or dataset.source_url:
        raise Conflict(f"the dataset is {dataset.status}, not being uploaded")
    pending = dataset.files.filter(stored_at__isnull=True)
    wanted = set(paths)
    if wanted:
        pending = pending.filter(path__in=wanted)
    return dataset, [_upload_for(f.key, f.path, f.size_bytes, f.upload_id) for f in pending]


def dataset_upload_complete(
    *, team: Team, dataset_id, parts: Mapping[str, Sequence[str]]
) -> Dataset:
    """Check each file not yet stored (join its parts first when it went up in parts, with the
    ETags `parts[path]`); the dataset is READY once all of them check out. A file that does not
    is named in the 400 answer and can be uploaded again."""
    dataset = dataset_owned(team=team, dataset_id=dataset_id)
    if dataset.status == DatasetStatus.READY:
        return dataset
    if dataset.status != DatasetStatus.UPLOADING or dataset.source_url:
        raise Conflict(f"the dataset is {dataset.status}, not being uploaded")
    problems: dict[str, str] = {}
    now = timezone.now()
    for f in dataset.files.filter(stored_at__isnull=True):
        if f.upload_id:
            etags = parts.get(f.path)
            if not etags:
                problems[f.path] = "the ETags of its parts are required"
                continue
            if not objectstore.multipart_complete(f.key, f.upload_id, etags):
                problems[f.path] = "the parts do not make up the upload"
                continue
        why = _stored_checks_out(f.key, f.size_bytes, f.sha256)
        if why:
            problems[f.path] = why
            if f.upload_id:
                # The joined object is wrong: the client starts this file's upload again.
                objectstore.delete_keys([f.key])
                f.upload_id = ""
                f.save(update_fields=["upload_id"])
            continue
        DatasetFile.objects.filter(pk=f.pk).update(stored_at=now, upload_id="")
    if problems:
        detail = "; ".join(f"{path}: {why}" for path, why in sorted(problems.items()))
        raise ValidationFailed(f"not stored as declared: {detail}"[:1000], field="files")
    with transaction.atomic():
        Dataset.objects.filter(pk=dataset.pk, status=DatasetStatus.UPLOADING).update(
            status=DatasetStatus.READY, status_reason="", ready_at=now
        )
    dataset.refresh_from_db()
    return dataset


def _source_check(url: str) -> tuple[str, int]:
    """The URL's host must not be a private, loopback or link-local address (the server would
    be fetching inside its own network) unless STORAGE["FETCH_ALLOW_PRIVATE"]; the URL must
    answer 2xx with a Content-Length. Returns (file name, size)."""
    parts = url_parse(url, field="source_url")
    if parts.has_credentials:
        raise ValidationFailed("no credentials in the URL", field="source_url")
    if not settings.STORAGE.get("FETCH_ALLOW_PRIVATE"):
        try:
            infos = socket.getaddrinfo(parts.host, parts.port, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError):
            raise ValidationFailed("the host does not resolve", field="source_url") from None
        for info in infos:
            address = ipaddress.ip_address(str(info[4][0]).split("%", 1)[0])
            if not address.is_global:
                raise ValidationFailed("the host is a private or local address", field="source_url")
    try:
        answer = _http().head(url, timeout=(5, 20), allow_redirects=False)
        if answer.status_code == 405:
            answer = _http().get(url, timeout=(5, 20), allow_redirects=False, stream=True)
            answer.close()
    except requests.RequestException as exc:
        raise ValidationFailed(
            f"the URL did not answer: {type(exc).__name__}", field="source_url"
        ) from None
    if 300 <= answer.status_code < 400:
        raise ValidationFailed(
            f"the URL answered {answer.status_code} (a redirect): give the final URL",
            field="source_url",
        )
    if answer.status_code != 200:
        raise ValidationFailed(f"the URL answered {answer.status_code}", field="source_url")
    length = answer.headers.get("Content-Length", "")
    if not length.isdigit():
        raise ValidationFailed("the URL does not say its size (Content-Length)", field="source_url")
    size = int(length)
    if size > int(settings.STORAGE["MAX_FILE_BYTES"]):
        raise ValidationFailed("the file is larger than a dataset file may be", field="source_url")
    name = PurePosixPath(parts.path).name or "data"
    name = re.sub(r"[^A-Za-z0-9._-]", "_", name).lstrip(".") or "data"
    return name[:200], size


def _http() -> requests.Session:
    """A session that retries connection errors and 502/503/504 of idempotent requests."""
    from requests.adapters import HTTPAdapter
    from urllib3.util.retry import Retry

    session = requests.Session()
    # The bytes as stored at the source: Content-Length and the hash are of those.
    session.headers["Accept-Encoding"] = "identity"
    retry = Retry(total=3, backoff_factor=0.5, status_forcelist=(502, 503, 504))
    session.mount("http://", HTTPAdapter(max_retries=retry))
    session.mount("https://", HTTPAdapter(max_retries=retry))
    return session


def dataset_register_url(*, team: Team, owner: User, name: str, source_url: str) -> Dataset:
    """Register a dataset of the team (`owner`: the member registering it) fetched from an
    HTTPS URL (an S3 object: its presigned URL). The URL is checked now (a 404 is refused and
    nothing is stored); a worker copies it into the bucket and hashes it (`dataset_fetch`),
    and the dataset is READY after that."""
    dataset_name_check(name)
    if len(source_url) > 2000:
        raise ValidationFailed("at most 2000 characters", field="source_url")
    file_name, size = _source_check(source_url)
    with transaction.atomic():
        _quota_reserve(team=team, total_bytes=size)
        _name_free(team=team, name=name)
        dataset = Dataset.objects.create(
            team=team,
            owner=owner,
            name=name,
            source_url=source_url,
            total_bytes=size,
            file_count=1,
            status_reason="fetching from the URL",
        )
        DatasetFile.objects.create(dataset=dataset, path=file_name, size_bytes=size, sha256="")
        dataset_id = str(dataset.pk)
        transaction.on_commit(lambda: _send_task("storage.dataset_fetch", dataset_id), robust=True)
    return dataset


def _send_task(name: str, *args: str) -> None:
    from celery import current_app

    current_app.send_task(name, args=args)


class _HashingReader:
    """A stream that hashes what is read and refuses more than `limit` bytes."""

    def __init__(self, raw, limit: int) -> None:
        self.raw, self.limit, self.read_bytes = raw, limit, 0
        self.digest = hashlib.sha256()

    def read(self, n: int = -1) -> bytes:
        chunk = self.raw.read(n if n and n > 0 else 1 << 20)
        self.read_bytes += len(chunk)
        if self.read_bytes > self.limit:
            raise ValueError("the URL sent more bytes than it declared")
        self.digest.update(chunk)
        return chunk


def _dataset_fail(dataset: Dataset, reason: str) -> None:
    """A failed dataset keeps its row (the customer reads why) and frees its quota and bytes."""
    try:
        objectstore.delete_prefix(dataset.prefix)
    except objectstore.StorageUnavailable:
        log.warning("objects of failed dataset %s left for the abandon sweep", dataset.pk)
    Dataset.objects.filter(pk=dataset.pk).update(
        status=DatasetStatus.FAILED, status_reason=reason[:500], total_bytes=0
    )


def dataset_fetch(*, dataset_id) -> Dataset | None:
    """Copy a URL-registered dataset into the bucket, hashing it on the way; idempotent (a
    dataset no longer being fetched is left alone)."""
    dataset = Dataset.objects.filter(pk=dataset_id, status=DatasetStatus.UPLOADING).first()
    if dataset is None or not dataset.source_url:
        return dataset
    f = dataset.files.get()
    try:
        with _http().get(
            dataset.source_url, timeout=(10, 60), stream=True, allow_redirects=False
        ) as answer:
            if answer.status_code != 200:
                _dataset_fail(dataset, f"the URL answered {answer.status_code}")
                return dataset
            answer.raw.decode_content = False
            reader = _HashingReader(answer.raw, f.size_bytes)
            objectstore.put_stream(f.key, reader, size_bytes=f.size_bytes)
    except (requests.RequestException, ValueError, objectstore.StorageUnavailable) as exc:
        _dataset_fail(dataset, f"fetch failed: {exc}")
        return dataset
    if reader.read_bytes != f.size_bytes:
        _dataset_fail(dataset, f"got {reader.read_bytes} bytes, the URL declared {f.size_bytes}")
        return dataset
    now = timezone.now()
    with transaction.atomic():
        DatasetFile.objects.filter(pk=f.pk).update(sha256=reader.digest.hexdigest(), stored_at=now)
        Dataset.objects.filter(pk=dataset.pk).update(
            status=DatasetStatus.READY, status_reason="", ready_at=now
        )
    dataset.refresh_from_db()
    return dataset


def dataset_delete(*, team: Team, dataset_id) -> None:
    """Delete a dataset and its objects; refused (409) while an active rental reads it."""
    dataset = dataset_owned(team=team, dataset_id=dataset_id)
    with transaction.atomic():
        locked = Dataset.objects.select_for_update().get(pk=dataset.pk)
        if RentalDataset.objects.filter(
            dataset=locked, rental__status__in=lifecycle.ACTIVE
        ).exists():
            raise Conflict("a rental that has not ended reads this dataset")
        uploads = list(
            locked.files.exclude(upload_id="").values_list("pk", "upload_id", "dataset_id")
        )
        RentalDataset.objects.filter(dataset=locked).delete()
        locked.delete()
        # The rows go only if the objects go too: a storage error rolls the delete back.
        for pk, upload_id, ds in uploads:
            objectstore.multipart_abort(f"datasets/{ds}/files/{pk}", upload_id)
        objectstore.delete_prefix(dataset.prefix)


MAX_DATASETS = 16


def rental_datasets_attach(*, rental: Rental, names: Sequence[str]) -> list[RentalDataset]:
    """Link the named datasets to a rental rental_create is storing, in its transaction: each
    must be the rental's team's and READY, and stays locked until the rental is stored (a delete
    waits, then sees the rental that reads it). Handed to the marketplace when the app is
    ready (the marketplace does not import this app)."""
    names = tuple(names)
    if not names:
        return []
    if len(names) > MAX_DATASETS:
        raise ValidationFailed(f"at most {MAX_DATASETS} datasets", field="datasets")
    if len(set(names)) != len(names):
        raise ValidationFailed("a dataset is named twice", field="datasets")
    found = {
        d.name: d
        for d in datasets_owned(rental.team)
        .filter(name__in=names)
        .select_for_update()
        .order_by("pk")
    }
    for name in names:
        dataset = found.get(name)
        if dataset is None:
            raise ValidationFailed(f"your team has no dataset named {name!r}", field="datasets")
        if dataset.status != DatasetStatus.READY:
            raise ValidationFailed(f"dataset {name!r} is {dataset.status}", field="datasets")
    return RentalDataset.objects.bulk_create(
        [RentalDataset(rental=rental, dataset=found[name]) for name in names]
    )


def dataset_uploads_abandon(*, now: datetime | None = None) -> int:
    """Uploads unfinished for UPLOAD_ABANDON_AFTER are failed: objects deleted, quota freed."""
    now = now or timezone.now()
    stale = Dataset.objects.filter(
        status=DatasetStatus.UPLOADING, created_at__lt=now - UPLOAD_ABANDON_AFTER
    )
    done = 0
    for dataset in stale[:200]:
        for f in dataset.files.exclude(upload_id=""):
            objectstore.multipart_abort(f.key, f.upload_id)
        _dataset_fail(dataset, "the upload was not finished in time")
        done += 1
    return done


# -- artifacts -----------------------------------------------------------------------------------


def artifact_uploads_presign(*, rental: Rental, files: Sequence[FileSpec]) -> list[Upload]:
    """Where the agent puts each output file of the rental: nothing for a file stored with the
    same size and SHA-256 (`skip`), else a PUT or a multipart upload under the rental's prefix.
    Refused whole when a path is bad or the rental's output would exceed its limit."""
    files = files_check(files)
    existing = {a.path: a for a in Artifact.objects.filter(rental=rental)}
    limit = int(settings.STORAGE["ARTIFACT_MAX_BYTES_PER_RENTAL"])
    kept = sum(a.size_bytes for path, a in existing.items() if path not in {f.path for f in files})
    if kept + sum(f.size_bytes for f in files) > limit:
        raise QuotaExceeded(f"the rental's output would exceed {limit} bytes", field="files")
    uploads = []
    for f in files:
        old = existing.get(f.path)
        if old is not None and old.sha256 == f.sha256 and old.size_bytes == f.size_bytes:
            uploads.append(Upload(path=f.path, skip=True))
            continue
        uploads.append(_upload_for(artifact_key(rental.pk, f.path), f.path, f.size_bytes))
    return uploads


def artifacts_commit(
    *, rental: Rental, run_id: str, files: Sequence[UploadedFile], reason: str
) -> CommitResult:
    """Record each uploaded file that checks out (its multipart upload joined, the object there
    with the declared size); the others are refused with why and nothing is recorded for them."""
    if reason not in ARTIFACT_REASONS:
        raise ValidationFailed(f"one of {', '.join(ARTIFACT_REASONS[1:])}", field="reason")
    files_check([FileSpec(path=f.path, size_bytes=f.size_bytes, sha256=f.sha256) for f in files])
    result = CommitResult()
    for f in files:
        key = artifact_key(rental.pk, f.path)
        if f.upload_id and not objectstore.multipart_complete(key, f.upload_id, f.etags):
            result.refused[f.path] = "the parts do not make up the upload"
            continue
        found = objectstore.head(key)
        if found is None:
            result.refused[f.path] = "no object was uploaded"
            continue
        if found.size_bytes != f.size_bytes:
            result.refused[f.path] = f"stored {found.size_bytes} bytes, declared {f.size_bytes}"
            Artifact.objects.filter(rental=rental, path=f.path).delete()
            objectstore.delete_keys([key])
            continue
        Artifact.objects.update_or_create(
            rental=rental,
            path=f.path,
            defaults={
                "size_bytes": f.size_bytes,
                "sha256": f.sha256,
                "run_id": run_id,
                "reason": reason,
                "synced_at": timezone.now(),
            },
        )
        result.stored += 1
    return result


def artifacts_expire(*, now: datetime | None = None) -> int:
    """Delete the artifacts (objects and rows) of rentals that ended more than
    STORAGE["ARTIFACT_RETENTION_DAYS"] ago; returns how many rentals were cleared. One pass at
    a time cluster-wide."""
    now = now or timezone.now()
    cutoff = now - timedelta(days=int(settings.STORAGE["ARTIFACT_RETENTION_DAYS"]))
    done = 0
    with advisory_lock("storage.artifacts_expire") as mine:
        if not mine:
            return 0
        expired = (
            Rental.objects.filter(
                status__in=lifecycle.TERMINAL, ended_at__lt=cutoff, artifacts__isnull=False
            )
            .values_list("pk", flat=True)
            .distinct()
        )
        for rental_id in list(expired[:500]):
            objectstore.delete_prefix(f"rentals/{rental_id}/")
            Artifact.objects.filter(rental_id=rental_id).delete()
            done += 1
    return done
