"""Artifact sync, dataset staging and resume as the agent sees them, against a real SeaweedFS:
the agent endpoints (who may sync, what is refused, what is recorded), the desired state's
datasets and resume_files, the customer's artifact API, and retention."""

from __future__ import annotations

import hashlib
from datetime import timedelta
from decimal import Decimal

import pytest
import requests
from django.utils import timezone
from rest_framework.test import APIClient

from accounts.services import api_token_create, team_create
from agentprotocol import (
    ARTIFACT_COMMIT_PATH,
    ARTIFACT_UPLOADS_PATH,
    HEARTBEAT_PATH,
    ArtifactCommit,
    ArtifactCommitAnswer,
    ArtifactFile,
    ArtifactUploadAnswer,
    ArtifactUploadRequest,
    CommittedFile,
    HeartbeatAnswer,
)
from core.errors import ValidationFailed
from marketplace.lifecycle import rental_cancel, rental_stop
from marketplace.models import Node, Rental, RentalStatus
from marketplace.services.rentals import RentalRequest, RuntimeSpec, rental_create
from provisioning.services import nodes_mark_silent
from scheduler.services import scheduler_cycle_run
from storage import objectstore
from storage import services as storage
from storage.models import Artifact
from tests.factories import UserFactory, personal_team

pytestmark = pytest.mark.django_db

MIB = 1 << 20
HOST = {"cpu_cores": 32, "ram_gb": 256, "disk_gb": 2000}


@pytest.fixture
def join_agent(make_join_token):
    """join(hostname) -> an APIClient holding that new node's token (`.node` is the node)."""

    def join(hostname: str) -> APIClient:
        raw = make_join_token()
        gpus = [
            {"index": i, "uuid": f"GPU-{hostname}-{i}", "name": "NVIDIA A100-SXM4-80GB",
             "memory_mb": 81920, "topology_group": "nvl0"}
            for i in range(2)
        ]  # fmt: skip
        r = APIClient().post(
            "/api/agent/v1/join/",
            {
                "join_token": raw,
                "hostname": hostname,
                "host": HOST,
                "internet_filtered": True,
                "gpus": gpus,
            },
            format="json",
        )
        assert r.status_code == 201, r.content
        client = APIClient()
        client.credentials(HTTP_AUTHORIZATION=f"Bearer {r.json()['node_token']}")
        client.node = Node.objects.get(pk=r.json()["node_id"])
        return client

    return join


@pytest.fixture
def small_parts(settings):
    settings.STORAGE = {
        **settings.STORAGE,
        "MULTIPART_THRESHOLD_BYTES": 5 * MIB,
        "MULTIPART_PART_BYTES": 5 * MIB,
    }


def _beat(agent, **body) -> HeartbeatAnswer:
    r = agent.post(HEARTBEAT_PATH, body, format="json")
    assert r.status_code == 200, r.content
    return HeartbeatAnswer.from_payload(r.json())


def _placed(rent, agent, **kwargs):
    """A rental placed on the agent's node and handed to it: (rental, its desired run)."""
    rental = rent(1, **kwargs)
    scheduler_cycle_run()
    rental.refresh_from_db()
    assert rental.status == RentalStatus.SCHEDULED
    [run] = [d for d in _beat(agent).desired if d.rental_id == str(rental.pk)]
    return rental, run


def _file(path: str, data: bytes) -> ArtifactFile:
    return ArtifactFile(path=path, size_bytes=len(data), sha256=hashlib.sha256(data).hexdigest())


def _ask(agent, rental_id, run_id: str, files: list[ArtifactFile]):
    body = ArtifactUploadRequest(run_id=run_id, files=tuple(files)).to_payload()
    return agent.post(ARTIFACT_UPLOADS_PATH.format(rental_id=rental_id), body, format="json")


def _commit(agent, rental_id, run_id: str, files: list[CommittedFile], reason="checkpoint"):
    body = ArtifactCommit(run_id=run_id, files=tuple(files), reason=reason).to_payload()
    return agent.post(ARTIFACT_COMMIT_PATH.format(rental_id=rental_id), body, format="json")


