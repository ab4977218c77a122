"""A join is safe to repeat: the host whose answer was lost gets its node back; nobody else does.

The case behind it: the agent's first join timed out on its side while the server had committed
it (a busy machine); every retry then met "used join token" and the host never joined.
"""

from datetime import timedelta

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from marketplace.models import Node
from provisioning.models import JoinToken, NodeCredential

pytestmark = pytest.mark.django_db

HOST = {"cpu_cores": 32, "ram_gb": 256, "disk_gb": 2000, "driver_version": "550.54",
        "cuda_version": "12.4"}  # fmt: skip
KEY = "k" * 43
OTHER_KEY = "o" * 43


def _gpus(prefix="GPU-retry"):
    return [
        {"index": i, "uuid": f"{prefix}-{i}", "name": "NVIDIA H100 80GB HBM3",
         "memory_mb": 81559, "topology_group": "nvl0"}
        for i in range(2)
    ]  # fmt: skip


def _join(api, token, *, key=KEY, gpus=None, **extra):
    body = {"join_token": token, "hostname": "h100-host", "host": HOST, "gpus": gpus or _gpus()}
    if key is not None:
        body["host_key"] = key
    return api.post("/api/agent/v1/join/", {**body, **extra}, format="json")


def _beat_status(token: str) -> int:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {token}")
    return client.post("/api/agent/v1/heartbeat/", {}, format="json").status_code


def test_given_a_lost_answer_when_the_host_repeats_the_join_then_it_gets_its_node_back(
    api, join_token
):
    first = _join(api, join_token)
    assert first.status_code == 201, first.content
    # The agent never heard that answer; it tries again with the same token and key.
    again = _join(api, join_token)
    assert again.status_code == 201, again.content
    assert again.json()["node_id"] == first.json()["node_id"]
    assert again.json()["node_token"] != first.json()["node_token"]
    assert Node.objects.count() == 1
    # Only the newest node token is valid: the lost one cannot be used by whoever finds it.
    assert NodeCredential.objects.filter(revoked_at__isnull=True).count() == 1
    assert _beat_status(again.json()["node_token"]) == 200
    assert _beat_status(first.json()["node_token"]) == 401


@pytest.mark.parametrize(
    ("what", "kwargs"),
    [
        ("another host's key", {"key": OTHER_KEY}),
        ("no key (an agent that predates it)", {"key": None}),
        ("the same key, other GPUs", {"gpus": _gpus(prefix="GPU-other")}),
    ],
)
def test_a_used_token_presented_by_anyone_else_is_refused_and_changes_nothing(
    api, join_token, what, kwargs
):
    first = _join(api, join_token)
    assert first.status_code == 201
    node = Node.objects.get()
    r = _join(api, join_token, **kwargs)
    assert r.status_code == 400, what
    assert "join_token" in r.json()
    assert Node.objects.count() == 1
    assert list(NodeCredential.objects.values_list("node_id", "revoked_at")) == [(node.pk, None)]
    assert _beat_status(first.json()["node_token"]) == 200


def test_a_used_token_past_its_expiry_is_refused_even_to_its_host(api, join_token):
    assert _join(api, join_token).status_code == 201
    JoinToken.objects.update(expires_at=timezone.now() - timedelta(seconds=1))
    assert _join(api, join_token).status_code == 400
    assert NodeCredential.objects.filter(revoked_at__isnull=True).count() == 1


def test_a_repeat_cannot_undo_a_revocation(api, join_token):
    from provisioning.services import node_credential_revoke

    first = _join(api, join_token)
    node_credential_revoke(node_id=first.json()["node_id"], actor=None)
    assert _join(api, join_token).status_code == 400
    assert not NodeCredential.objects.filter(revoked_at__isnull=True).exists()


def test_a_token_joined_without_a_key_cannot_be_repeated_with_one(api, join_token):
    assert _join(api, join_token, key=None).status_code == 201
    assert _join(api, join_token).status_code == 400
    assert NodeCredential.objects.filter(revoked_at__isnull=True).count() == 1


@pytest.mark.parametrize(
    ("extra", "runtime", "ssh_capable"),
    [
        ({"runtime": "process", "ssh": True}, "process", False),
        ({"runtime": "docker", "ssh": False}, "docker", False),
        ({"runtime": "docker", "ssh": True}, "docker", True),
        ({}, "", True),  # an agent that predates saying it: what it could do before
    ],
)
def test_the_node_records_what_its_agent_can_run(api, join_token, extra, runtime, ssh_capable):
    assert _join(api, join_token, **extra).status_code == 201
    node = Node.objects.get()
    assert (node.runtime, node.ssh_capable) == (runtime, ssh_capable)


@pytest.mark.parametrize("key", ["short", "x" * 129, "bad key with spaces " * 3, "\u202e" * 40])
def test_a_malformed_host_key_is_a_400_naming_it(api, join_token, key):
    r = _join(api, join_token, key=key)
    assert r.status_code == 400 and "host_key" in r.json()
    assert Node.objects.count() == 0
    assert JoinToken.objects.get().used_at is None


@pytest.mark.parametrize(
    ("extra", "filtered", "capable"),
    [
        ({"runtime": "docker", "internet_filtered": True}, True, True),
        ({"runtime": "docker", "internet_filtered": False}, False, False),
        ({"runtime": "docker", "simulated": True}, False, False),  # simulated is no filter
        # the development runtime: the host's own network, accepted for simulated nodes only
        ({"runtime": "process", "simulated": True}, False, True),
        ({"runtime": "process", "internet_filtered": True}, False, False),
        ({}, False, False),  # an agent that predates saying it: unable
    ],
)
def test_the_node_records_whether_it_may_host_rentals_with_internet(
    api, join_token, extra, filtered, capable
):
    assert _join(api, join_token, **extra).status_code == 201
    node = Node.objects.get()
    assert (node.internet_filtered, node.internet_capable) == (filtered, capable)


def test_a_rejoin_says_again_whether_the_node_filters(api, make_join_token):
    # given a node whose engine could not filter when it joined
    assert _join(api, make_join_token(), internet_filtered=False).status_code == 201
    # when its agent rejoins (a new join token, the same GPUs) on an engine that can
    assert _join(api, make_join_token(), internet_filtered=True).status_code == 201
    # then the same node is now offered rentals with internet
    node = Node.objects.get()
    assert (node.internet_filtered, node.internet_capable) == (True, True)
