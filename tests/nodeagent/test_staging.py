"""Staging against a real S3 server (SeaweedFS, presigned by boto3): the content cache, the
checks on what the server describes, and the read-only layout a run gets."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import stat
import uuid
from pathlib import Path

import pytest

from agentprotocol import DatasetMount, DesiredRun, StagedFile
from nodeagent.staging import (
    ContentCache,
    StagingError,
    stage_dir_remove,
    stage_run,
    workspace_seed,
)

pytestmark = pytest.mark.s3


def run_entry(**fields) -> DesiredRun:
    base = {
        "rental_id": str(uuid.uuid4()),
        "run_id": f"run-{uuid.uuid4().hex[:12]}",
        "image": "gpumarket/harness:dev",
        "command": ("python", "-c", "pass"),
        "env": {},
        "gpu_indices": (0,),
        "gpu_uuids": (),
        "cpu_limit": 1.0,
        "memory_limit_mb": 512,
        "ports": (),
    }
    return DesiredRun(**{**base, **fields})


@pytest.fixture
def cache(tmp_path: Path) -> ContentCache:
    return ContentCache(str(tmp_path / "cache"), max_bytes=64 * 1024 * 1024)


def blobs(cache: ContentCache) -> list[str]:
    return sorted(
        name for _, _, names in os.walk(os.path.join(cache.root, "blobs")) for name in names
    )


def test_second_run_with_the_same_dataset_downloads_nothing(s3, cache, tmp_path):
    # given a dataset of two files, one in a subdirectory
    prefix = uuid.uuid4().hex
    train = s3.staged(f"{prefix}/train.txt", b"to be or not to be\n" * 100, "train.txt")
    labels = s3.staged(f"{prefix}/sub/labels.csv", b"a,b\n1,2\n", "sub/labels.csv")
    dataset = DatasetMount(dataset_id="d1", name="corpus", files=(train, labels))
    stage_root = str(tmp_path / "stage")

    # when a first run stages it: both files are downloaded and laid out read-only
    first = run_entry(datasets=(dataset,))
    staged = stage_run(first, cache=cache, stage_root=stage_root)
    assert staged.downloaded == 2
    assert staged.seed_dir == ""
    corpus = Path(staged.data_dir) / "corpus"
    assert (corpus / "train.txt").read_bytes() == b"to be or not to be\n" * 100
    assert (corpus / "sub" / "labels.csv").read_bytes() == b"a,b\n1,2\n"
    assert stat.S_IMODE((corpus / "train.txt").stat().st_mode) == 0o444
    assert stat.S_IMODE(corpus.stat().st_mode) == 0o555
    assert stat.S_IMODE((corpus / "sub").stat().st_mode) == 0o555
    assert blobs(cache) == sorted([train.sha256, labels.sha256])

    # and when the objects are gone from the store, a second run on the node still stages
    # them: from the cache, without a request
    s3.client.delete_object(Bucket="agent-tests", Key=f"{prefix}/train.txt")
    s3.client.delete_object(Bucket="agent-tests", Key=f"{prefix}/sub/labels.csv")
    second = run_entry(datasets=(dataset,))
    again = stage_run(second, cache=cache, stage_root=stage_root)
    assert again.downloaded == 0
    assert (Path(again.data_dir) / "corpus" / "train.txt").read_bytes() == train_bytes(train)

    # and a third with a file that is not cached fails on the store's 404
    missing = dataclasses.replace(train, sha256=hashlib.sha256(b"other").hexdigest())
    with pytest.raises(StagingError, match="answered 404"):
        stage_run(
            run_entry(datasets=(DatasetMount(dataset_id="d2", name="x", files=(missing,)),)),
            cache=cache,
            stage_root=stage_root,
        )


def train_bytes(_: StagedFile) -> bytes:
    return b"to be or not to be\n" * 100


def test_a_sha256_that_does_not_match_is_refused_and_nothing_is_kept(s3, cache, tmp_path):
    # given a file whose announced sha256 is another content's
    good = s3.staged(f"{uuid.uuid4().hex}/data.bin", b"\x00\x01" * 5000)
    bad = dataclasses.replace(good, sha256=hashlib.sha256(b"something else").hexdigest())
    entry = run_entry(datasets=(DatasetMount(dataset_id="d", name="set", files=(bad,)),))
    # when it is staged, then the start fails naming the file, and nothing stays behind
    with pytest.raises(StagingError, match=r"dataset 'set' file 'data.bin': sha256 mismatch"):
        stage_run(entry, cache=cache, stage_root=str(tmp_path / "stage"))
    assert blobs(cache) == []
    assert os.listdir(os.path.join(cache.root, "tmp")) == []
    assert not (tmp_path / "stage" / entry.run_id).exists()


def test_more_bytes_than_announced_are_refused(s3, cache, tmp_path):
    good = s3.staged(f"{uuid.uuid4().hex}/big.bin", b"x" * 10_000)
    short = dataclasses.replace(good, size_bytes=4000)
    entry = run_entry(resume_files=(short,))
    with pytest.raises(StagingError, match="more than the announced 4000 bytes"):
        stage_run(entry, cache=cache, stage_root=str(tmp_path / "stage"))
    assert blobs(cache) == []


@pytest.mark.parametrize(
    "path",
    ["../escape.txt", "a/../../escape.txt", "/etc/passwd", "a//b", "./a", "a\x00b", "a\\..\\b"],
)
def test_unsafe_paths_are_refused_before_any_download(s3, cache, tmp_path, path):
    # given a file with an unsafe path (and a URL that would work)
    good = s3.staged(f"{uuid.uuid4().hex}/f.txt", b"hello")
    unsafe = dataclasses.replace(good, path=path)
    for entry in (
        run_entry(datasets=(DatasetMount(dataset_id="d", name="set", files=(unsafe,)),)),
        run_entry(resume_files=(unsafe,)),
    ):
        # when it is staged, then it is refused and nothing was fetched
        with pytest.raises(StagingError, match="path"):
            stage_run(entry, cache=cache, stage_root=str(tmp_path / "stage"))
    assert blobs(cache) == []
    assert not (tmp_path / "stage").exists() or os.listdir(tmp_path / "stage") == []


@pytest.mark.parametrize("name", ["..", "a/b", "", ".hidden"])
def test_unsafe_dataset_names_are_refused(s3, cache, tmp_path, name):
    good = s3.staged(f"{uuid.uuid4().hex}/f.txt", b"hello")
    entry = run_entry(datasets=(DatasetMount(dataset_id="d", name=name, files=(good,)),))
    with pytest.raises(StagingError, match="dataset name"):
        stage_run(entry, cache=cache, stage_root=str(tmp_path / "stage"))
    assert blobs(cache) == []


def test_an_expired_url_fails_with_the_store_s_answer(s3, cache, tmp_path):
    good = s3.staged(f"{uuid.uuid4().hex}/f.txt", b"hello")
    tampered = dataclasses.replace(
        good, url=good.url.replace("X-Amz-Signature=", "X-Amz-Signature=0")
    )
    with pytest.raises(StagingError, match="answered 403"):
        stage_run(run_entry(resume_files=(tampered,)), cache=cache, stage_root=str(tmp_path / "s"))


def test_least_recently_used_blobs_are_evicted_past_the_cap(s3, tmp_path):
    # given a cache of 25 KB holding two 10 KB blobs, the first used again last
    cache = ContentCache(str(tmp_path / "cache"), max_bytes=25_000)
    prefix = uuid.uuid4().hex
    a = s3.staged(f"{prefix}/a", b"a" * 10_000)
    b = s3.staged(f"{prefix}/b", b"b" * 10_000)
    c = s3.staged(f"{prefix}/c", b"c" * 10_000)
    cache.get(a, what="a")
    cache.get(b, what="b")
    os.utime(cache.blob_path(b.sha256), (1, 1))  # b: used long ago
    # when a third one comes in, then b goes and a stays
    path, hit = cache.get(c, what="c")
    assert hit is False and Path(path).read_bytes() == b"c" * 10_000
    assert blobs(cache) == sorted([a.sha256, c.sha256])
    assert cache.get(a, what="a")[1] is True
    # and a file larger than the whole cache is refused
    huge = dataclasses.replace(c, size_bytes=30_000)
    with pytest.raises(StagingError, match="exceed the node's cache"):
        ContentCache(str(tmp_path / "other"), max_bytes=25_000).get(huge, what="huge")


def test_resume_files_are_seeded_into_the_workspace_owned_by_the_run_user(s3, cache, tmp_path):
    # given a run resuming from a checkpoint under checkpoints/
    ckpt = s3.staged(
        f"{uuid.uuid4().hex}/step_000000010.pt", b"weights", "checkpoints/step_000000010.pt"
    )
    entry = run_entry(resume_files=(ckpt,))
    staged = stage_run(entry, cache=cache, stage_root=str(tmp_path / "stage"))
    assert staged.data_dir == ""
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    (workspace / "kept.txt").write_text("mine")
    owner = (1000, 1000) if os.geteuid() == 0 else None
    # when the workspace is seeded, then the checkpoint is there, the run's own, writable dir
    assert workspace_seed(staged.seed_dir, str(workspace), owner=owner) == 1
    placed = workspace / "checkpoints" / "step_000000010.pt"
    assert placed.read_bytes() == b"weights"
    if owner is not None:
        assert (placed.stat().st_uid, placed.stat().st_gid) == owner
        assert (workspace / "checkpoints").stat().st_uid == 1000
    assert (workspace / "kept.txt").read_text() == "mine"
    # and seeding again (a restarted run) overwrites nothing the run wrote since
    placed.chmod(0o644)
    placed.write_bytes(b"newer")
    assert workspace_seed(staged.seed_dir, str(workspace), owner=owner) == 0
    assert placed.read_bytes() == b"newer"
    # and a link the run left where a directory goes is refused, not followed
    other = tmp_path / "other"
    other.mkdir()
    workspace2 = tmp_path / "workspace2"
    workspace2.mkdir()
    (workspace2 / "checkpoints").symlink_to(other)
    with pytest.raises(StagingError, match="not a directory"):
        workspace_seed(staged.seed_dir, str(workspace2), owner=owner)
    assert os.listdir(other) == []
    stage_dir_remove(str(tmp_path / "stage" / entry.run_id))
    assert not (tmp_path / "stage" / entry.run_id).exists()
