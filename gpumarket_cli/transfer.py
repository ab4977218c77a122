"""The CLI's transfers to and from object storage (no Django): `data push` uploads a file or a
directory as a dataset through the presigned URLs the server hands out (big files in parts),
`artifacts pull` downloads a rental's synced output. Both show a progress bar on stderr and
check every file's SHA-256.

The bytes go straight between this machine and the bucket; the server only signs URLs and
checks what arrived. Presigned requests never carry the API token.
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path, PurePosixPath
from typing import Any, Protocol

import requests

TIMEOUT_S = (10, 300)
RETRIES = 4
CHUNK = 1 << 20


class TransferError(Exception):
    pass


class ApiLike(Protocol):
    def call(self, method: str, path: str, **kwargs: Any) -> Any: ...


class Progress:
    """`label [#####.....]  45%  12.3/27.0 MiB` on one line of stderr, redrawn at most 10
    times a second."""

    def __init__(self, label: str, total: int, stream=None) -> None:
        self.label, self.total, self.done = label, max(total, 0), 0
        self.stream = stream or sys.stderr
        self._drawn = 0.0

    def add(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if now - self._drawn >= 0.1 or self.done >= self.total:
            self._drawn = now
            self.draw()

    def draw(self) -> None:
        share = 1.0 if self.total == 0 else min(self.done / self.total, 1.0)
        bar = "#" * int(share * 30)
        done, total = self.done / (1 << 20), self.total / (1 << 20)
        self.stream.write(f"\r{self.label} [{bar:<30}] {share:5.0%} {done:.1f}/{total:.1f} MiB")
        self.stream.flush()

    def finish(self) -> None:
        self.draw()
        self.stream.write("\n")
        self.stream.flush()


def _retrying(what: str, fn: Callable[[], requests.Response]) -> requests.Response:
    """Run one request with backoff on connection errors and 5xx; a 4xx is final."""
    for attempt in range(RETRIES):
        try:
            answer = fn()
        except requests.RequestException as exc:
            if attempt == RETRIES - 1:
                raise TransferError(f"{what}: {exc}") from exc
        else:
            if answer.status_code < 500:
                if answer.status_code >= 400:
                    raise TransferError(f"{what}: HTTP {answer.status_code}")
                return answer
            if attempt == RETRIES - 1:
                raise TransferError(f"{what}: HTTP {answer.status_code}")
        time.sleep(0.5 * 2**attempt)
    raise AssertionError("unreachable")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def local_files(root: Path) -> list[tuple[str, Path]]:
    """(dataset path, local file) of a file, or of every file under a directory, sorted."""
    if root.is_file():
        return [(root.name, root)]
    if not root.is_dir():
        raise TransferError(f"{root}: no such file or directory")
    found = []
    for dirpath, _, names in os.walk(root):
        for name in names:
            local = Path(dirpath) / name
            if local.is_file():
                found.append((local.relative_to(root).as_posix(), local))
    if not found:
        raise TransferError(f"{root}: no files")
    return sorted(found)


class _Reader:
    """A slice of a file as a PUT body: sent with its Content-Length (S3 refuses chunked
    uploads to presigned URLs), counting what goes out."""

    def __init__(self, path: Path, offset: int, length: int, progress: Progress) -> None:
        self.path, self.offset, self.length, self.progress = path, offset, length, progress
        self.left = length
        self.file = None

    def __len__(self) -> int:
        return self.length

    def read(self, n: int = -1) -> bytes:
        if self.file is None:
            self.file = self.path.open("rb")
            self.file.seek(self.offset)
        want = self.left if n is None or n < 0 else min(n, self.left)
        chunk = self.file.read(want) if want > 0 else b""
        self.left -= len(chunk)
        self.progress.add(len(chunk))
        return chunk

    def put(self, session: requests.Session, url: str) -> requests.Response:
        try:
            return session.put(url, data=self, timeout=TIMEOUT_S)
        finally:
            if self.file is not None:
                self.file.close()


def push(api: ApiLike, root: Path, name: str, *, stream=None) -> dict:
    """Upload `root` as the dataset `name`; returns the ready dataset."""
    files = local_files(root)
    specs = [
        {"path": path, "size_bytes": local.stat().st_size, "sha256": _sha256(local)}
        for path, local in files
    ]
    answer = api.call("POST", "/api/v1/datasets/", json={"name": name, "files": specs})
    dataset = answer["dataset"]
    local_by_path = dict(files)
    progress = Progress(f"push {name}", sum(s["size_bytes"] for s in specs), stream)
    session = requests.Session()
    parts: dict[str, list[str]] = {}
    for upload in answer["uploads"]:
        local = local_by_path[upload["path"]]
        size = local.stat().st_size
        if upload["url"]:
            # A retried PUT re-sends the whole body: the bar may pass a file's size on a retry.
            _retrying(
                upload["path"],
                lambda local=local, size=size, url=upload["url"]: _Reader(
                    local, 0, size, progress
                ).put(session, url),
            )
            continue
        part = upload["part_size_bytes"]
        etags = []
        for n, url in enumerate(upload["part_urls"]):
            length = min(part, size - n * part)
            sent = _retrying(
                f"{upload['path']} part {n + 1}",
                lambda local=local, offset=n * part, length=length, url=url: _Reader(
                    local, offset, length, progress
                ).put(session, url),
            )
            etags.append(sent.headers["ETag"])
        parts[upload["path"]] = etags
    progress.finish()
    return api.call("POST", f"/api/v1/datasets/{dataset['id']}/complete/", json={"parts": parts})


def _safe_target(dest: Path, path: str) -> Path:
    """Where an artifact goes under dest; a path that would leave dest is refused."""
    pure = PurePosixPath(path)
    if pure.is_absolute() or any(part in ("", ".", "..") for part in pure.parts):
        raise TransferError(f"refusing artifact path {path!r}")
    return dest.joinpath(*pure.parts)


def pages(api: ApiLike, path: str) -> Iterator[dict]:
    offset = 0
    while True:
        page = api.call("GET", path, params={"limit": 500, "offset": offset})
        yield from page["results"]
        offset += len(page["results"])
        if not page.get("next") or not page["results"]:
            return


def pull(api: ApiLike, rental_id: str, dest: Path, *, stream=None) -> list[Path]:
    """Download every synced output file of a rental under dest, checking each SHA-256."""
    artifacts = list(pages(api, f"/api/v1/rentals/{rental_id}/artifacts/"))
    progress = Progress(f"pull {rental_id}", sum(a["size_bytes"] for a in artifacts), stream)
    session = requests.Session()
    written = []
    for artifact in artifacts:
        target = _safe_target(dest, artifact["path"])
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(target.name + ".part")
        answer = _retrying(
            artifact["path"],
            lambda url=artifact["download_url"]: session.get(url, stream=True, timeout=TIMEOUT_S),
        )
        digest = hashlib.sha256()
        with answer, partial.open("wb") as f:
            for chunk in answer.iter_content(CHUNK):
                f.write(chunk)
                digest.update(chunk)
                progress.add(len(chunk))
        if digest.hexdigest() != artifact["sha256"]:
            partial.unlink()
            raise TransferError(f"{artifact['path']}: downloaded bytes do not match its sha256")
        partial.replace(target)
        written.append(target)
    progress.finish()
    return written
