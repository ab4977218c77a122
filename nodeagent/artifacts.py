"""Artifact sync: a run's output directory (its workspace: checkpoints, final model, metrics,
logs) copied to object storage while it runs and once more after it ends.

One sync of a run (`ArtifactSyncer.sync`):

1. walk the output directory: regular files only (no links), the harness's half-written
   temporaries (`.*.tmp`, files or directories) and the agent's own (`.*.seed`) left out; a
   file whose size and mtime are those of the last sync keeps its sha256 (big checkpoints are
   hashed once);
2. ask the server for presigned uploads (ARTIFACT_UPLOADS_PATH) for every file not committed
   as it is now; a file the server already stores with that sha256 comes back `skip`;
3. PUT the bytes, streamed from disk: one request for a small file, the parts of a multipart
   upload in parallel threads for a big one; transient failures are retried with backoff;
4. commit (ARTIFACT_COMMIT_PATH) what was uploaded and has not changed meanwhile (a log still
   being written waits for the next sync), with the parts' ETags and the reason;
5. record what was committed in `<state>/sync/<run_id>.json`, written atomically: a restarted
   agent uploads again only what was not committed.

Syncs run in one background thread fed by a bounded queue (`request`), never in the heartbeat
round: a slow store delays artifacts, never heartbeats. A run's requests coalesce (one pending
sync per run; a final one is never downgraded). A final sync (`stop`, `complete`, `preempt`,
`fail`) that fails for a transient reason is retried with backoff until FINAL_DEADLINE_S; the
agent holds back the run's exited report meanwhile (`final_done`), so the server still takes
the uploads of a rental it believes is running.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import hashlib
import json
import logging
import math
import os
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import requests
from requests.adapters import HTTPAdapter

from agentprotocol import (
    ArtifactCommit,
    ArtifactCommitAnswer,
    ArtifactFile,
    ArtifactUpload,
    ArtifactUploadAnswer,
    ArtifactUploadRequest,
    CommittedFile,
    ProtocolError,
)
from nodeagent import metrics as metrics_module
from nodeagent.client import AgentApiClient, AgentApiError, TransientApiError, backoff_delay
from nodeagent.spool import write_atomic
from nodeagent.staging import StagingError, relative_path_check

logger = logging.getLogger(__name__)

FINAL_REASONS = frozenset({"stop", "complete", "preempt", "fail"})
SYNC_DIR = "sync"
MAX_FILES = 10_000  # per run and sync; the rest waits for the next one
FILES_PER_REQUEST = 100
MAX_PENDING = 256  # runs with a sync waiting; more requests are dropped (and come back)
FINAL_DEADLINE_S = 600.0
FINAL_RETRY_BASE_S, FINAL_RETRY_MAX_S = 2.0, 60.0
UPLOAD_WORKERS = 8
PUT_ATTEMPTS = 4
PUT_BACKOFF_BASE_S, PUT_BACKOFF_MAX_S = 0.5, 8.0
CONNECT_TIMEOUT_S = 5.0
SEND_TIMEOUT_S = 300.0  # per read of the store's answer; a part's bytes stream meanwhile
READ_BLOCK = 1024 * 1024
HASH_BLOCK = 4 * 1024 * 1024


class SyncError(Exception):
    """A sync did not complete; `transient` says whether trying again can help."""

    def __init__(self, message: str, *, transient: bool) -> None:
        super().__init__(message)
        self.transient = transient


@dataclass(frozen=True, slots=True)
class SyncResult:
    """What one sync did."""

    committed: int = 0  # files uploaded and recorded by the server this time
    uploaded_bytes: int = 0
    skipped: int = 0  # already stored with the same content: nothing sent
    refused: dict[str, str] = field(default_factory=dict)


@dataclass(slots=True)
class _Job:
    run_id: str
    rental_id: str
    output_dir: str
    reason: str
    not_before: float = 0.0  # monotonic
    first_tried: float | None = None  # monotonic, for the final deadline


class _Slice:
    """`length` bytes of a file from `offset`, read in large blocks as the request sends them
    (http.client asks for 8 KiB at a time; larger reads keep the copy cheap)."""

    def __init__(self, path: str, offset: int, length: int, count: Callable[[int], None]):
        self._file = open(path, "rb")  # noqa: SIM115 - closed by close(), after the request
        self._file.seek(offset)
        self._left = length
        self._length = length
        self._count = count

    def __len__(self) -> int:
        return self._length

    def read(self, size: int = -1) -> bytes:
        if self._left <= 0:
            return b""
        want = self._left if size is None or size < 0 else max(size, READ_BLOCK)
        data = self._file.read(min(want, self._left))
        self._left -= len(data)
        self._count(len(data))
        return data

    def close(self) -> None:
        self._file.close()


def file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(HASH_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def _skipped_name(name: str) -> bool:
    return name.startswith(".") and name.endswith((".tmp", ".seed"))


class ArtifactSyncer:
    """The background syncer of one agent; see the module docstring."""

    def __init__(
        self,
        *,
        server_url: str,
        state_dir: str,
        token: Callable[[], str | None],
        request_timeout_s: float = 10.0,
        upload_workers: int = UPLOAD_WORKERS,
    ) -> None:
        self._client = AgentApiClient(server_url, timeout_s=request_timeout_s)
        self._dir = os.path.join(state_dir, SYNC_DIR)
        os.makedirs(self._dir, mode=0o700, exist_ok=True)
        self._token = token
        self._session = requests.Session()
        adapter = HTTPAdapter(pool_connections=upload_workers, pool_maxsize=upload_workers)
        self._session.mount("http://", adapter)
        self._session.mount("https://", adapter)
        self._pool = concurrent.futures.ThreadPoolExecutor(
            upload_workers, thread_name_prefix="artifact-put"
        )
        self._cond = threading.Condition()
        self._pending: collections.OrderedDict[str, _Job] = collections.OrderedDict()
        self._final_done: set[str] = set()
        self._stopping = False
        self._thread: threading.Thread | None = None

    # -- the queue -----------------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="artifact-sync", daemon=True)
            self._thread.start()

    def request(self, *, run_id: str, rental_id: str, output_dir: str, reason: str) -> bool:
        """Queue a sync of the run (coalesced with one already waiting); False when the queue
        is full (the caller asks again later)."""
        with self._cond:
            waiting = self._pending.get(run_id)
            if waiting is None:
                if len(self._pending) >= MAX_PENDING:
                    metrics_module.SYNC_ERRORS.labels(kind="queue_full").inc()
                    return False
                self._pending[run_id] = _Job(run_id, rental_id, output_dir, reason)
            elif reason in FINAL_REASONS or waiting.reason not in FINAL_REASONS:
                waiting.reason = reason
            self._cond.notify()
            return True

    def final_done(self, run_id: str) -> bool:
        """Whether the run's final sync has finished (committed, or given up on)."""
        with self._cond:
            return run_id in self._final_done

    def forget(self, run_id: str) -> None:
        """The run is gone for good: drop its record of what was committed."""
        with self._cond:
            self._pending.pop(run_id, None)
            self._final_done.discard(run_id)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._manifest_path(run_id))

    def close(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(5)
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._client.close()
        self._session.close()

    def _next_job(self) -> _Job | None:
        with self._cond:
            while not self._stopping:
                now = time.monotonic()
                ready = [job for job in self._pending.values() if job.not_before <= now]
                if ready:
                    job = ready[0]
                    del self._pending[job.run_id]
                    return job
                wake = min((job.not_before for job in self._pending.values()), default=None)
                self._cond.wait(None if wake is None else max(0.05, wake - now))
            return None

    def _work(self) -> None:
        while (job := self._next_job()) is not None:
            final = job.reason in FINAL_REASONS
            if job.first_tried is None:
                job.first_tried = time.monotonic()
            try:
                self.sync(
                    run_id=job.run_id,
                    rental_id=job.rental_id,
                    output_dir=job.output_dir,
                    reason=job.reason,
                )
            except SyncError as exc:
                metrics_module.SYNC_ERRORS.labels(
                    kind="transient" if exc.transient else "refused"
                ).inc()
                late = time.monotonic() - job.first_tried >= FINAL_DEADLINE_S
                if final and exc.transient and not late:
                    delay = backoff_delay(1, base_s=FINAL_RETRY_BASE_S, max_s=FINAL_RETRY_MAX_S)
                    logger.warning(
                        "final artifact sync failed, retrying",
                        extra={"run_id": job.run_id, "error": str(exc), "retry_in_s": delay},
                    )
                    job.not_before = time.monotonic() + delay
                    with self._cond:
                        self._pending.setdefault(job.run_id, job)
                    continue
                logger.error(
                    "artifact sync failed",
                    extra={"run_id": job.run_id, "reason": job.reason, "error": str(exc)},
                )
            except Exception:  # a bug must not end the thread that every run's sync needs
                metrics_module.SYNC_ERRORS.labels(kind="internal").inc()
                logger.exception("artifact sync crashed", extra={"run_id": job.run_id})
            if final:
                with self._cond:
                    self._final_done.add(job.run_id)

    # -- one sync ------------------------------------------------------------------------------

    def sync(self, *, run_id: str, rental_id: str, output_dir: str, reason: str) -> SyncResult:
        """Sync the run's output directory now (in the caller's thread); SyncError if it did
        not complete (what was committed before the failure stays committed)."""
        token = self._token()
        if not token:
            raise SyncError("not joined yet", transient=True)
        manifest = self._load(run_id)
        changed = self._scan(output_dir, manifest)
        result = SyncResult()
        for start in range(0, len(changed), FILES_PER_REQUEST):
            batch = changed[start : start + FILES_PER_REQUEST]
            part = self._sync_batch(
                run_id, rental_id, output_dir, batch, manifest, reason=reason, token=token
            )
            result = SyncResult(
                committed=result.committed + part.committed,
                uploaded_bytes=result.uploaded_bytes + part.uploaded_bytes,
                skipped=result.skipped + part.skipped,
                refused={**result.refused, **part.refused},
            )
        if changed:
            logger.info(
                "artifacts synced",
                extra={
                    "run_id": run_id,
                    "reason": reason,
                    "committed": result.committed,
                    "bytes": result.uploaded_bytes,
                    "skipped": result.skipped,
                    "refused": len(result.refused),
                },
            )
        return result

    def _scan(self, output_dir: str, manifest: dict[str, dict[str, Any]]) -> list[ArtifactFile]:
        """The files that differ from what was last committed, sha256 computed."""
        changed: list[ArtifactFile] = []
        if not os.path.isdir(output_dir):
            return changed
        for parent, dirs, files in os.walk(output_dir):
            relative_parent = os.path.relpath(parent, output_dir)
            # lost+found: the quota image's own; nothing of the run's is in it. A `.*.tmp`
            # directory is a sharded checkpoint being written (renamed once it is whole).
            dirs[:] = sorted(
                d
                for d in dirs
                if not (relative_parent == "." and d == "lost+found") and not _skipped_name(d)
            )
            for name in sorted(files):
                if _skipped_name(name):
                    continue
                full = os.path.join(parent, name)
                path = name if relative_parent == "." else f"{relative_parent}/{name}"
                try:
                    relative_path_check(path, what="output file")
                    st = os.lstat(full)
                except (StagingError, FileNotFoundError):
                    continue
                if not os.path.isfile(full) or os.path.islink(full):
                    continue
                known = manifest.get(path)
                same = (
                    known is not None
                    and known["size"] == st.st_size
                    and known["mtime_ns"] == st.st_mtime_ns
                )
                if same and known["committed"]:
                    continue
                if len(changed) >= MAX_FILES:
                    logger.warning("too many output files; the rest waits for the next sync")
                    return changed
                try:
                    sha = known["sha256"] if same else file_sha256(full)
                except OSError:
                    continue  # removed meanwhile (a rotated checkpoint)
                manifest[path] = {
                    "size": st.st_size,
                    "mtime_ns": st.st_mtime_ns,
                    "sha256": sha,
                    "committed": False,
                }
                changed.append(ArtifactFile(path=path, size_bytes=st.st_size, sha256=sha))
        return changed

    def _sync_batch(
        self,
        run_id: str,
        rental_id: str,
        output_dir: str,
        batch: list[ArtifactFile],
        manifest: dict[str, dict[str, Any]],
        *,
        reason: str,
        token: str,
    ) -> SyncResult:
        request = ArtifactUploadRequest(run_id=run_id, files=tuple(batch))
        try:
            raw = self._client.artifact_uploads(rental_id, request.to_payload(), token=token)
            answer = ArtifactUploadAnswer.from_payload(raw)
        except TransientApiError as exc:
            raise SyncError(f"upload request failed: {exc}", transient=True) from exc
        except (AgentApiError, ProtocolError) as exc:
            raise SyncError(f"upload request refused: {exc}", transient=False) from exc
        by_path = {file.path: file for file in batch}
        uploads = [u for u in answer.uploads if u.path in by_path]
        sent = 0
        committed: list[CommittedFile] = []
        skipped = 0
        failures: list[str] = []
        futures = {}
        for upload in uploads:
            file = by_path[upload.path]
            full = os.path.join(output_dir, file.path)
            if upload.skip:  # recorded by the server already: nothing to send or commit
                skipped += 1
                manifest[file.path]["committed"] = True
                continue
            try:
                futures[upload.path] = self._upload(full, file, upload)
            except SyncError as exc:
                failures.append(f"{file.path}: {exc}")
        for path, (parts, make) in futures.items():
            file = by_path[path]
            try:
                etags = [future.result() for future in parts]
            except SyncError as exc:
                failures.append(f"{path}: {exc}")
                continue
            sent += file.size_bytes
            full = os.path.join(output_dir, path)
            try:
                st = os.lstat(full)
            except FileNotFoundError:
                continue
            known = manifest[path]
            if (st.st_size, st.st_mtime_ns) != (known["size"], known["mtime_ns"]):
                continue  # written to while it was sent: the next sync takes the new content
            committed.append(make(etags))
        if committed:
            commit = ArtifactCommit(run_id=run_id, files=tuple(committed), reason=reason)
            try:
                raw = self._client.artifact_commit(rental_id, commit.to_payload(), token=token)
                done = ArtifactCommitAnswer.from_payload(raw)
            except TransientApiError as exc:
                raise SyncError(f"commit failed: {exc}", transient=True) from exc
            except (AgentApiError, ProtocolError) as exc:
                raise SyncError(f"commit refused: {exc}", transient=False) from exc
            refused = dict(done.refused)
            for file in committed:
                if file.path not in refused:
                    manifest[file.path]["committed"] = True
            metrics_module.SYNC_FILES.labels(result="uploaded").inc(len(committed) - len(refused))
            if refused:
                metrics_module.SYNC_ERRORS.labels(kind="refused").inc(len(refused))
                logger.warning("the server refused artifacts", extra={"run_id": run_id, **refused})
        else:
            refused = {}
        if committed or skipped:
            metrics_module.SYNC_FILES.labels(result="skipped").inc(skipped)
            self._save(run_id, manifest)
        if failures:
            raise SyncError("; ".join(failures)[:1000], transient=True)
        return SyncResult(
            committed=len(committed) - len(refused),
            uploaded_bytes=sent,
            skipped=skipped,
            refused=refused,
        )

    def _upload(
        self, full: str, file: ArtifactFile, upload: ArtifactUpload
    ) -> tuple[list[concurrent.futures.Future[str]], Callable[[list[str]], CommittedFile]]:
        """Submit the PUTs of one file; (their futures, the CommittedFile from their ETags)."""
        if upload.url:
            future = self._pool.submit(self._put, upload.url, full, 0, file.size_bytes)
            return [future], lambda _: CommittedFile(
                path=file.path, size_bytes=file.size_bytes, sha256=file.sha256
            )
        if not upload.upload_id or upload.part_size_bytes <= 0:
            raise SyncError("the server gave neither a URL nor a multipart upload", transient=True)
        count = max(1, math.ceil(file.size_bytes / upload.part_size_bytes))
        if len(upload.part_urls) != count:
            raise SyncError(f"{len(upload.part_urls)} part URLs for {count} parts", transient=True)
        futures = []
        for index, url in enumerate(upload.part_urls):
            offset = index * upload.part_size_bytes
            length = min(upload.part_size_bytes, file.size_bytes - offset)
            futures.append(self._pool.submit(self._put, url, full, offset, length))
        return futures, lambda etags: CommittedFile(
            path=file.path,
            size_bytes=file.size_bytes,
            sha256=file.sha256,
            upload_id=upload.upload_id,
            etags=tuple(etags),
        )

    def _put(self, url: str, path: str, offset: int, length: int) -> str:
        """PUT `length` bytes of `path` from `offset`; the ETag. Retried when transient."""
        for attempt in range(PUT_ATTEMPTS):
            body = _Slice(path, offset, length, metrics_module.SYNC_BYTES.inc)
            try:
                response = self._session.put(
                    url,
                    data=body,
                    headers={"Content-Length": str(length)},
                    timeout=(CONNECT_TIMEOUT_S, SEND_TIMEOUT_S),
                )
                status = response.status_code
                if status in (200, 201, 204):
                    return response.headers.get("ETag", "")
                transient = status == 429 or status >= 500
                error = SyncError(f"object storage answered {status}", transient=transient)
            except requests.RequestException as exc:
                error = SyncError(f"upload failed: {exc}", transient=True)
            except OSError as exc:  # the file went away
                raise SyncError(f"cannot read {path}: {exc}", transient=True) from exc
            finally:
                body.close()
            if not error.transient or attempt == PUT_ATTEMPTS - 1:
                raise error
            delay = min(PUT_BACKOFF_MAX_S, PUT_BACKOFF_BASE_S * 2**attempt)
            time.sleep(delay / 2 + random.uniform(0, delay / 2))
        raise AssertionError("unreachable")

    # -- what was committed --------------------------------------------------------------------

    def _manifest_path(self, run_id: str) -> str:
        if "/" in run_id or run_id in ("", ".", ".."):
            raise ValueError(f"invalid run_id {run_id!r}")
        return os.path.join(self._dir, f"{run_id}.json")

    def _load(self, run_id: str) -> dict[str, dict[str, Any]]:
        try:
            with open(self._manifest_path(run_id)) as f:
                data = json.load(f)
            return {
                str(path): {
                    "size": int(entry["size"]),
                    "mtime_ns": int(entry["mtime_ns"]),
                    "sha256": str(entry["sha256"]),
                    "committed": bool(entry["committed"]),
                }
                for path, entry in data["files"].items()
            }
        except FileNotFoundError:
            return {}
        except (ValueError, KeyError, TypeError, AttributeError):
            # Written atomically, so this is damage: everything is offered again (the server
            # answers `skip` for what it already stores).
            logger.warning("unreadable sync record, syncing afresh", extra={"run_id": run_id})
            return {}

    def _save(self, run_id: str, manifest: dict[str, dict[str, Any]]) -> None:
        write_atomic(self._manifest_path(run_id), json.dumps({"files": manifest}) + "\n")
