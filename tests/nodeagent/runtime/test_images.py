"""The Docker driver's pulls and the node's image cache, on a real engine and a real registry
(Debian's docker-registry, tests/nodeagent/registry.py)."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from pathlib import Path

import docker
import pytest

from nodeagent.imagecache import ImageCache, prune_plan
from nodeagent.runtime.base import LABEL_MANAGED, LABEL_NODE, ImageNotFoundError
from nodeagent.runtime.docker import (
    DockerDriver,
    DockerDriverConfig,
    ImageTooLargeError,
    PullLayers,
)
from tests.nodeagent.registry import LocalRegistry, ThrottledProxy, build_image, push_only

pytestmark = pytest.mark.docker

REPO = "img-test"


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory, docker_host: str) -> Iterator[LocalRegistry]:
    server = LocalRegistry(tmp_path_factory.mktemp("registry")).start()
    yield server
    server.stop()


@pytest.fixture
def pushed(registry, docker_client, harness_image) -> Iterator[str]:
    """An image of three 16 MB layers over the harness image, in the registry only."""
    tag = f"{registry.host}/{REPO}/layers:{uuid.uuid4().hex[:10]}"
    build_image(docker_client, tag, base=harness_image, layers_mb=(16, 16, 16))
    push_only(docker_client, tag)
    yield tag
    _remove(docker_client, tag)


def _remove(client: docker.DockerClient, ref: str) -> None:
    with contextlib.suppress(docker.errors.NotFound):
        client.images.remove(ref, force=True)


def _driver(node_id: str, **options) -> DockerDriver:
    return DockerDriver(
        DockerDriverConfig(gpu_mode="none", node_id=node_id, image_allow=("*",), **options)
    )


def test_a_pull_reports_its_layers_bytes_as_they_come(registry, pushed, docker_client, node_id):
    # given an image that is only in the registry, pulled through a slow link
    proxy = ThrottledProxy(registry.port, bytes_per_s=8 * 1024 * 1024)
    slow = pushed.replace(registry.host, proxy.host)
    seen: list[tuple[int, int]] = []
    try:
        # when the driver pulls it
        _driver(node_id).pull(slow, progress=lambda done, total: seen.append((done, total)))
    finally:
        proxy.close()
        _remove(docker_client, slow)
    # then progress came while it was under way, never going back, and ended complete
    assert any(0 < done < total for done, total in seen), seen
    assert [done for done, _ in seen] == sorted(done for done, _ in seen)
    done, total = seen[-1]
    assert done == total >= 3 * 16 * 1024 * 1024  # the three new layers (gzip adds a little)


def test_a_pull_past_the_nodes_size_limit_is_refused_as_too_large(
    registry, pushed, docker_client, node_id
):
    # given a node that takes images up to 20 MB
    driver = _driver(node_id, max_image_bytes=20 * 1000 * 1000)
    # when a start pulls an image whose layers add up to 48 MB
    with pytest.raises(ImageTooLargeError) as refused:
        driver.pull(pushed)
    # then the reason says so (the customer's image, marketplace.lifecycle reads it so) and
    # the image is not on the node
    assert "is too large for this node" in str(refused.value)
    assert "at most 0.0 GB" in str(refused.value)
    with pytest.raises(docker.errors.ImageNotFound):
        docker_client.images.get(pushed)


def test_an_unpacked_image_past_the_limit_is_removed_and_refused(
    registry, pushed, docker_client, node_id, harness_image
):
    # given a limit its layers (about 48 MB to download) pass, and its unpacked size does not
    base = docker_client.images.get(harness_image).attrs["Size"]
    driver = _driver(node_id, max_image_bytes=base)
    with pytest.raises(ImageTooLargeError) as refused:
        driver.pull(pushed)
    assert "unpacked" in str(refused.value)
    with pytest.raises(docker.errors.ImageNotFound):
        docker_client.images.get(pushed)


def test_an_image_the_registry_does_not_have_is_not_found_at_once(registry, node_id):
    with pytest.raises(ImageNotFoundError) as missing:
        _driver(node_id).pull(f"{registry.host}/{REPO}/nothing:here")
    assert "no such image" in str(missing.value)


def test_layer_events_sum_to_what_is_downloaded():
    layers = PullLayers()
    events = [
        {"status": "Pulling from img-test/layers", "id": "t1"},
        {"status": "Pulling fs layer", "id": "a"},
        {"status": "Pulling fs layer", "id": "b"},
        {"status": "Downloading", "id": "a", "progressDetail": {"current": 10, "total": 100}},
        {"status": "Downloading", "id": "b", "progressDetail": {"current": 5, "total": 50}},
        {"status": "Download complete", "id": "a"},
    ]
    sums = []
    for event in events:
        if layers.update(event):
            sums.append((layers.done, layers.total))
    assert sums == [(10, 100), (15, 150), (105, 150)]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        self.now += 1
        return self.now


@pytest.fixture
def three_images(docker_client, harness_image) -> Iterator[list[str]]:
    """Three images of the node's (small layers over the harness image), oldest first."""
    tags = [f"{REPO}/cache:{name}-{uuid.uuid4().hex[:8]}" for name in ("a", "b", "c")]
    for tag in tags:
        build_image(docker_client, tag, base=harness_image, layers_mb=(1,))
    yield tags
    for tag in tags:
        _remove(docker_client, tag)


def test_the_cache_prunes_least_recently_used_first_and_keeps_a_running_image(
    docker_client, node_id, three_images, tmp_path: Path
):
    a, b, c = three_images
    driver = _driver(node_id)
    cache = ImageCache(str(tmp_path), budget_bytes=None, clock=Clock())
    for tag in three_images:  # pulled in this order: a is the least recently used
        cache.pulled(tag)
    # given a running container of a, the oldest
    container = docker_client.containers.run(
        a,
        ["sleep", "600"],
        detach=True,
        labels={LABEL_MANAGED: "1", LABEL_NODE: node_id},
        name=f"img-test-{uuid.uuid4().hex[:8]}",
    )
    try:
        held = driver.images_held()
        sizes = {ref: image.size_bytes for image in held for ref in image.refs}
        assert driver.images_in_use() == {f"{a}"}
        # when the budget holds one image only
        cache.budget_bytes = sizes[a]
        removed = cache.prune(held=held, in_use=driver.images_in_use(), remove=driver.image_remove)
        # then b went first, then c; a, running, stays although it is the oldest
        assert removed == [b, c]
        present = {ref for image in driver.images_held() for ref in image.refs}
        assert a in present and b not in present and c not in present
        assert set(cache.last_used()) == {a}
        # and the record survives a restart of the agent
        assert set(ImageCache(str(tmp_path), budget_bytes=None, clock=Clock()).last_used()) == {a}
    finally:
        container.remove(force=True)


def test_the_prune_plan_never_takes_pinned_or_used_images_and_stops_within_budget():
    from nodeagent.imagecache import HeldImage

    held = [HeldImage((ref,), ref, 10) for ref in ("x:1", "y:1", "gpumarket/harness:dev", "z:1")]
    pulled = {"x:1": 1.0, "gpumarket/harness:dev": 2.0, "y:1": 3.0, "z:1": 4.0}
    plan = prune_plan(
        pulled=pulled,
        held=held,
        in_use={"y:1"},
        pinned=("gpumarket/harness:*",),
        budget_bytes=20,
    )
    # 40 bytes held: x (oldest) and then z make it fit; the pinned harness and y in use stay
    assert plan == ["x:1", "z:1"]
    assert prune_plan(pulled=pulled, held=held, in_use=set(), pinned=(), budget_bytes=40) == []
