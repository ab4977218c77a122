"""SSH into a rental on the real stack (tests/e2e/stack.py: gunicorn, Celery, beat and a node
agent on the Docker Engine with the harness image), with Debian's OpenSSH client.

The rental's container sits on an internal network with no route to the host; the agent
publishes its sshd on a host port from its range, and the rental's API shows the command.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
from pathlib import Path

import pytest
from rest_framework.test import APIClient

from accounts.services.sshkeys import ssh_key_add
from marketplace import lifecycle
from marketplace.models import Rental
from tests.e2e.conftest import HARNESS_IMAGE, credit_customer, managed_containers, remove_managed
from tests.e2e.conftest import wait_for as wait
from tests.factories import personal_team
from tests.nodeagent.runtime.test_publish import free_range

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


def _keypair(path: Path) -> str:
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", path.name, "-f", str(path)],
        check=True, timeout=60,
    )  # fmt: skip
    return path.with_suffix(".pub").read_text()


def _ssh(key: Path, port: int, command: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["ssh", "-i", str(key), "-p", str(port), "-o", "BatchMode=yes", "-o", "IdentitiesOnly=yes",
         "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
         "-o", "ConnectTimeout=10", "harness@127.0.0.1", command],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


def _refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    except ConnectionRefusedError:
        return True
    return False


@pytest.fixture(autouse=True)
def _no_leftover_containers(docker_client):
    yield
    remove_managed(docker_client)


def test_ssh_into_a_rental_with_the_accounts_key_only_until_it_ends(
    user, stack_env, start_stack, docker_client, tmp_path, settings
):
    assert shutil.which("ssh"), "the OpenSSH client is missing: run the README's test command"
    settings.BILLING_FUNDS_CHECK = True
    credit_customer(user)
    # given an account with one key (and a second key that is not on it)
    ssh_key_add(team=personal_team(user), owner=user, public_key=_keypair(tmp_path / "mine"))
    _keypair(tmp_path / "stranger")
    # and a node agent publishing on loopback, from a range of its own
    first, last = free_range(8)
    stack_env.update(
        GPUMARKET_PUBLISH_PORTS=f"{first}-{last}",
        GPUMARKET_PUBLISH_ADDRESS="127.0.0.1",
        GPUMARKET_PUBLIC_HOST="127.0.0.1",
    )
    stack = start_stack(runtime="docker", gpus=1)
    client = APIClient()
    client.force_authenticate(user)

    # when the customer rents with SSH
    body = {
        "gpus_per_node": 1, "region": "e2e", "duration_s": 3600, "ssh": True,
        # the host's engine runs without iptables: no filtered internet there
        "network": "internal",
        "runtime": {"image": HARNESS_IMAGE,
                    "command": ["python", "-c", "import time; time.sleep(3600)"]},
    }  # fmt: skip
    r = client.post("/api/v1/rentals/", body, format="json")
    assert r.status_code == 201, r.content
    rental_id = r.json()["id"]

    # then the rental shows the command once its sshd listens
    def access():
        return client.get(f"/api/v1/rentals/{rental_id}/").json()["access"]

    [entry] = wait(access, 240, f"the ssh command (agent log: {stack.log('agent')[-2000:]})")
    port = entry["host_port"]
    assert first <= port <= last
    assert entry["command"] == f"ssh -p {port} harness@127.0.0.1"

    # and a command run with the account's key runs inside the rental's container
    done = _ssh(tmp_path / "mine", port, "hostname; id -un; echo $GPUMARKET_RENTAL_ID")
    [container] = managed_containers(docker_client, rental_id)
    sshd_log = container.exec_run(["cat", "/tmp/.gpumarket-ssh/sshd.log"]).output.decode()
    assert done.returncode == 0, (done.stderr, sshd_log, stack.log("agent")[-3000:])
    assert done.stdout.split() == [container.attrs["Config"]["Hostname"], "harness", rental_id]

    # and another key is refused
    refused = _ssh(tmp_path / "stranger", port, "hostname")
    assert refused.returncode == 255 and "Permission denied (publickey)" in refused.stderr

    # when the rental ends, the port is closed
    assert client.post(f"/api/v1/rentals/{rental_id}/stop/").status_code == 200
    wait(
        lambda: Rental.objects.get(pk=rental_id).status not in lifecycle.ACTIVE,
        180,
        "the rental to end",
    )
    wait(lambda: _refused(port), 60, "the published port to close")
    after = _ssh(tmp_path / "mine", port, "hostname")
    assert after.returncode == 255 and "Connection refused" in after.stderr
    assert access() == []