def _sync(agent, rental_id, run_id: str, contents: dict[str, bytes]) -> ArtifactCommitAnswer:
    """What the agent does: ask, upload (single PUT or parts), commit."""
    files = [_file(p, d) for p, d in contents.items()]
    r = _ask(agent, rental_id, run_id, files)
    assert r.status_code == 200, r.content
    committed = []
    for upload, f in zip(ArtifactUploadAnswer.from_payload(r.json()).uploads, files, strict=True):
        assert upload.path == f.path
        data = contents[f.path]
        etags: list[str] = []
        if upload.url:
            assert requests.put(upload.url, data=data, timeout=30).status_code == 200
        for n, url in enumerate(upload.part_urls):
            size = upload.part_size_bytes
            answer = requests.put(url, data=data[n * size : (n + 1) * size], timeout=30)
            assert answer.status_code == 200
            etags.append(answer.headers["ETag"])
        committed.append(
            CommittedFile(
                path=f.path,
                size_bytes=f.size_bytes,
                sha256=f.sha256,
                upload_id=upload.upload_id,
                etags=tuple(etags),
            )
        )
    r = _commit(agent, rental_id, run_id, committed)
    assert r.status_code == 200, r.content
    return ArtifactCommitAnswer.from_payload(r.json())


def test_a_run_syncs_small_and_multipart_files_and_the_customer_downloads_them(
    join_agent, rent, user, auth_api, object_store, small_parts
):
    agent = join_agent("host-a")
    rental, run = _placed(rent, agent)
    assert run.sync_artifacts
    contents = {
        "checkpoints/step_000000010.pt": b"\x80" * (5 * MIB + 7),
        "metrics.jsonl": b'{"step": 10}\n',
    }
    # the uploads answer: one multipart, one single PUT
    answer = _ask(agent, rental.pk, run.run_id, [_file(p, d) for p, d in contents.items()])
    uploads = {u.path: u for u in ArtifactUploadAnswer.from_payload(answer.json()).uploads}
    assert uploads["checkpoints/step_000000010.pt"].upload_id
    assert len(uploads["checkpoints/step_000000010.pt"].part_urls) == 2
    assert uploads["metrics.jsonl"].url and not uploads["metrics.jsonl"].upload_id
    # when the agent syncs them
    result = _sync(agent, rental.pk, run.run_id, contents)
    assert (result.stored, dict(result.refused)) == (2, {})
    rows = {a.path: a for a in Artifact.objects.filter(rental=rental)}
    assert {p: (a.size_bytes, a.reason, a.run_id) for p, a in rows.items()} == {
        p: (len(d), "checkpoint", run.run_id) for p, d in contents.items()
    }
    # then asking again for the same files needs no upload
    again = _ask(agent, rental.pk, run.run_id, [_file(p, d) for p, d in contents.items()])
    assert all(
        u.skip and not u.url for u in ArtifactUploadAnswer.from_payload(again.json()).uploads
    )
    # and the customer lists and downloads them
    listed = auth_api.get(f"/api/v1/rentals/{rental.pk}/artifacts/").json()["results"]
    assert [a["path"] for a in listed] == sorted(contents)
    for item in listed:
        assert requests.get(item["download_url"], timeout=30).content == contents[item["path"]]
    redirect = auth_api.get(
        f"/api/v1/rentals/{rental.pk}/artifacts/download/", {"path": "metrics.jsonl"}
    )
    assert redirect.status_code == 302
    assert requests.get(redirect["Location"], timeout=30).content == contents["metrics.jsonl"]


