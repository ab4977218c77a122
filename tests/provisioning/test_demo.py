"""The demo seed of `dev.py up` makes its people as sign-up would, minus the mail: verified
addresses (so they sign in), the customer's account through the same onboarding service."""

from __future__ import annotations

import json
import stat
from decimal import Decimal
from pathlib import Path

import pytest
from allauth.account.models import EmailAddress
from django.test import Client

from accounts.services import token_hash
from billing.models import Account, AccountKind
from marketplace.models import Cluster, Node, User
from nodeagent.fleet import fleet_configs
from provisioning.demo import DEMO_NODES, demo_fleet_prepare, load_demo
from provisioning.models import JoinToken
from provisioning.services import node_credential_revoke

pytestmark = pytest.mark.django_db


def test_the_demo_people_sign_in_and_a_second_load_changes_nothing(tmp_path):
    load_demo(var_dir=tmp_path)
    load_demo(var_dir=tmp_path)
    demo = User.objects.get(username="demo")
    account = Account.objects.get(kind=AccountKind.CUSTOMER, team__personal_of=demo)
    assert account.balance_micros == 100_000_000
    for name in ("ops", "demo"):
        assert list(EmailAddress.objects.filter(user__username=name).values_list("verified")) == [
            (True,)
        ]
    client = Client()
    password = (tmp_path / "demo_password").read_text().strip()
    page = client.post("/accounts/login/", {"login": "demo", "password": password})
    assert (page.status_code, page["Location"]) == (302, "/")


# The demo hosts' agents: what `manage.py demo_fleet` prepares at each start.


def _fleet(path) -> dict[str, dict]:
    return {n["hostname"]: n for n in json.loads(path.read_text())["nodes"]}


def _joined(api, host: dict, *, key: str = "k" * 43, **extra) -> dict:
    """Join as the demo host's agent would, and keep its files where that agent keeps them."""
    from agentprotocol import simulated_gpu_uuid

    slug, count = host["simulate_gpus"].split(":")
    state = Path(host["dir"]) / "state"
    state.mkdir(parents=True, exist_ok=True)
    (state / "host_key").write_text(key + "\n")
    r = api.post(
        "/api/agent/v1/join/",
        {
            "join_token": host["join_token"], "hostname": host["hostname"], "host_key": key,
            "host": {"cpu_cores": 8, "ram_gb": 32, "disk_gb": 100},
            "gpus": [{"index": i, "uuid": simulated_gpu_uuid(host["hostname"], i), "name": slug,
                      "memory_mb": 24576} for i in range(int(count))],
            "simulated": True, "runtime": "process", "ssh": False, **extra,
        },
        format="json",
    )  # fmt: skip
    assert r.status_code == 201, r.content
    (state / "node_token.json").write_text(json.dumps(r.json()))
    return r.json()


def test_every_demo_host_gets_a_join_token_of_its_listing_terms(tmp_path):
    load_demo(var_dir=tmp_path)
    path = demo_fleet_prepare(var_dir=tmp_path, server_url="http://127.0.0.1:8000")
    fleet = _fleet(path)
    assert set(fleet) == {hostname for hostname, *_ in DEMO_NODES}
    assert json.loads(path.read_text())["server"] == "http://127.0.0.1:8000"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    for hostname, region, card, count, price in DEMO_NODES:
        token = JoinToken.objects.get(key_hash=token_hash(fleet[hostname]["join_token"]))
        assert (token.region, token.price_per_gpu_hour) == (region, Decimal(price))
        assert fleet[hostname]["simulate_gpus"] == f"{card}:{count}"
    # A second start keeps the tokens that can still work.
    assert _fleet(demo_fleet_prepare(var_dir=tmp_path, server_url="http://x")) == fleet
    assert JoinToken.objects.count() == len(DEMO_NODES)


def test_a_host_whose_node_token_is_refused_gets_a_new_join_token_and_its_node_back(tmp_path, api):
    load_demo(var_dir=tmp_path)
    first = _fleet(demo_fleet_prepare(var_dir=tmp_path, server_url="http://s"))
    host = first["fra-h100-01"]
    answer = _joined(api, host)
    # Joined and holding a valid node token: nothing to do at the next start.
    assert _fleet(demo_fleet_prepare(var_dir=tmp_path, server_url="http://s")) == first
    # Its token revoked (ops did, or the database was restored): the next start mints a join
    # token and removes the refused node token, instead of the agent failing every restart.
    node_credential_revoke(node_id=answer["node_id"], actor=None)
    again = _fleet(demo_fleet_prepare(var_dir=tmp_path, server_url="http://s"))
    assert again["fra-h100-01"]["join_token"] != host["join_token"]
    assert not (Path(host["dir"]) / "state" / "node_token.json").exists()
    assert {h: n for h, n in again.items() if h != "fra-h100-01"} == {
        h: n for h, n in first.items() if h != "fra-h100-01"
    }
    # The same host joins with it and gets the same node back.
    rejoined = _joined(api, again["fra-h100-01"])
    assert rejoined["node_id"] == answer["node_id"]
    assert Node.objects.filter(hostname="fra-h100-01").count() == 1


def test_a_host_that_joined_but_never_heard_keeps_its_spent_token(tmp_path, api):
    load_demo(var_dir=tmp_path)
    first = _fleet(demo_fleet_prepare(var_dir=tmp_path, server_url="http://s"))
    host = first["sgp-t4-01"]
    _joined(api, host)
    (Path(host["dir"]) / "state" / "node_token.json").unlink()  # the answer never arrived
    # Its own key can repeat that join: the token stays.
    assert _fleet(demo_fleet_prepare(var_dir=tmp_path, server_url="http://s")) == first
    # Another host's key could not: a fresh token then.
    (Path(host["dir"]) / "state" / "host_key").write_text("o" * 43)
    after = _fleet(demo_fleet_prepare(var_dir=tmp_path, server_url="http://s"))
    assert after["sgp-t4-01"]["join_token"] != host["join_token"]


def test_the_demo_h100_hosts_join_one_400_gbps_infiniband_cluster(tmp_path, api):
    # Given the fleet file of a fresh stack
    load_demo(var_dir=tmp_path)
    path = demo_fleet_prepare(var_dir=tmp_path, server_url="http://s")
    configs = {c.hostname: c for c in fleet_configs(json.loads(path.read_text()))}

    # Then the H100 hosts' agents name one cluster and its fabric, the others none
    clustered = {h for h, c in configs.items() if c.cluster is not None}
    assert clustered == {"fra-h100-01", "fra-h100-02"}
    for hostname in clustered:
        config = configs[hostname]
        assert (config.cluster, config.interconnect, config.interconnect_gbps) == (
            "fra-h100-ib",
            "infiniband",
            400,
        )

    # And when they join as their agents do, both nodes are in that one cluster
    fleet = _fleet(path)
    for hostname in sorted(clustered):
        config = configs[hostname]
        _joined(
            api,
            fleet[hostname],
            cluster=config.cluster,
            interconnect=config.interconnect,
            interconnect_gbps=config.interconnect_gbps,
        )
    cluster = Cluster.objects.get()
    assert (cluster.provider.is_platform, cluster.interconnect_label) == (
        True,
        "InfiniBand 400 Gb/s",
    )
    assert set(cluster.nodes.values_list("hostname", flat=True)) == clustered
