"""End to end: a rental of an image that only a registry has. The real agent (Docker runtime)
pulls it from a real registry (Debian's docker-registry, behind a throttled link so that the
pull lasts a while), reports the pull's progress, and the server shows it while the rental
provisions; then the node reports the image among those it holds, and its image cache prunes it
once the rental has ended."""

from __future__ import annotations

import contextlib
import uuid

import docker
import pytest

from marketplace.models import Node, Rental, RentalStatus
from provisioning.models import ContainerRun
from tests.e2e.conftest import HARNESS_IMAGE, credit_customer, remove_managed, wait_for
from tests.nodeagent.registry import LocalRegistry, ThrottledProxy, build_image, push_only

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def registry(tmp_path, docker_client):
    root = tmp_path / "registry"
    root.mkdir()
    server = LocalRegistry(root).start()
    yield server
    server.stop()


def _present(client, ref: str) -> bool:
    try:
        client.images.get(ref)
    except docker.errors.ImageNotFound:
        return False
    return True


@pytest.fixture(autouse=True)
def _funded_customer(settings, user):
    settings.BILLING_FUNDS_CHECK = True
    credit_customer(user)


def test_the_pull_of_a_rentals_image_is_shown_while_it_provisions(
    auth_api, celery_worker, start_agent, stack_env, docker_client, registry
):
    # given an image of 3 x 24 MB of new layers over the harness image, in the registry only,
    # reached through a link of 6 MB/s
    tag = f"{registry.host}/img-e2e/train:{uuid.uuid4().hex[:10]}"
    build_image(docker_client, tag, base=HARNESS_IMAGE, layers_mb=(24, 24, 24))
    push_only(docker_client, tag)
    proxy = ThrottledProxy(registry.port, bytes_per_s=6 * 1024 * 1024)
    image = tag.replace(registry.host, proxy.host)
    # and an agent that accepts images of that registry, with an image cache of 1 MB
    stack_env["GPUMARKET_IMAGE_ALLOW"] = f"gpumarket/harness:*,{proxy.host}/img-e2e/*"
    stack_env["GPUMARKET_IMAGE_CACHE_GB"] = "0.001"
    agent = start_agent()
    node = wait_for(lambda: Node.objects.filter(region="e2e").first(), 90, "the agent to join")
    assert f"{proxy.host}/img-e2e/*" in node.image_allow
    try:
        # when a rental of that image is created
        r = auth_api.post(
            "/api/v1/rentals/",
            {
                "gpus_per_node": 1,
                "region": "e2e",
                "duration_s": 3600,
                "network": "internal",  # this host's engine cannot filter the internet
                "runtime": {
                    "image": image,
                    "command": ["python", "-c", "import time; time.sleep(600)"],
                },
            },
            format="json",
        )
        assert r.status_code == 201, r.content
        rental_id = r.json()["id"]
        # then while it provisions the server sees the pull go forward, and shows it
        seen: list[tuple[int, int]] = []
        shown: list[str] = []

        def running() -> bool:
            for progress in ContainerRun.objects.filter(rental_id=rental_id).values_list(
                "pull_progress", flat=True
            ):
                if progress and (progress["done_bytes"], progress["total_bytes"]) not in seen:
                    seen.append((progress["done_bytes"], progress["total_bytes"]))
            pull = auth_api.get(f"/api/v1/rentals/{rental_id}/").json()["pull_progress"]
            if pull and pull["text"] not in shown:
                shown.append(pull["text"])
            status = Rental.objects.values_list("status", flat=True).get(pk=rental_id)
            assert status not in (RentalStatus.FAILED, RentalStatus.CANCELLED), status
            return status == RentalStatus.RUNNING

        wait_for(running, 240, "the rental to run", every=0.2)
        assert any(0 < done < total for done, total in seen), seen
        assert any(text.startswith("pulling ") and text.endswith(" MB") for text in shown), shown
        # and once it runs nothing more is shown, and the node reports the image it now holds
        assert auth_api.get(f"/api/v1/rentals/{rental_id}/").json()["pull_progress"] is None
        wait_for(
            lambda: image in {i["ref"] for i in Node.objects.get(pk=node.pk).images},
            60,
            "the node to report the image it holds",
        )
        # and the cache, far over its budget, keeps the image while its container runs, and
        # prunes it (its pass runs every minute) once the rental has ended
        assert docker_client.images.get(image)
        assert auth_api.post(f"/api/v1/rentals/{rental_id}/stop/").status_code == 200
        wait_for(
            lambda: Rental.objects.get(pk=rental_id).status == RentalStatus.COMPLETED,
            240,
            "the rental to complete",
        )
        wait_for(lambda: not _present(docker_client, image), 150, "the image to be pruned")
        wait_for(
            lambda: image not in {i["ref"] for i in Node.objects.get(pk=node.pk).images},
            60,
            "the node to report the image gone",
        )
        assert docker_client.images.get(HARNESS_IMAGE)  # never the agent's to prune
    except AssertionError:
        print(agent.log()[-20000:])  # what the agent did, shown with the failure
        raise
    finally:
        remove_managed(docker_client)
        proxy.close()
        for ref in (image, tag):
            with contextlib.suppress(Exception):
                docker_client.images.remove(ref, force=True)