def test_another_node_or_run_gets_404_and_nothing_is_recorded(join_agent, rent, object_store):
    agent_a, agent_b = join_agent("host-a"), join_agent("host-b")
    rental, run = _placed(rent, agent_a)
    files = [_file("out.txt", b"result")]
    committed = [CommittedFile(path="out.txt", size_bytes=6, sha256=files[0].sha256)]
    # the node that does not hold the rental, even with the right run id
    assert _ask(agent_b, rental.pk, run.run_id, files).status_code == 404
    assert _commit(agent_b, rental.pk, run.run_id, committed).status_code == 404
    # the right node with a run id that is not this rental's
    assert _ask(agent_a, rental.pk, "r-other-run", files).status_code == 404
    # a rental that does not exist
    other = "00000000-0000-4000-8000-000000000000"
    assert _ask(agent_a, other, run.run_id, files).status_code == 404
    # no node token at all
    assert APIClient().post(ARTIFACT_UPLOADS_PATH.format(rental_id=rental.pk)).status_code == 401
    assert not Artifact.objects.exists()


@pytest.mark.parametrize(
    "path",
    ["../escape.pt", "checkpoints/../../x", "/etc/passwd", "a//b", "./a", "nul\x00.pt", "a\\b"],
)
def test_a_bad_path_is_refused_whole_and_nothing_is_presigned_or_recorded(
    join_agent, rent, object_store, path
):
    agent = join_agent("host-a")
    rental, run = _placed(rent, agent)
    files = [_file("fine.txt", b"ok"), ArtifactFile(path=path, size_bytes=2, sha256="0" * 64)]
    r = _ask(agent, rental.pk, run.run_id, files)
    assert r.status_code == 400, r.content
    assert any(key.startswith("files") for key in r.json()), r.json()
    committed = [CommittedFile(path=path, size_bytes=2, sha256="0" * 64)]
    assert _commit(agent, rental.pk, run.run_id, committed).status_code == 400
    assert not Artifact.objects.exists()


def test_a_commit_that_does_not_check_out_is_refused_and_not_recorded(
    join_agent, rent, object_store, small_parts, bucket_keys
):
    agent = join_agent("host-a")
    rental, run = _placed(rent, agent)
    sha = "a" * 64
    # never uploaded
    missing = CommittedFile(path="never.pt", size_bytes=10, sha256=sha)
    # uploaded with fewer bytes than declared
    short = _file("short.txt", b"12345")
    [upload] = ArtifactUploadAnswer.from_payload(
        _ask(agent, rental.pk, run.run_id, [short]).json()
    ).uploads
    requests.put(upload.url, data=b"123", timeout=10)
    # a multipart upload committed with ETags that are not its parts'
    big = ArtifactFile(path="big.pt", size_bytes=6 * MIB, sha256=sha)
    [multi] = ArtifactUploadAnswer.from_payload(
        _ask(agent, rental.pk, run.run_id, [big]).json()
    ).uploads
    answer = _commit(
        agent,
        rental.pk,
        run.run_id,
        [
            missing,
            CommittedFile(path="short.txt", size_bytes=5, sha256=short.sha256),
            CommittedFile(
                path="big.pt", size_bytes=big.size_bytes, sha256=sha,
                upload_id=multi.upload_id, etags=('"0"', '"1"'),
            ),
        ],
    )  # fmt: skip
    assert answer.status_code == 200
    result = ArtifactCommitAnswer.from_payload(answer.json())
    assert result.stored == 0
    assert result.refused == {
        "never.pt": "no object was uploaded",
        "short.txt": "stored 3 bytes, declared 5",
        "big.pt": "the parts do not make up the upload",
    }
    assert not Artifact.objects.exists()
    assert bucket_keys(f"rentals/{rental.pk}/") == []


