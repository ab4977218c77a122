"""End to end: a dataset in, checkpoints out, and an interruptible rental that resumes on
another host from its last synced checkpoint.

The real stack: the live server and a Celery worker on the test database, SeaweedFS as object
storage (the `object_store` fixture), two node agents (simulated GPUs, the Docker runtime,
the harness image) joined as two hosts. The customer uploads a text dataset through the API and
the presigned URLs it answers, and rents an interruptible GPU training a small GPT on it. Once a
checkpoint is synced, the host running it dies (its agent SIGKILLed, its container gone) and is
marked silent: the rental is requeued, lands on the other host, which stages the dataset and the
checkpoint, and the harness continues from that step. It completes, and `gpumarket artifacts
pull` downloads the final checkpoint, which torch.load opens.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
from decimal import Decimal
from pathlib import Path

import pytest
import requests
from django.test import override_settings

from marketplace.models import Node, NodeStatus, Rental, RentalStatus
from provisioning.models import RunMetric
from provisioning.services import join_token_create, nodes_mark_silent
from storage.models import Artifact
from tests.e2e.conftest import (
    HARNESS_IMAGE,
    ROOT,
    AgentProcess,
    credit_customer,
    managed_containers,
    remove_managed,
    wait_for,
)

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

# Long enough that the host dies mid-run, whatever the machine's speed: a run that reached its
# last step before the kill would resume with nothing left to do. The steps are made heavy
# enough for that (about 18 ms each on one core here, 27 s in all; a first checkpoint is synced
# within a few seconds): with a 1-layer, 32-wide model 1,500 steps took 3.5 s, and a run once
# ended before its first sync was seen.
STEPS = 1500
CHECKPOINT_EVERY = 50
CONFIG = {
    "model": {"name": "gpt", "layers": 2, "width": 128, "heads": 4},
    "data": {"name": "text", "batch_size": 16, "seq_len": 32, "path": "corpus"},
    "train": {"steps": STEPS, "log_every": 25, "device": "cpu"},
    "checkpoint": {"every_steps": CHECKPOINT_EVERY, "keep": 2},
}
CHECKPOINT = re.compile(r"^checkpoints/step_(\d+)\.pt$")


@pytest.fixture(autouse=True)
def _funded_customer(settings, user):
    settings.BILLING_FUNDS_CHECK = True
    credit_customer(user)


@pytest.fixture(autouse=True)
def _no_leftover_containers(docker_client):
    yield
    remove_managed(docker_client)


@pytest.fixture
def two_hosts(object_store, live_server, provider, stack_env, tmp_path):
    """Two agents, each joined with its own token as its own host."""
    agents = {}
    for name in ("host-a", "host-b"):
        _, token = join_token_create(
            provider=provider, created_by=provider.owner, region="e2e",
            price_per_gpu_hour=Decimal("0.60"), min_bid_per_gpu_hour=Decimal("0.20"),
        )  # fmt: skip
        state = tmp_path / name
        state.mkdir()
        agents[name] = AgentProcess(
            server=live_server.url, join_token=token, state=state, runtime="docker", env=stack_env
        ).start()
    try:
        wait_for(
            lambda: Node.objects.filter(region="e2e", status=NodeStatus.ONLINE).count() == 2,
            120,
            "both hosts to join",
        )
        yield agents
    finally:
        for agent in agents.values():
            agent.stop()


def _upload_dataset(auth_api, name: str, files: dict[str, bytes]) -> str:
    """The customer's upload: ask where, PUT the bytes to the presigned URLs, complete."""
    body = {
        "name": name,
        "files": [
            {"path": path, "size_bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
            for path, data in files.items()
        ],
    }
    r = auth_api.post("/api/v1/datasets/", body, format="json")
    assert r.status_code == 201, r.content
    answer = r.json()
    for upload in answer["uploads"]:
        assert upload["url"], "small files go up in one PUT"
        put = requests.put(upload["url"], data=files[upload["path"]], timeout=30)
        assert put.status_code == 200, put.text
    dataset_id = answer["dataset"]["id"]
    r = auth_api.post(f"/api/v1/datasets/{dataset_id}/complete/", {}, format="json")
    assert r.status_code == 200, r.content
    assert r.json()["status"] == "ready"
    return dataset_id


def _synced_steps(rental_id: str) -> list[int]:
    paths = Artifact.objects.filter(rental_id=rental_id).values_list("path", flat=True)
    return sorted(int(m.group(1)) for p in paths if (m := CHECKPOINT.match(p)))


def _node_of(rental_id: str) -> Node | None:
    rental = Rental.objects.get(pk=rental_id)
    allocation = rental.allocations.filter(released_at__isnull=True).first()
    return allocation.node if allocation else None


def test_an_interruptible_rental_resumes_on_another_host_from_its_synced_checkpoint(
    auth_api, user, celery_worker, two_hosts, docker_client, live_server, tmp_path
):
    # given a dataset of the customer's: public-domain-like text, enough for a small GPT
    corpus = b"We hold these truths to be self-evident, that all men are created equal. " * 60
    _upload_dataset(auth_api, "corpus", {"train.txt": corpus})

    # when an interruptible rental trains on it
    r = auth_api.post(
        "/api/v1/rentals/",
        {
            "gpus_per_node": 1, "region": "e2e", "duration_s": 3600,
            "kind": "interruptible", "bid_per_gpu_hour": "0.50",
            "datasets": ["corpus"], "network": "internal",  # an engine without iptables
            "runtime": {"image": HARNESS_IMAGE, "harness_config": CONFIG},
        },
        format="json",
    )  # fmt: skip
    assert r.status_code == 201, r.content
    rental_id = r.json()["id"]
    wait_for(
        lambda: Rental.objects.get(pk=rental_id).status == RentalStatus.RUNNING, 180, "running"
    )
    first = _node_of(rental_id)
    assert first is not None

    # then a checkpoint is synced while it runs
    wait_for(lambda: _synced_steps(rental_id), 240, "a synced checkpoint")
    # and the first placement read the dataset (the harness started on the text, from step 0)
    start = RunMetric.objects.filter(rental_id=rental_id, event="start").order_by("pk").first()
    assert start is not None and start.data["start_step"] == 0

    # when its host dies: the agent is killed, the container goes with it, the node is silent
    host = next(name for name, agent in two_hosts.items() if f"e2e-{name}" == first.hostname)
    two_hosts[host].kill()
    remove_managed(docker_client, rental_id)
    synced = _synced_steps(rental_id)
    assert synced and 0 < max(synced) < STEPS
    silence = {"NODE_SILENCE_TIMEOUT_S": 2, "HEARTBEAT_INTERVAL_S": 1}
    with override_settings(GPUMARKET={**_gpumarket_settings(), **silence}):
        wait_for(lambda: first.pk in nodes_mark_silent(), 30, "the dead host to be marked silent")
    assert Node.objects.get(pk=first.pk).status == NodeStatus.OFFLINE
    assert Rental.objects.get(pk=rental_id).status == RentalStatus.PENDING
    # (no beat runs here: the requeue itself asks for a cycle)

    # then the rental is requeued onto the other host and resumes from the synced checkpoint
    wait_for(
        lambda: (node := _node_of(rental_id)) is not None and node.pk != first.pk,
        180,
        "the rental to be placed on the other host",
    )
    resumed = wait_for(
        lambda: (
            RunMetric.objects.filter(rental_id=rental_id, event="start")
            .exclude(run_id=start.run_id)
            .first()
        ),
        240,
        "the second placement to start",
    )
    assert STEPS > resumed.data["start_step"] >= max(synced) > 0
    assert resumed.data["resumed_from"].endswith(f"step_{resumed.data['start_step']:09d}.pt")

    # and it completes, its final checkpoint synced
    try:
        wait_for(
            lambda: Rental.objects.get(pk=rental_id).status == RentalStatus.COMPLETED,
            600,
            "the rental to complete",
        )
    except AssertionError:
        rental = Rental.objects.get(pk=rental_id)
        events = list(
            RunMetric.objects.filter(rental_id=rental_id).values_list("run_id", "event", "step")
        )
        raise AssertionError(f"{rental.status} {rental.status_reason}: {events}") from None
    # the second placement continued from the checkpoint, not from 0: its summary counts only
    # the steps after it, and its step events start after it
    events = list(
        RunMetric.objects.filter(rental_id=rental_id).values_list("run_id", "event", "step")
    )
    summary = RunMetric.objects.filter(
        rental_id=rental_id, run_id=resumed.run_id, event="summary"
    ).first()
    assert summary is not None, events
    assert summary.data["steps"] == STEPS
    assert summary.data["steps_this_run"] == STEPS - resumed.data["start_step"] < STEPS
    steps_after = [step for run, event, step in events if run == resumed.run_id and event == "step"]
    assert steps_after and min(steps_after) > resumed.data["start_step"], events
    assert max(_synced_steps(rental_id)) == STEPS

    # and `gpumarket artifacts pull` downloads it, and torch.load opens it
    from accounts.services.tokens import api_token_create
    from tests.factories import personal_team

    _, token = api_token_create(user=user, team=personal_team(user), name="cli")
    dest = tmp_path / "pulled"
    pulled = subprocess.run(
        [
            str(Path(sys.executable).parent / "gpumarket"), "--server", live_server.url,
            "--token", token, "artifacts", "pull", rental_id, str(dest),
        ],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
        env={
            **{k: v for k, v in os.environ.items() if not k.startswith("GPUMARKET_")},
            "PYTHONPATH": str(ROOT),  # this checkout's CLI, whatever the virtualenv installed
        },
    )  # fmt: skip
    assert pulled.returncode == 0, pulled.stderr
    final = dest / "checkpoints" / f"step_{STEPS:09d}.pt"
    assert final.exists(), sorted(str(p) for p in dest.rglob("*"))
    import torch

    state = torch.load(final, map_location="cpu", weights_only=True)
    assert state["step"] == STEPS
    wait_for(lambda: not managed_containers(docker_client, rental_id), 60, "container removal")


def _gpumarket_settings() -> dict:
    from django.conf import settings

    return dict(settings.GPUMARKET)
