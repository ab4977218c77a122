"""Artifact sync against a real S3 server (SeaweedFS) through presigned URLs that a fake agent
API hands out (tests/nodeagent/s3.py): single and multipart uploads, what a restart resends."""

from __future__ import annotations

import hashlib
import os
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from nodeagent.artifacts import ArtifactSyncer, SyncError
from tests.nodeagent.s3 import ArtifactApi

pytestmark = pytest.mark.s3

TOKEN = "gpn_sync-token"


def wait_until(check: Callable[[], object], what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def syncer_for(fake_server, state: Path) -> ArtifactSyncer:
    return ArtifactSyncer(server_url=fake_server.url, state_dir=str(state), token=lambda: TOKEN)


@pytest.fixture
def rental_id() -> str:
    return str(uuid.uuid4())


@pytest.fixture
def api(s3, fake_server, rental_id) -> ArtifactApi:
    return ArtifactApi(s3=s3, rental_id=rental_id).install(fake_server)


def test_small_files_are_put_once_and_committed(s3, fake_server, api, rental_id, tmp_path):
    # given an output dir with a checkpoint, a log, a half-written temporary and a link
    out = tmp_path / "out"
    (out / "checkpoints").mkdir(parents=True)
    (out / "checkpoints" / "step_000000005.pt").write_bytes(b"ckpt-5" * 1000)
    (out / "train.log").write_text("step 5\n")
    (out / "checkpoints" / ".step_abc.tmp").write_bytes(b"partial")
    (out / "link").symlink_to("/etc/hostname")
    syncer = syncer_for(fake_server, tmp_path / "state")
    try:
        # when it is synced
        result = syncer.sync(
            run_id="run-1", rental_id=rental_id, output_dir=str(out), reason="checkpoint"
        )
        # then both files are in the bucket, byte for byte, and committed with the reason
        assert (result.committed, result.skipped, result.refused) == (2, 0, {})
        assert s3.get(api.key("checkpoints/step_000000005.pt")) == b"ckpt-5" * 1000
        assert s3.get(api.key("train.log")) == b"step 5\n"
        (commit,) = api.commits
        assert commit.reason == "checkpoint" and commit.run_id == "run-1"
        assert sorted(f.path for f in commit.files) == [
            "checkpoints/step_000000005.pt",
            "train.log",
        ]
        assert {f.path: f.sha256 for f in commit.files}["train.log"] == hashlib.sha256(
            b"step 5\n"
        ).hexdigest()
        (request,) = fake_server.requests[:1]
        assert request.headers["Authorization"] == f"Bearer {TOKEN}"

        # when nothing changed, a second sync asks for nothing
        again = syncer.sync(run_id="run-1", rental_id=rental_id, output_dir=str(out), reason="stop")
        assert again.committed == 0 and len(api.upload_requests) == 1
        # and when the log grows, only the log goes again
        with (out / "train.log").open("a") as f:
            f.write("step 6\n")
        os.utime(out / "train.log", ns=(1, 1))  # a distinct mtime whatever the clock's resolution
        third = syncer.sync(
            run_id="run-1", rental_id=rental_id, output_dir=str(out), reason="complete"
        )
        assert third.committed == 1
        assert [f.path for f in api.upload_requests[-1].files] == ["train.log"]
        assert s3.get(api.key("train.log")) == b"step 5\nstep 6\n"
        assert api.commits[-1].reason == "complete"
    finally:
        syncer.close()

    # when an agent that lost its record syncs the same files, the server has them all: nothing
    # is sent and nothing committed
    commits = len(api.commits)
    fresh = syncer_for(fake_server, tmp_path / "other-state")
    try:
        result = fresh.sync(run_id="run-1", rental_id=rental_id, output_dir=str(out), reason="stop")
    finally:
        fresh.close()
    assert (result.committed, result.skipped, result.uploaded_bytes) == (0, 2, 0)
    assert len(api.commits) == commits


def test_a_big_file_goes_in_parallel_parts_and_the_commit_carries_their_etags(
    s3, fake_server, api, rental_id, tmp_path
):
    # given a 12 MiB checkpoint (three parts of 5 MiB, the last shorter)
    out = tmp_path / "out"
    out.mkdir()
    data = os.urandom(12 * 1024 * 1024)
    (out / "model.pt").write_bytes(data)
    syncer = syncer_for(fake_server, tmp_path / "state")
    try:
        # when it is synced
        result = syncer.sync(
            run_id="run-2", rental_id=rental_id, output_dir=str(out), reason="complete"
        )
    finally:
        syncer.close()
    # then the multipart upload was completed with three ETags and the object is the file
    assert result.committed == 1 and result.uploaded_bytes == len(data)
    (committed,) = api.commits[0].files
    assert committed.upload_id and len(committed.etags) == 3 and all(committed.etags)
    assert hashlib.sha256(s3.get(api.key("model.pt"))).digest() == hashlib.sha256(data).digest()


def test_what_was_not_committed_is_synced_again_after_a_restart(
    s3, fake_server, api, rental_id, tmp_path
):
    # given a first file committed, then a second whose commit the server fails
    out = tmp_path / "out"
    out.mkdir()
    (out / "first.txt").write_text("one")
    state = tmp_path / "state"
    syncer = syncer_for(fake_server, state)
    syncer.sync(run_id="run-3", rental_id=rental_id, output_dir=str(out), reason="checkpoint")
    syncer.close()
    (out / "second.txt").write_text("two")
    api.fail_commit = 503
    syncer = syncer_for(fake_server, state)
    with pytest.raises(SyncError, match="commit failed") as failed:
        syncer.sync(run_id="run-3", rental_id=rental_id, output_dir=str(out), reason="checkpoint")
    assert failed.value.transient
    syncer.close()
    assert api.stored == {"first.txt": hashlib.sha256(b"one").hexdigest()}

    # when the agent starts again and syncs
    api.fail_commit = 0
    syncer = syncer_for(fake_server, state)
    try:
        result = syncer.sync(
            run_id="run-3", rental_id=rental_id, output_dir=str(out), reason="stop"
        )
    finally:
        syncer.close()
    # then only the file that was not committed is offered again, and now it is stored
    assert [f.path for f in api.upload_requests[-1].files] == ["second.txt"]
    assert result.committed == 1
    assert api.stored["second.txt"] == hashlib.sha256(b"two").hexdigest()
    assert s3.get(api.key("second.txt")) == b"two"


def test_the_background_thread_retries_a_final_sync_until_it_is_done(
    s3, fake_server, api, rental_id, tmp_path, monkeypatch
):
    import nodeagent.artifacts as artifacts

    monkeypatch.setattr(artifacts, "FINAL_RETRY_BASE_S", 0.1)
    monkeypatch.setattr(artifacts, "FINAL_RETRY_MAX_S", 0.2)
    out = tmp_path / "out"
    out.mkdir()
    (out / "final.pt").write_bytes(b"final")
    api.fail_commit = 502
    syncer = syncer_for(fake_server, tmp_path / "state")
    syncer.start()
    try:
        # given a final sync that first fails (the server answers 502)
        assert syncer.request(
            run_id="run-4", rental_id=rental_id, output_dir=str(out), reason="complete"
        )
        commit_path = f"/api/agent/v1/rentals/{rental_id}/artifacts/commit/"
        wait_until(lambda: len(fake_server.bodies(commit_path)) >= 2, "a retried commit")
        assert not syncer.final_done("run-4")
        # when the server recovers, then the retry commits it and the run's final sync is done
        api.fail_commit = 0
        wait_until(lambda: syncer.final_done("run-4"), "the final sync")
        assert api.stored == {"final.pt": hashlib.sha256(b"final").hexdigest()}
        # and a later checkpoint request never downgrades a waiting final one
        assert syncer.request(
            run_id="run-5", rental_id=rental_id, output_dir=str(out), reason="stop"
        )
        assert syncer.request(
            run_id="run-5", rental_id=rental_id, output_dir=str(out), reason="checkpoint"
        )
        wait_until(lambda: syncer.final_done("run-5"), "the second run's final sync")
    finally:
        syncer.close()
