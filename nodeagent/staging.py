"""Staging before a run starts: its datasets (read-only) and the checkpoint it resumes from.

Every file comes from object storage through a presigned GET (`StagedFile.url`) and goes
through the node's content-addressed cache (`ContentCache`, under the agent's state dir, keyed
by sha256): a second run naming the same content downloads nothing. A download is bounded by
the size the server announced, hashed as it arrives and kept only when the sha256 matches.

What a run gets (`stage_run`), under `<stage_root>/<run_id>/`:

    data/<dataset name>/<path>   hard links to the cached blobs (a copy across file systems),
                                 files 0444 and directories 0555: the docker runtime mounts
                                 `data/` read-only at /data, the process runtime points
                                 GPUMARKET_DATA_DIR at it
    resume/<path>                the resume files, which the runtime copies into the run's
                                 workspace (/workspace) before it starts, owned by its user

Paths are the server's but untrusted all the same: absolute paths, `..`, `.` or empty
components, backslashes and control characters are refused, as are dataset names that are no
plain name.
A refused path, a size or sha256 that does not match, or a URL answering 4xx fails the start
(`StagingError`, a permanent runtime error: the reason reaches the server in the run's report);
an unreachable store or a 5xx is retried with backoff and then left to the next start attempt
(`TransientStagingError`). Staging runs in the start operation's worker thread, so heartbeats
go on meanwhile, and the run is not started (nor its usage reported) until it is done.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import random
import re
import shutil
import stat
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

import requests

from agentprotocol import DesiredRun, StagedFile
from nodeagent import metrics as metrics_module
from nodeagent.runtime.base import PermanentRuntimeError, RetryableRuntimeError

logger = logging.getLogger(__name__)

CHUNK_BYTES = 1024 * 1024
CONNECT_TIMEOUT_S = 5.0
READ_TIMEOUT_S = 60.0
DOWNLOAD_ATTEMPTS = 4
BACKOFF_BASE_S, BACKOFF_MAX_S = 0.5, 8.0
MAX_PATH_CHARS = 1024
MAX_FILES_PER_RUN = 100_000

_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


class StagingError(PermanentRuntimeError):
    """A file cannot be staged as the server described it; retrying will not help."""


class TransientStagingError(RetryableRuntimeError):
    """Object storage was unreachable or answered 5xx; a later start may succeed."""


def relative_path_check(path: str, *, what: str) -> str:
    """`path` when it is a safe relative path (not absolute, no `..`, `.` or empty component,
    no backslash or control character); StagingError naming `what` otherwise."""
    if not path or len(path) > MAX_PATH_CHARS:
        raise StagingError(f"{what}: path must be 1 to {MAX_PATH_CHARS} characters")
    if _CONTROL.search(path) or "\\" in path:
        raise StagingError(f"{what}: path {path!r} holds a control character or a backslash")
    if path.startswith("/"):
        raise StagingError(f"{what}: path {path!r} is absolute")
    parts = path.split("/")
    if any(part in ("", ".", "..") for part in parts):
        raise StagingError(f"{what}: path {path!r} has an empty, '.' or '..' component")
    return path


def dataset_name_check(name: str) -> str:
    if not _NAME.match(name):
        raise StagingError(
            f"dataset name {name!r} must be a plain name (letters, digits, '_', '.', '-')"
        )
    return name


def _file_check(file: StagedFile, what: str) -> None:
    relative_path_check(file.path, what=what)
    if not _SHA256.match(file.sha256):
        raise StagingError(f"{what}: sha256 {file.sha256!r} is not 64 lowercase hex digits")
    if file.size_bytes < 0:
        raise StagingError(f"{what}: size_bytes must not be negative")
    if not file.url.startswith(("http://", "https://")):
        raise StagingError(f"{what}: url must be http(s)")


def _backoff(attempt: int) -> float:
    delay = min(BACKOFF_MAX_S, BACKOFF_BASE_S * 2**attempt)
    return delay / 2 + random.uniform(0, delay / 2)


class ContentCache:
    """Blobs by sha256 under `root`, at most `max_bytes` in all, least recently used evicted.

    A blob is written to a temporary file, checked, made read-only and renamed into place, so
    `blobs/` only ever holds complete, verified content. Runs use hard links to the blobs: an
    eviction unlinks the cache's name only, never a file a run still reads.
    """

    def __init__(self, root: str, *, max_bytes: int, session: requests.Session | None = None):
        self.root = root
        self.max_bytes = max_bytes
        self._blobs = os.path.join(root, "blobs")
        self._tmp = os.path.join(root, "tmp")
        for directory in (self._blobs, self._tmp):
            os.makedirs(directory, mode=0o700, exist_ok=True)
        # Downloads that a killed agent left half-done.
        for name in os.listdir(self._tmp):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(self._tmp, name))
        self._session = session or requests.Session()
        self._lock = threading.Lock()
        self._fetching: dict[str, threading.Lock] = {}

    def blob_path(self, sha256: str) -> str:
        return os.path.join(self._blobs, sha256[:2], sha256)

    def get(self, file: StagedFile, *, what: str) -> tuple[str, bool]:
        """The cached blob of `file`, downloaded first when missing; (path, was it a hit)."""
        with self._lock:
            fetch_lock = self._fetching.setdefault(file.sha256, threading.Lock())
        # One download per content, however many runs start with it at once.
        with fetch_lock:
            path = self.blob_path(file.sha256)
            if os.path.exists(path):
                with contextlib.suppress(OSError):
                    os.utime(path)  # the LRU clock
                metrics_module.STAGING_CACHE.labels(result="hit").inc()
                return path, True
            if file.size_bytes > self.max_bytes:
                raise StagingError(
                    f"{what}: {file.size_bytes} bytes exceed the node's cache "
                    f"({self.max_bytes} bytes)"
                )
            self.evict(reserve=file.size_bytes)
            self._download(file, path, what=what)
            metrics_module.STAGING_CACHE.labels(result="miss").inc()
            return path, False

    def _download(self, file: StagedFile, path: str, *, what: str) -> None:
        for attempt in range(DOWNLOAD_ATTEMPTS):
            try:
                self._download_once(file, path, what=what)
                return
            except TransientStagingError as exc:
                if attempt == DOWNLOAD_ATTEMPTS - 1:
                    raise
                delay = _backoff(attempt)
                logger.warning(
                    "download failed, retrying",
                    extra={"file": what, "error": str(exc), "retry_in_s": round(delay, 2)},
                )
                time.sleep(delay)

    def _download_once(self, file: StagedFile, path: str, *, what: str) -> None:
        tmp = os.path.join(self._tmp, f"{file.sha256}.{threading.get_ident()}")
        digest = hashlib.sha256()
        received = 0
        try:
            with self._session.get(
                file.url, stream=True, timeout=(CONNECT_TIMEOUT_S, READ_TIMEOUT_S)
            ) as response:
                status = response.status_code
                if status == 429 or status >= 500:
                    raise TransientStagingError(f"{what}: object storage answered {status}")
                if status != 200:
                    # 403: the presigned URL expired or was refused; 404: the object is gone.
                    raise StagingError(f"{what}: object storage answered {status}")
                with open(tmp, "wb") as out:
                    for chunk in response.iter_content(CHUNK_BYTES):
                        received += len(chunk)
                        if received > file.size_bytes:
                            raise StagingError(
                                f"{what}: more than the announced {file.size_bytes} bytes"
                            )
                        digest.update(chunk)
                        out.write(chunk)
                    out.flush()
                    os.fsync(out.fileno())
        except requests.RequestException as exc:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise TransientStagingError(f"{what}: download failed: {exc}") from exc
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        metrics_module.STAGING_BYTES.inc(received)
        try:
            if received != file.size_bytes:
                raise StagingError(
                    f"{what}: {received} bytes received, {file.size_bytes} announced"
                )
            if digest.hexdigest() != file.sha256:
                raise StagingError(
                    f"{what}: sha256 mismatch (announced {file.sha256}, "
                    f"received {digest.hexdigest()})"
                )
            os.chmod(tmp, 0o444)
            os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def evict(self, *, reserve: int = 0) -> int:
        """Remove least recently used blobs until `reserve` more bytes fit; bytes freed."""
        entries = []
        for directory, _, names in os.walk(self._blobs):
            for name in names:
                path = os.path.join(directory, name)
                with contextlib.suppress(FileNotFoundError):
                    st = os.stat(path)
                    entries.append((st.st_mtime, st.st_size, path))
        total = sum(size for _, size, _ in entries)
        freed = 0
        for _, size, path in sorted(entries):
            if total - freed + reserve <= self.max_bytes:
                break
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
                freed += size
        if freed:
            logger.info("cache evicted", extra={"bytes": freed})
        return freed

    def close(self) -> None:
        self._session.close()


@dataclass(frozen=True, slots=True)
class StagedRun:
    """Where a run's staged files are: `data_dir` (one directory per dataset) and `seed_dir`
    (files for its workspace); "" when the run has none."""

    data_dir: str = ""
    seed_dir: str = ""
    downloaded: int = 0  # files that were not in the cache


def _place(blob: str, target: str) -> None:
    os.makedirs(os.path.dirname(target), exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(target)
    try:
        os.link(blob, target)
    except OSError:  # another file system, or links not allowed: a copy does as well
        shutil.copyfile(blob, target)
        os.chmod(target, 0o444)


def _seal(directory: str) -> None:
    """Directories 0555, files 0444: what the run reads, it cannot change."""
    for parent, dirs, files in os.walk(directory):
        for name in files:
            os.chmod(os.path.join(parent, name), 0o444)
        for name in dirs:
            os.chmod(os.path.join(parent, name), 0o555)  # noqa: S103 - read-only for all
    os.chmod(directory, 0o555)  # noqa: S103 - the run's user (another uid) reads through it


def stage_dir_remove(path: str) -> None:
    """Remove a run's stage directory (sealed read-only)."""
    if not os.path.lexists(path):
        return
    for parent, dirs, _ in os.walk(path):
        for name in dirs:
            with contextlib.suppress(OSError):
                os.chmod(os.path.join(parent, name), 0o700)
    with contextlib.suppress(OSError):
        os.chmod(path, 0o700)
    shutil.rmtree(path, ignore_errors=True)