def test_a_stopped_run_may_sync_within_the_grace_period_only(
    join_agent, rent, object_store, settings
):
    agent = join_agent("host-a")
    rental, run = _placed(rent, agent)
    state = {"rental_id": str(rental.pk), "run_id": run.run_id}
    _beat(agent, containers=[{**state, "status": "running", "started_at": 1.0e9}])
    rental_stop(team=personal_team(rental.customer), actor=rental.customer, rental_id=rental.pk)
    _beat(agent, containers=[{**state, "status": "exited", "exit_code": 0}])
    rental.refresh_from_db()
    assert rental.status == RentalStatus.COMPLETED
    # the last checkpoint, written at the stop, still goes out
    assert _sync(agent, rental.pk, run.run_id, {"final.pt": b"weights"}).stored == 1
    settings.STORAGE = {**settings.STORAGE, "ARTIFACT_SYNC_GRACE_S": 0}
    assert _ask(agent, rental.pk, run.run_id, [_file("late.pt", b"x")]).status_code == 404


def test_a_rental_resumes_from_an_earlier_rentals_latest_checkpoint(
    join_agent, rent, user, auth_api, object_store
):
    agent = join_agent("host-a")
    first, run = _placed(rent, agent)
    checkpoints = {
        "checkpoints/step_000000010.pt": b"ten",
        "checkpoints/step_000000020.pt": b"twenty",
        "logs/train.log": b"log",
    }
    assert _sync(agent, first.pk, run.run_id, checkpoints).stored == 3
    rental_stop(team=personal_team(user), actor=user, rental_id=first.pk)
    # given a new rental created to resume from the first one
    second, second_run = _placed(rent, agent, resume_from=first.pk)
    assert second.resume_from_id == first.pk
    # then its run stages the latest checkpoint only, at the same relative path
    [staged] = second_run.resume_files
    assert (staged.path, staged.size_bytes) == ("checkpoints/step_000000020.pt", 6)
    assert staged.sha256 == hashlib.sha256(b"twenty").hexdigest()
    assert requests.get(staged.url, timeout=10).content == b"twenty"


def test_resume_from_another_accounts_rental_is_404_and_nothing_is_created(
    make_node, rent, object_store
):
    make_node(gpus=2)
    theirs = rent(1, customer=UserFactory())
    mine = UserFactory()
    client = APIClient()
    client.force_authenticate(mine)
    body = {
        "gpus_per_node": 1,
        "duration_s": 3600,
        "runtime": {"image": "gpumarket/harness:dev"},
        "resume_from": str(theirs.pk),
    }
    r = client.post("/api/v1/rentals/", body, format="json")
    assert r.status_code == 404
    assert not Rental.objects.filter(customer=mine).exists()


def test_a_requeued_interruptible_rental_resumes_from_its_own_checkpoint_on_another_node(
    join_agent, rent, object_store
):
    agent_a = join_agent("host-a")
    rental, run = _placed(rent, agent_a, kind="interruptible", bid_per_gpu_hour=Decimal("1.50"))
    assert run.resume_files == ()
    state = {"rental_id": str(rental.pk), "run_id": run.run_id}
    _beat(agent_a, containers=[{**state, "status": "running", "started_at": 1.0e9}])
    assert _sync(agent_a, rental.pk, run.run_id, {"checkpoints/step_000000005.pt": b"five"})
    # when host A goes silent, the rental is requeued and placed on host B
    agent_b = join_agent("host-b")
    nodes_mark_silent(now=timezone.now() + timedelta(hours=1))
    rental.refresh_from_db()
    assert rental.status == RentalStatus.PENDING
    _beat(agent_b)
    scheduler_cycle_run()
    [moved] = [d for d in _beat(agent_b).desired if d.rental_id == str(rental.pk)]
    # then B stages the checkpoint A synced
    assert moved.run_id != run.run_id
    [staged] = moved.resume_files
    assert staged.path == "checkpoints/step_000000005.pt"
    assert requests.get(staged.url, timeout=10).content == b"five"


def _ready_dataset(owner, name: str, contents: dict[str, bytes]):
    dataset, uploads = storage.dataset_upload_create(
        team=personal_team(owner),
        owner=owner,
        name=name,
        files=[
            storage.FileSpec(path=p, size_bytes=len(d), sha256=hashlib.sha256(d).hexdigest())
            for p, d in contents.items()
        ],
    )
    for upload in uploads:
        requests.put(upload.url, data=contents[upload.path], timeout=10)
    return storage.dataset_upload_complete(
        team=personal_team(owner), dataset_id=dataset.pk, parts={}
    )


