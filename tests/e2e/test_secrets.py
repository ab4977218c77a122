"""Team secrets in real rentals: a real agent on the Docker Engine, the harness image, and a
private registry (Debian's `docker-registry`, basic auth through an htpasswd file).

A secret set through the API is readable inside the container (as a variable and as a file),
masked in every log line the platform stores and shows, and gone from the host with the run.
An image of the private registry is pulled with the team's registry secret; without it (even once
the image is on the node), with wrong credentials or under a name the registry does not have,
the rental fails as the customer's doing, saying why.
"""

from __future__ import annotations

import contextlib
import hashlib
import shutil
import socket
import subprocess
from pathlib import Path

import pytest

from marketplace.models import EndCause, Node, Rental, RentalStatus
from provisioning.models import RunLogLine
from tests.e2e.conftest import (
    HARNESS_IMAGE,
    credit_customer,
    managed_containers,
    remove_managed,
    wait_for,
)

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

TOKEN = "hf_e2e-S3cret-value-7f3a9"
FILE_VALUE = "-----BEGIN KEY-----\nline-one-of-the-key\n-----END KEY-----\n"
REGISTRY_USER, REGISTRY_PASSWORD = "secuser", "reg-P4ss-word"


@pytest.fixture(autouse=True)
def _funded_customer(settings, user):
    settings.BILLING_FUNDS_CHECK = True
    credit_customer(user)


@pytest.fixture(autouse=True)
def _no_leftover_containers(docker_client):
    yield
    remove_managed(docker_client)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def registry(tmp_path, docker_client):
    """A private registry on loopback with basic auth, holding one tiny image (busybox on
    scratch) pushed with its credentials; the image is then removed from the engine, so a
    rental must pull it."""
    binary = shutil.which("docker-registry")
    assert binary, "Debian's docker-registry is missing: apt-get install docker-registry"
    assert shutil.which("htpasswd"), "htpasswd is missing: apt-get install apache2-utils"
    assert Path("/bin/busybox").exists(), "busybox is missing: apt-get install busybox-static"
    root = tmp_path / "registry"
    root.mkdir()
    htpasswd = subprocess.run(
        ["htpasswd", "-Bbn", REGISTRY_USER, REGISTRY_PASSWORD],
        capture_output=True, text=True, check=True, timeout=30,
    ).stdout  # fmt: skip
    (root / "htpasswd").write_text(htpasswd)
    port = _free_port()
    (root / "config.yml").write_text(
        "version: 0.1\n"
        f"storage: {{filesystem: {{rootdirectory: {root / 'data'}}}}}\n"
        f"http: {{addr: 127.0.0.1:{port}}}\n"
        f"auth: {{htpasswd: {{realm: gpumarket-e2e, path: {root / 'htpasswd'}}}}}\n"
    )
    log = (root / "registry.log").open("wb")
    proc = subprocess.Popen(
        [binary, "serve", str(root / "config.yml")], stdout=log, stderr=subprocess.STDOUT
    )
    image = f"127.0.0.1:{port}/sec-e2e/tiny"
    try:
        wait_for(lambda: _listens(port), 30, "the registry")
        context = root / "image"
        (context / "bin").mkdir(parents=True)
        shutil.copy("/bin/busybox", context / "bin" / "busybox")
        (context / "Dockerfile").write_text(
            "FROM scratch\nCOPY bin/busybox /bin/busybox\n"
            'RUN ["/bin/busybox", "--install", "-s", "/bin"]\nCMD ["/bin/sh"]\n'
        )
        docker_client.images.build(path=str(context), tag=f"{image}:1", rm=True)
        auth = {"username": REGISTRY_USER, "password": REGISTRY_PASSWORD}
        docker_client.images.push(image, tag="1", auth_config=auth)
        docker_client.images.remove(f"{image}:1", force=True)
        yield image
    finally:
        with contextlib.suppress(Exception):  # none when the pull was refused
            docker_client.images.remove(f"{image}:1", force=True)
        proc.terminate()
        proc.wait(20)