def _files(entry: DesiredRun) -> Iterable[tuple[str, StagedFile, str]]:
    """(target relative to the run's stage dir, file, description) of every staged file."""
    names: set[str] = set()
    for dataset in entry.datasets:
        name = dataset_name_check(dataset.name)
        if name in names:
            raise StagingError(f"dataset name {name!r} is given twice")
        names.add(name)
        for file in dataset.files:
            what = f"dataset {name!r} file {file.path!r}"
            _file_check(file, what)
            yield os.path.join("data", name, file.path), file, what
    for file in entry.resume_files:
        what = f"resume file {file.path!r}"
        _file_check(file, what)
        yield os.path.join("resume", file.path), file, what


def stage_run(entry: DesiredRun, *, cache: ContentCache, stage_root: str) -> StagedRun:
    """Download (through the cache) and lay out what `entry` stages; see the module docstring.

    Idempotent: a retried start lays the same files out again from the cache."""
    if not entry.datasets and not entry.resume_files:
        return StagedRun()
    planned = list(_files(entry))
    if len(planned) > MAX_FILES_PER_RUN:
        raise StagingError(f"{len(planned)} staged files, at most {MAX_FILES_PER_RUN}")
    targets = [target for target, _, _ in planned]
    if len(set(targets)) != len(targets):
        raise StagingError("two staged files share one path")
    run_dir = os.path.join(stage_root, entry.run_id)
    stage_dir_remove(run_dir)
    os.makedirs(run_dir, mode=0o755)
    started = time.monotonic()
    downloaded = 0
    try:
        for target, file, what in planned:
            blob, hit = cache.get(file, what=what)
            downloaded += not hit
            _place(blob, os.path.join(run_dir, target))
    except BaseException:
        stage_dir_remove(run_dir)
        raise
    data_dir = os.path.join(run_dir, "data") if entry.datasets else ""
    seed_dir = os.path.join(run_dir, "resume") if entry.resume_files else ""
    if data_dir:
        _seal(data_dir)
    if seed_dir:
        _seal(seed_dir)
    os.chmod(run_dir, 0o555)  # noqa: S103 - the run's user (another uid) reads through it
    metrics_module.STAGING_SECONDS.observe(time.monotonic() - started)
    logger.info(
        "run staged",
        extra={
            "run_id": entry.run_id,
            "files": len(planned),
            "downloaded": downloaded,
            "seconds": round(time.monotonic() - started, 3),
        },
    )
    return StagedRun(data_dir=data_dir, seed_dir=seed_dir, downloaded=downloaded)


