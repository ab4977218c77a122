"""The agent end to end with staging and artifact sync: the real CLI and LocalProcessDriver, a
fake agent API (tests/nodeagent/test_agent_process.py) presigning against a real S3 server."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import textwrap
import uuid

import pytest

from agentprotocol import ARTIFACT_COMMIT_PATH, HEARTBEAT_PATH, DatasetMount
from tests.nodeagent import test_agent_process as process
from tests.nodeagent.s3 import ArtifactApi
from tests.nodeagent.test_agent_process import desired_entry

# The process tests' fixtures, used here as they are.
agent_loop, dirs, driver, server = process.agent_loop, process.dirs, process.driver, process.server

pytestmark = pytest.mark.s3

# Reads its dataset and the checkpoint it resumes from, tries to write into the dataset,
# then checkpoints, writes a result and exits 0.
SCRIPT = textwrap.dedent(
    """
    import json, os, pathlib
    data = pathlib.Path(os.environ["GPUMARKET_DATA_DIR"]) / "corpus"
    text = (data / "train.txt").read_text()
    resumed = pathlib.Path("checkpoints/step_000000007.pt").read_bytes().decode()
    try:
        (data / "mine.txt").write_text("x")
        writable = True
    except OSError:
        writable = False
    line = {"event": "staged", "text": text, "resumed": resumed, "writable": writable}
    print(json.dumps(line), flush=True)
    pathlib.Path("checkpoints/step_000000008.pt").write_bytes(b"eight")
    print(json.dumps({"event": "checkpoint", "step": 8}), flush=True)
    import time; time.sleep(2)  # the result is written after the checkpoint's sync, mostly
    pathlib.Path("result.txt").write_text("done")
    """
)


def test_a_run_reads_its_dataset_resumes_and_is_synced_before_its_exit_is_reported(
    s3, server, agent_loop, driver, dirs
):
    # given a run with a dataset, a checkpoint to resume from, and artifact sync
    prefix = uuid.uuid4().hex
    train = s3.staged(f"{prefix}/train.txt", b"hello corpus", "train.txt")
    resume = s3.staged(f"{prefix}/ckpt", b"seven", "checkpoints/step_000000007.pt")
    rental_id = str(uuid.uuid4())
    entry = desired_entry(
        rental_id,
        script=SCRIPT,
        datasets=(DatasetMount(dataset_id="d1", name="corpus", files=(train,)),),
        resume_files=(resume,),
        sync_artifacts=True,
    )
    server.desired = [entry]
    api = ArtifactApi(s3=s3, rental_id=rental_id).install(server.fake)

    def exit_reported() -> bool:
        reports = [c for hb in server.heartbeats() for c in hb["containers"]]
        return any(c["status"] == "exited" for c in reports)

    # when the agent runs it to its end
    status, stderr = agent_loop(exit_reported)
    assert status == 0, stderr

    # then it read the dataset and the resume checkpoint, and could not write the dataset
    lines = [json.loads(m["line"]) for hb in server.heartbeats() for m in hb["metrics"]]
    staged = next(line for line in lines if line["event"] == "staged")
    assert staged == {
        "event": "staged",
        "text": "hello corpus",
        "resumed": "seven",
        "writable": False,
    }
    # and all its output was committed before its exit was reported (by the sync at its
    # checkpoint line, or by the final one after it exited: whichever found the files first)
    assert api.stored["result.txt"] == hashlib.sha256(b"done").hexdigest()
    assert api.stored["checkpoints/step_000000008.pt"] == hashlib.sha256(b"eight").hexdigest()
    assert s3.get(api.key("checkpoints/step_000000008.pt")) == b"eight"
    paths = [r.path for r in server.fake.requests]
    commit_path = ARTIFACT_COMMIT_PATH.format(rental_id=rental_id)
    last_commit = max(i for i, path in enumerate(paths) if path == commit_path)
    first_exit = min(
        i
        for i, r in enumerate(server.fake.requests)
        if r.path == HEARTBEAT_PATH and any(c["status"] == "exited" for c in r.body["containers"])
    )
    assert last_commit < first_exit
    # and the resume checkpoint it started from is stored too (the server already had it: a
    # real one answers `skip`; here it is simply uploaded)
    assert api.stored["checkpoints/step_000000007.pt"] == resume.sha256


def test_a_run_whose_dataset_fails_its_check_is_reported_and_never_started(
    s3, server, agent_loop, driver
):
    # given a run whose dataset file does not hash to what the server announced
    good = s3.staged(f"{uuid.uuid4().hex}/train.txt", b"real bytes", "train.txt")
    bad = dataclasses.replace(good, sha256=hashlib.sha256(b"other bytes").hexdigest())
    entry = desired_entry(
        str(uuid.uuid4()),
        datasets=(DatasetMount(dataset_id="d1", name="corpus", files=(bad,)),),
    )
    server.desired = [entry]

    def missing_reported() -> bool:
        reports = [c for hb in server.heartbeats() for c in hb["containers"]]
        return any(c["status"] == "missing" for c in reports)

    # when the agent tries to start it
    status, stderr = agent_loop(missing_reported)
    assert status == 0, stderr
    # then the server hears why, the run never started, and no usage was reported
    report = next(
        c for hb in server.heartbeats() for c in hb["containers"] if c["status"] == "missing"
    )
    assert report["run_id"] == entry.run_id
    assert "dataset 'corpus' file 'train.txt': sha256 mismatch" in report["error"]
    assert driver.list_managed() == []
    assert [u for hb in server.heartbeats() for u in hb["usage"]] == []