def test_the_desired_run_stages_the_rentals_datasets_through_presigned_gets(
    join_agent, rent, user, object_store
):
    agent = join_agent("host-a")
    contents = {"train.csv": b"a,b\n1,2\n", "sub/test.csv": b"a,b\n3,4\n"}
    dataset = _ready_dataset(user, "tabular", contents)
    _, run = _placed(rent, agent, datasets=("tabular",))
    [mount] = run.datasets
    assert (mount.dataset_id, mount.name) == (str(dataset.pk), "tabular")
    assert sorted(f.path for f in mount.files) == sorted(contents)
    for f in mount.files:
        assert f.sha256 == hashlib.sha256(contents[f.path]).hexdigest()
        assert requests.get(f.url, timeout=10).content == contents[f.path]


def test_a_rental_naming_a_dataset_that_is_not_ready_or_not_the_customers_is_refused(
    make_node, user, object_store
):
    make_node(gpus=2)
    _ready_dataset(UserFactory(), "theirs", {"f": b"x"})
    storage.dataset_upload_create(
        team=personal_team(user),
        owner=user,
        name="half",
        files=[storage.FileSpec(path="f", size_bytes=1, sha256="0" * 64)],
    )
    for names, why in ((("theirs",), "no dataset named"), (("half",), "is uploading")):
        with pytest.raises(ValidationFailed) as refused:
            rental_create(
                customer=user,
                team=personal_team(user),
                request=RentalRequest(
                    gpus_per_node=1,
                    duration_s=3600,
                    runtime=RuntimeSpec(image="gpumarket/harness:dev"),
                    datasets=names,
                ),
            )
        assert refused.value.field == "datasets" and why in refused.value.message
    assert not Rental.objects.filter(customer=user).exists()


def test_a_member_rents_with_a_dataset_another_member_uploaded_and_other_teams_cannot(
    join_agent, rent, user, object_store
):
    # Given a team where one member uploaded a dataset
    from tests.accounts.test_teams import _join

    agent = join_agent("host-a")
    acme = team_create(owner=user, name="acme")
    colleague = UserFactory()
    _join(acme, user, colleague)
    contents = {"train.csv": b"a,b\n1,2\n"}
    dataset, uploads = storage.dataset_upload_create(
        team=acme,
        owner=user,
        name="shared",
        files=[
            storage.FileSpec(path=p, size_bytes=len(d), sha256=hashlib.sha256(d).hexdigest())
            for p, d in contents.items()
        ],
    )
    for upload in uploads:
        requests.put(upload.url, data=contents[upload.path], timeout=10)
    # And another member completes it: the dataset is the team's, not the uploader's
    storage.dataset_upload_complete(team=acme, dataset_id=dataset.pk, parts={})
    # When the other member rents for the team, naming it
    rental, run = _placed(rent, agent, customer=colleague, team=acme, datasets=("shared",))
    # Then the team's rental, created by the other member, reads it
    assert (rental.team, rental.customer) == (acme, colleague)
    [mount] = run.datasets
    assert (mount.dataset_id, mount.name) == (str(dataset.pk), "shared")
    assert requests.get(mount.files[0].url, timeout=10).content == contents["train.csv"]
    # And in the uploader's personal team (another team) the name is unknown, nothing stored
    before = Rental.objects.count()
    with pytest.raises(ValidationFailed) as refused:
        rent(customer=user, datasets=("shared",))
    assert refused.value.field == "datasets" and "no dataset named" in refused.value.message
    assert Rental.objects.count() == before
    # And the dataset's id is not found from there, listed and readable within acme
    mine = APIClient()
    mine.force_authenticate(user)
    assert mine.get(f"/api/v1/datasets/{dataset.pk}/").status_code == 404
    assert mine.get("/api/v1/datasets/").json()["results"] == []
    _, raw = api_token_create(user=colleague, team=acme, name="t")
    as_colleague = APIClient()
    as_colleague.credentials(HTTP_AUTHORIZATION=f"Bearer {raw}")
    [listed] = as_colleague.get("/api/v1/datasets/").json()["results"]
    assert (listed["id"], listed["uploaded_by"]) == (str(dataset.pk), user.username)