def workspace_delete(workspace: str) -> None:
    """Delete a rental's host workspace and its quota image (`<workspace>.ext4`, unmounted
    first by the caller): the customer's output leaves the host once it is synced. A mount
    still on it is left alone (deleting would empty a volume some run still uses)."""
    if os.path.ismount(workspace):
        logger.warning("workspace still mounted, not deleted", extra={"workspace": workspace})
        return
    # The run may have left read-only directories; links it left are never followed.
    for parent, dirs, _ in os.walk(workspace):
        for name in dirs:
            path = os.path.join(parent, name)
            if not os.path.islink(path):
                with contextlib.suppress(OSError):
                    os.chmod(path, 0o700)
    shutil.rmtree(workspace, ignore_errors=True)
    try:
        os.unlink(f"{workspace}.ext4")
    except FileNotFoundError:
        pass
    except OSError as exc:
        logger.warning("quota image not deleted", extra={"workspace": workspace, "error": str(exc)})
    if not os.path.lexists(workspace):
        logger.info("workspace deleted", extra={"workspace": workspace})


def workspace_seed(seed_dir: str, workspace: str, *, owner: tuple[int, int] | None) -> int:
    """Copy the files of `seed_dir` into `workspace` where no file of that name exists yet
    (a restarted run keeps what it wrote since), owned by `owner` when given (the agent is
    root) and else left readable and writable by all; returns how many were copied."""
    copied = 0
    for parent, _, files in os.walk(seed_dir):
        relative = os.path.relpath(parent, seed_dir)
        target_dir = workspace if relative == "." else os.path.join(workspace, relative)
        _make_dirs(workspace, target_dir, owner)
        for name in files:
            target = os.path.join(target_dir, name)
            if os.path.lexists(target):
                continue
            tmp = os.path.join(target_dir, f".{name}.seed")
            shutil.copyfile(os.path.join(parent, name), tmp)
            if owner is not None:
                os.chown(tmp, *owner)
                os.chmod(tmp, 0o640)
            else:
                os.chmod(tmp, 0o666)  # noqa: S103 - no chown without root: the run must read it
            os.replace(tmp, target)
            copied += 1
    return copied


def _make_dirs(workspace: str, target_dir: str, owner: tuple[int, int] | None) -> None:
    """Create `target_dir` below `workspace`, refusing any component that is not a real
    directory: a link the run left in its workspace must not lead the agent elsewhere."""
    path = workspace
    for part in os.path.relpath(target_dir, workspace).split(os.sep):
        if part == ".":
            continue
        path = os.path.join(path, part)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            os.mkdir(path)
            if owner is not None:
                os.chown(path, *owner)
                os.chmod(path, 0o770)  # noqa: S103 - owner and group are the run's user
            else:
                os.chmod(path, 0o777)  # noqa: S103 - the run's user must write its checkpoints
            continue
        if not stat.S_ISDIR(st.st_mode):
            raise StagingError(f"{path} is not a directory (a link?): resume files not placed")
