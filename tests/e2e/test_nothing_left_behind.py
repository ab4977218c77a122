"""Nothing of a rental stays on the provider's host once it has ended and its output is synced.

The real stack pieces: the live server and a Celery worker on the test database, SeaweedFS as
object storage (`object_store`), a node agent on the Docker Engine with the harness image. The
customer's rental reads a dataset and writes output; after it ends the test lists the host's
paths (the agent's volume root: workspaces, quota images, stage dirs) and the engine's
containers, networks, volumes and images, and finds nothing of the rental, while its output is
in object storage and the dataset's blob stays in the node's content-addressed cache. A second
rental's agent is killed and its container removed behind its back: the restarted agent sweeps
the network and workspace the dead one left.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from marketplace.models import Node, NodeStatus, Rental, RentalStatus
from storage.models import Artifact
from tests.e2e.conftest import HARNESS_IMAGE, credit_customer, managed_containers, remove_managed
from tests.e2e.conftest import wait_for as wait
from tests.e2e.test_artifacts_resume import _upload_dataset

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

CORPUS = b"Nothing of a rental stays behind. " * 40


@pytest.fixture(autouse=True)
def _no_leftover_containers(docker_client):
    yield
    remove_managed(docker_client)


def _left_on_host(docker_client, volumes: Path, rental_id: str) -> dict[str, list[str]]:
    """Everything of `rental_id` the host still holds: paths and engine objects."""
    label = {"label": [f"gpumarket.rental={rental_id}"]}
    staging = volumes / ".staging"
    return {
        "paths": sorted(str(p) for p in volumes.glob(f"{rental_id}*")),
        "staging": sorted(os.listdir(staging)) if staging.is_dir() else [],
        "containers": [c.name for c in managed_containers(docker_client, rental_id)],
        "networks": [n.name for n in docker_client.networks.list(filters=label)],
        "volumes": [v.name for v in docker_client.volumes.list(filters=label)],
        "images": [i.id for i in docker_client.images.list(filters=label)],
        "mounts": [line for line in Path("/proc/mounts").read_text().splitlines()
                   if rental_id in line],
    }  # fmt: skip


NOTHING = {k: [] for k in ("paths", "staging", "containers", "networks", "volumes", "images",
                           "mounts")}  # fmt: skip


def _rent(auth_api, command: str) -> str:
    body = {
        "gpus_per_node": 1, "region": "e2e", "duration_s": 3600, "datasets": ["corpus"],
        "network": "internal",  # this host's engine cannot filter the internet
        "runtime": {"image": HARNESS_IMAGE, "command": ["sh", "-c", command]},
    }  # fmt: skip
    r = auth_api.post("/api/v1/rentals/", body, format="json")
    assert r.status_code == 201, r.content
    return r.json()["id"]


def test_a_rental_leaves_nothing_on_the_host_after_its_final_sync(
    auth_api, user, settings, object_store, celery_worker, start_agent, docker_client, tmp_path
):
    settings.BILLING_FUNDS_CHECK = True
    credit_customer(user)
    _upload_dataset(auth_api, "corpus", {"train.txt": CORPUS})
    agent = start_agent(runtime="docker")
    wait(lambda: Node.objects.filter(region="e2e", status=NodeStatus.ONLINE).exists(), 120,
         "the host to join")  # fmt: skip
    volumes = tmp_path / "node1" / "volumes"

    # given a rental that reads its dataset and writes its output into the workspace
    rental_id = _rent(auth_api, "cat /data/corpus/train.txt > /workspace/out.txt; sleep 2")
    wait(lambda: (volumes / rental_id).is_dir(), 180, "the workspace on the host")
    assert os.listdir(volumes / ".staging"), "the dataset is staged for the run"

    # when it completes
    wait(lambda: Rental.objects.get(pk=rental_id).status == RentalStatus.COMPLETED, 240,
         f"completion (agent log: {agent.log()[-2000:]})")  # fmt: skip

    # then its output reached object storage (the final sync ran before anything was deleted)
    artifact = Artifact.objects.get(rental_id=rental_id, path="out.txt")
    body = object_store.get_object(Bucket=object_store.bucket, Key=artifact.key)["Body"].read()
    assert body == CORPUS
    # and nothing of it is left on the host: no workspace, quota image, stage dir, mount,
    # container, network, volume or image
    wait(lambda: _left_on_host(docker_client, volumes, rental_id) == NOTHING, 60,
         "the host to forget the rental")  # fmt: skip
    # while the dataset's blob stays in the node's content-addressed cache
    digest = hashlib.sha256(CORPUS).hexdigest()
    cached = [p for p in (tmp_path / "node1" / "state").rglob("*") if digest in p.name]
    assert cached, "the cache keeps the dataset by its hash"

    # given a second rental whose agent dies while it runs, its container removed behind it
    # and the rental stopped meanwhile (so no run of it is wanted when the agent is back)
    second = _rent(auth_api, "echo out > /workspace/out.txt; sleep 3600")
    wait(lambda: Rental.objects.get(pk=second).status == RentalStatus.RUNNING, 180, "running")
    agent.kill()
    for container in managed_containers(docker_client, second):
        container.remove(force=True)
    assert auth_api.post(f"/api/v1/rentals/{second}/stop/").status_code == 200
    left = _left_on_host(docker_client, volumes, second)
    assert left["paths"] and left["networks"], left  # what the dead agent left
    # when the agent starts again (no container of the rental is left to remove: only its
    # start-up sweep can find the rest)
    agent.start()
    # then it sweeps what was left (the run's stage dir goes once the server no longer wants it)
    wait(lambda: _left_on_host(docker_client, volumes, second) == NOTHING, 60,
         f"the restarted agent to sweep (agent log: {agent.log()[-2000:]})")  # fmt: skip
    assert "workspace deleted" in agent.log().split("using the stored node token")[-1]