def test_another_accounts_artifacts_are_404(join_agent, rent, object_store):
    agent = join_agent("host-a")
    rental, run = _placed(rent, agent)
    _sync(agent, rental.pk, run.run_id, {"out.txt": b"private"})
    stranger = APIClient()
    stranger.force_authenticate(UserFactory())
    assert stranger.get(f"/api/v1/rentals/{rental.pk}/artifacts/").status_code == 404
    download = f"/api/v1/rentals/{rental.pk}/artifacts/download/"
    assert stranger.get(download, {"path": "out.txt"}).status_code == 404
    owner = APIClient()
    owner.force_authenticate(rental.customer)
    assert owner.get(download, {"path": "nope.txt"}).status_code == 404


def test_retention_deletes_the_artifacts_of_rentals_ended_long_enough_ago(
    rent, user, make_node, object_store, bucket_keys, settings
):
    settings.STORAGE = {**settings.STORAGE, "ARTIFACT_RETENTION_DAYS": 7}
    make_node(gpus=2)
    old, recent, running = rent(1), rent(1), rent(1)
    for rental in (old, recent, running):
        key = f"rentals/{rental.pk}/output/model.pt"
        requests.put(objectstore.presign_put(key), data=b"w", timeout=10)
        Artifact.objects.create(
            rental=rental, path="model.pt", size_bytes=1, sha256="0" * 64, run_id="r",
            synced_at=timezone.now(),
        )  # fmt: skip
    for rental in (old, recent):
        rental_cancel(team=personal_team(user), actor=user, rental_id=rental.pk)
    Rental.objects.filter(pk=old.pk).update(ended_at=timezone.now() - timedelta(days=8))
    Rental.objects.filter(pk=recent.pk).update(ended_at=timezone.now() - timedelta(days=6))
    # when the periodic task runs
    assert storage.artifacts_expire() == 1
    # then only the rental ended 8 days ago lost its artifacts, rows and objects
    assert set(Artifact.objects.values_list("rental_id", flat=True)) == {recent.pk, running.pk}
    assert bucket_keys(f"rentals/{old.pk}/") == []
    assert bucket_keys(f"rentals/{recent.pk}/") == [f"rentals/{recent.pk}/output/model.pt"]
    assert storage.artifacts_expire() == 0


def test_output_beyond_the_rentals_limit_is_refused_whole(join_agent, rent, object_store, settings):
    settings.STORAGE = {**settings.STORAGE, "ARTIFACT_MAX_BYTES_PER_RENTAL": 10}
    agent = join_agent("host-a")
    rental, run = _placed(rent, agent)
    assert _sync(agent, rental.pk, run.run_id, {"a.txt": b"123456"}).stored == 1
    r = _ask(agent, rental.pk, run.run_id, [_file("b.txt", b"12345")])
    assert r.status_code == 413 and r.json()["code"] == "quota_exceeded"
    # replacing a file counts its new size, not both
    assert _ask(agent, rental.pk, run.run_id, [_file("a.txt", b"1234567890")]).status_code == 200
    assert list(Artifact.objects.values_list("path", flat=True)) == ["a.txt"]


def test_without_object_storage_runs_are_not_asked_to_sync(join_agent, rent, settings):
    # Given a server with no object storage configured
    settings.S3_BUCKET = ""
    agent = join_agent("host-a")
    # Then a run's output stays on its node: the agent is not asked to sync what it cannot
    _, run = _placed(rent, agent)
    assert not run.sync_artifacts