def _listens(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    except OSError:
        return False
    return True


def _joined() -> Node:
    return wait_for(lambda: Node.objects.filter(region="e2e").first(), 90, "the agent to join")


def _rent(auth_api, image: str, command: list[str], **fields) -> str:
    body = {
        "gpus_per_node": 1,
        "region": "e2e",
        "duration_s": 3600,
        "runtime": {"image": image, "command": command},
        "network": "internal",  # this host's engine cannot filter the internet
        **fields,
    }
    r = auth_api.post("/api/v1/rentals/", body, format="json")
    assert r.status_code == 201, r.content
    return r.json()["id"]


def _ended(rental_id: str) -> Rental:
    terminal = (RentalStatus.COMPLETED, RentalStatus.FAILED)
    return wait_for(
        lambda: Rental.objects.filter(pk=rental_id, status__in=terminal).first(),
        240,
        f"rental {rental_id} to end",
    )


def _set(auth_api, name: str, value: str) -> None:
    r = auth_api.post("/api/v1/secrets/", {"name": name, "value": value}, format="json")
    assert r.status_code in (200, 201), r.content


def test_a_secret_is_readable_in_the_container_and_masked_in_every_stored_line(
    auth_api, celery_worker, start_agent, docker_client, tmp_path
):
    # given two secrets set through the API, and a node running the Docker runtime
    _set(auth_api, "HF_TOKEN", TOKEN)
    _set(auth_api, "SSH_KEY", FILE_VALUE)
    start_agent()
    _joined()
    # when a rental names them (one as a variable, one as a file) and prints them
    script = (
        "import hashlib, os; t = os.environ['HF_TOKEN']; "
        "k = open('/run/secrets/deploy_key').read(); "
        "print('token', t, flush=True); print(k, flush=True); "
        "print('sha', hashlib.sha256((t + k).encode()).hexdigest(), flush=True); "
        "print('in workspace:', sorted(os.listdir('/workspace')), flush=True); "
        "print('mode', oct(os.stat('/run/secrets/deploy_key').st_mode & 0o777), flush=True)"
    )
    rental_id = _rent(
        auth_api,
        HARNESS_IMAGE,
        ["python", "-c", script],
        secrets={"HF_TOKEN": {}, "SSH_KEY": {"file": "/run/secrets/deploy_key"}},
    )
    rental = _ended(rental_id)
    # then it read both: the digest of the values it saw is the digest of what was set
    assert rental.status == RentalStatus.COMPLETED, (rental.status_reason, rental.log_tail)
    wait_for(lambda: RunLogLine.objects.filter(rental_id=rental_id).count() >= 7, 60, "logs")
    stored = "\n".join(
        RunLogLine.objects.filter(rental_id=rental_id)
        .order_by("line_no")
        .values_list("line", flat=True)
    )
    digest = hashlib.sha256((TOKEN + FILE_VALUE).encode()).hexdigest()
    assert f"sha {digest}" in stored
    assert "mode 0o400" in stored
    [workspace] = [line for line in stored.splitlines() if line.startswith("in workspace:")]
    assert "deploy_key" not in workspace and "secret" not in workspace  # never synced out
    # and every stored and shown line has them masked
    assert "token ****" in stored
    assert stored.count("****") >= 4  # the token, and each line of the key
    shown = auth_api.get(f"/api/v1/rentals/{rental_id}/logs/").content.decode()
    shown += auth_api.get(f"/api/v1/rentals/{rental_id}/").content.decode()
    for text in (stored, rental.log_tail, rental.status_reason, shown):
        assert TOKEN not in text and "line-one-of-the-key" not in text
    # and nothing of the secrets is left on the host once the container is gone
    wait_for(lambda: not managed_containers(docker_client, rental_id), 60, "container removal")
    leftovers = [p for p in tmp_path.rglob(".secrets-*")]
    assert leftovers == []


def test_a_private_image_is_pulled_with_the_registry_secret_and_refused_without_it(
    auth_api, celery_worker, start_agent, docker_client, registry, stack_env
):
    # given a node that admits the registry's images, and the team's credentials
    stack_env["GPUMARKET_IMAGE_ALLOW"] = f"gpumarket/harness:*,{registry.split('/')[0]}/*"
    start_agent()
    _joined()
    _set(
        auth_api,
        "REGISTRY",
        f'{{"username": "{REGISTRY_USER}", "password": "{REGISTRY_PASSWORD}"}}',
    )
    _set(auth_api, "WRONG", f"{REGISTRY_USER}:not-the-password")
    _set(auth_api, "API_TOKEN", TOKEN)
    command = ["sh", "-c", "echo pulled-ok; echo token=$API_TOKEN"]

    # when a rental names no credentials, or wrong ones, or an image the registry lacks
    cases = [
        ({}, f"{registry}:1", "the registry asked for credentials"),
        ({"registry_secret": "WRONG"}, f"{registry}:1", "refused the credentials in secret WRONG"),
        ({"registry_secret": "REGISTRY"}, f"{registry}-missing:1", "image not found"),
    ]
    for fields, image, why in cases:
        rental = _ended(_rent(auth_api, image, command, **fields))
        # then it fails as the customer's doing, saying why
        assert rental.status == RentalStatus.FAILED, rental.status_reason
        assert rental.end_cause == EndCause.CUSTOMER, rental.status_reason
        assert why in rental.status_reason, rental.status_reason
        assert REGISTRY_PASSWORD not in rental.status_reason + rental.log_tail

    # when it names the team's credentials: pulled, and run
    rental_id = _rent(
        auth_api, f"{registry}:1", command, registry_secret="REGISTRY", secrets=["API_TOKEN"]
    )
    rental = _ended(rental_id)
    assert rental.status == RentalStatus.COMPLETED, (rental.status_reason, rental.log_tail)
    assert "pulled-ok" in rental.log_tail and "token=****" in rental.log_tail
    assert TOKEN not in rental.log_tail
    assert docker_client.images.get(f"{registry}:1")

    # when the image is on the node now, a rental without the credentials is still refused:
    # the node asks the registry again
    rental = _ended(_rent(auth_api, f"{registry}:1", command))
    assert rental.status == RentalStatus.FAILED and rental.end_cause == EndCause.CUSTOMER
    assert "the registry asked for credentials" in rental.status_reason, rental.status_reason
