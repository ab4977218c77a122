"""A gang's output is one result: its members' output directories are stored as one tree (the
checkpoint directory shared, each member's logs under its own prefix, nothing overwritten), and
a re-queued gang's members are each staged the whole of its last complete checkpoint."""

from __future__ import annotations

import hashlib

import pytest
import requests
from rest_framework.test import APIClient

from agentprotocol import ArtifactCommitAnswer, ArtifactUploadAnswer, CommittedFile
from provisioning.models import ContainerRun
from provisioning.services import nodes_mark_silent
from provisioning.services.gangs import member_output_path
from scheduler.services import scheduler_cycle_run
from storage.models import Artifact
from tests.provisioning.test_artifacts import _ask, _commit, _file
from tests.provisioning.test_gangs import _beat, _join, _report, _run, _running_gang, _silent

pytestmark = pytest.mark.django_db


@pytest.fixture
def members(api, make_join_token):
    """Two 2-GPU nodes of one provider in one cluster, by node id (node rank order)."""
    fabric = {"cluster": "gang", "interconnect": "ethernet", "interconnect_gbps": 25}
    agents = [_join(api, make_join_token(), "gang-a", **fabric)]
    agents.append(_join(api, make_join_token(), "gang-b", cluster="gang"))
    return sorted(agents, key=lambda agent: agent.node.pk)


def _part(base: str, step: str, ranks: range) -> dict[str, bytes]:
    return {f"{base}/__{r}_0.distcp": f"{r}{step}".encode() for r in ranks}


def _sync(agent: APIClient, rental_id, run_id: str, contents: dict[str, bytes]):
    """What the agent does with the paths the server takes: upload, then commit them all."""
    files = [_file(p, d) for p, d in contents.items()]
    r = _ask(agent, rental_id, run_id, files)
    assert r.status_code == 200, r.content
    uploads = ArtifactUploadAnswer.from_payload(r.json()).uploads
    for upload in uploads:
        if upload.url:
            put = requests.put(upload.url, data=contents[upload.path], timeout=30)
            assert put.status_code == 200
    committed = [
        CommittedFile(path=f.path, size_bytes=f.size_bytes, sha256=f.sha256) for f in files
    ]
    r = _commit(agent, rental_id, run_id, committed)
    assert r.status_code == 200, r.content
    return [u.path for u in uploads], ArtifactCommitAnswer.from_payload(r.json())


@pytest.mark.parametrize(
    ("path", "rank", "stored"),
    [
        ("checkpoints/step_000000010/__2_0.distcp", 1, "checkpoints/step_000000010/__2_0.distcp"),
        ("checkpoints/step_000000010.pt", 0, "checkpoints/step_000000010.pt"),
        ("final/model.pt", 0, "final/model.pt"),
        ("logs/harness.log", 0, "nodes/0/logs/harness.log"),
        ("logs/harness.log", 1, "nodes/1/logs/harness.log"),
        ("nodes/0/logs/harness.log", 0, "nodes/0/nodes/0/logs/harness.log"),
        ("final/model.pt", 1, "nodes/1/final/model.pt"),
    ],
)
def test_where_a_members_file_is_stored(path, rank, stored):
    assert member_output_path(path, rank) == stored


def test_the_members_output_is_one_result_and_none_overwrites_another(members, rent, object_store):
    # given a running 2 x 2 gang
    rental = _running_gang(members, rent)
    first, second = members
    runs = {r.node_rank: r.run_id for r in ContainerRun.objects.filter(rental=rental)}
    assert sorted(runs) == [0, 1]
    # when each member syncs its part of one sharded checkpoint and its log, same names
    step = "checkpoints/step_000000010"
    _, done = _sync(first, rental.pk, runs[0], {
        f"{step}/.metadata": b"meta", f"{step}/harness.pt": b"extra",
        f"{step}/__0_0.distcp": b"r0", f"{step}/__1_0.distcp": b"r1",
        "logs/harness.log": b"node 0 log",
    })  # fmt: skip
    assert (done.stored, done.refused) == (5, {})
    _, done = _sync(second, rental.pk, runs[1], {
        f"{step}/__2_0.distcp": b"r2", f"{step}/__3_0.distcp": b"r3",
        "logs/harness.log": b"node 1 log",
    })  # fmt: skip
    assert (done.stored, done.refused) == (3, {})
    # then the rental's output is one checkpoint and each node's log under its own prefix
    stored = dict(Artifact.objects.filter(rental=rental).values_list("path", "run_id"))
    assert sorted(stored) == [
        f"{step}/.metadata", f"{step}/__0_0.distcp", f"{step}/__1_0.distcp",
        f"{step}/__2_0.distcp", f"{step}/__3_0.distcp", f"{step}/harness.pt",
        "nodes/0/logs/harness.log", "nodes/1/logs/harness.log",
    ]  # fmt: skip
    assert stored["nodes/1/logs/harness.log"] == runs[1]
    body = object_store.get_object(
        Bucket=object_store.bucket, Key=f"rentals/{rental.pk}/output/nodes/1/logs/harness.log"
    )["Body"].read()
    assert body == b"node 1 log"
    # and a member that writes a file another member stored is refused: nothing is overwritten
    asked, done = _sync(second, rental.pk, runs[1], {f"{step}/.metadata": b"other"})
    assert asked == []
    assert done.stored == 0 and f"{step}/.metadata" in done.refused
    meta = Artifact.objects.get(rental=rental, path=f"{step}/.metadata")
    assert (meta.run_id, meta.sha256) == (runs[0], hashlib.sha256(b"meta").hexdigest())


def test_a_requeued_gang_stages_its_whole_last_complete_checkpoint_on_every_member(
    api, make_join_token, members, rent, object_store
):
    # given an interruptible gang that synced a whole sharded step 10, and of step 20 only
    # rank 0's node's part (the other node was lost before it synced its part)
    spare = _join(api, make_join_token(), "gang-c", cluster="gang")
    rental = _running_gang(members, rent, kind="interruptible", bid_per_gpu_hour="0.50")
    first, second = members
    runs = {r.node_rank: r.run_id for r in ContainerRun.objects.filter(rental=rental)}
    whole = {"step_000000010": (0, 1), "step_000000020": (0,)}
    for step, ranks in whole.items():
        base = f"checkpoints/{step}"
        whole_files = {f"{base}/.metadata": b"m", f"{base}/harness.pt": b"h"}
        _sync(first, rental.pk, runs[0], {**whole_files, **_part(base, step, range(2))})
        if 1 in ranks:
            _sync(second, rental.pk, runs[1], _part(base, step, range(2, 4)))
    # when the second node is lost, and the gang is placed again on the survivor and the spare
    _silent(second)
    nodes_mark_silent()
    scheduler_cycle_run()
    # then each new member is staged every file of step 10, the newest complete step
    for agent in (first, spare):
        desired = _run(agent, rental)
        staged = {f["path"]: f for f in desired.get("resume_files", [])}
        base = "checkpoints/step_000000010"
        assert sorted(staged) == [
            f"{base}/.metadata", f"{base}/__0_0.distcp", f"{base}/__1_0.distcp",
            f"{base}/__2_0.distcp", f"{base}/__3_0.distcp", f"{base}/harness.pt",
        ]  # fmt: skip
        shard = staged[f"{base}/__3_0.distcp"]
        assert requests.get(shard["url"], timeout=10).content == b"3step_000000010"
    _report(first, _run(first, rental), "running", started_at=2.0e9)
    assert _beat(first)["desired"][0]["env"]["NNODES"] == "2"
