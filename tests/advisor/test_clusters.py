"""The advisor plans a gang only inside one cluster with enough free nodes, prices it with that
cluster's declared bandwidth, and shows the interconnect; a node on its own gets single-node
plans only."""

import pytest

from marketplace.models import Cluster
from marketplace.services import cluster_update
from tests.advisor.test_answers import NEEDS_17

pytestmark = pytest.mark.django_db

CARD = "a100-sxm4-40gb"


def _plans(api, body=NEEDS_17) -> list[dict]:
    r = api.post("/api/v1/advisor/", body, format="json")
    assert r.status_code == 200, r.content
    return r.json()["plans"]


def test_a_gang_is_planned_only_inside_a_cluster_with_enough_free_nodes(api, make_node):
    # Given eight nodes of 8 GPUs: four in cluster "ib", four on their own
    for _ in range(4):
        make_node(card=CARD, price="1.00", cluster="ib")
    for _ in range(4):
        make_node(card=CARD, price="0.90", cluster=None)

    # When a model that needs 17 GPUs (3 nodes of 8) is planned
    plans = _plans(api)

    # Then its gangs stay within the cluster's four nodes, and say what joins them
    assert sorted((p["nodes"], p["gpus_per_node"]) for p in plans) == [(3, 8), (4, 8)]
    assert {p["interconnect"] for p in plans} == {"InfiniBand 200 Gb/s"}
    assert {p["price_per_gpu_hour"] for p in plans} == {"1.0000"}


def test_no_cluster_no_gang_and_the_answer_says_why(api, make_node):
    for _ in range(8):
        make_node(card=CARD, price="1.00", cluster=None)
    r = api.post("/api/v1/advisor/", NEEDS_17, format="json")
    assert r.status_code == 200, r.content
    assert r.json()["plans"] == []
    assert r.json()["reasons"], r.json()


def test_a_gang_is_priced_with_its_clusters_bandwidth(api, make_node):
    # Given four nodes in one cluster declared as InfiniBand 400 Gb/s
    for _ in range(4):
        make_node(card=CARD, price="1.00", cluster="fabric-x")
    cluster = Cluster.objects.get(name="fabric-x")
    cluster_update(
        owner=cluster.provider.owner,
        cluster_id=cluster.pk,
        interconnect="infiniband",
        bandwidth_gbps=400,
    )
    fast = {p["id"]: p for p in _plans(api)}

    # When the provider says the fabric is 10 Gb/s Ethernet instead
    cluster_update(
        owner=cluster.provider.owner,
        cluster_id=cluster.pk,
        interconnect="ethernet",
        bandwidth_gbps=10,
    )
    slow = {p["id"]: p for p in _plans(api)}

    # Then the same gangs take longer, and the answer names the slower fabric
    assert set(fast) == set(slow) == {f"{CARD}:3x8", f"{CARD}:4x8"}
    for plan_id in fast:
        assert slow[plan_id]["hours"] > fast[plan_id]["hours"]
        assert (fast[plan_id]["interconnect"], slow[plan_id]["interconnect"]) == (
            "InfiniBand 400 Gb/s",
            "Ethernet 10 Gb/s",
        )


def test_single_node_plans_show_no_interconnect(api, make_node):
    make_node(card=CARD, price="1.00", cluster=None)
    plans = _plans(api, {"model": "gpt2-124m", "tokens_b": 1})
    assert plans and all(p["nodes"] == 1 and p["interconnect"] is None for p in plans)


def test_a_booked_gang_asks_its_cluster_for_the_bandwidth_it_was_priced_with(auth_api, make_node):
    # Given a cheap 10 Gb/s Ethernet cluster of three nodes and a dearer 200 Gb/s one of four
    for _ in range(3):
        make_node(card=CARD, price="0.80", cluster="slow")
    slow = Cluster.objects.get(name="slow")
    cluster_update(
        owner=slow.provider.owner, cluster_id=slow.pk, interconnect="ethernet", bandwidth_gbps=10
    )
    for _ in range(4):
        make_node(card=CARD, price="1.00", cluster="fast")

    # When the 3x8 plan is booked (priced on the cheaper cluster) and a 4x8 one (only the
    # dearer cluster has four nodes)
    plans = {p["id"]: p for p in _plans(auth_api)}
    assert plans[f"{CARD}:3x8"]["interconnect"] == "Ethernet 10 Gb/s"
    assert plans[f"{CARD}:4x8"]["interconnect"] == "InfiniBand 200 Gb/s"
    booked = {}
    for plan_id in (f"{CARD}:3x8", f"{CARD}:4x8"):
        r = auth_api.post("/api/v1/advisor/book/", {**NEEDS_17, "plan": plan_id}, format="json")
        assert r.status_code == 201, r.content
        booked[plan_id] = r.json()["min_interconnect_gbps"]

    # Then each rental asks for a cluster at least as fast as the one it was priced on
    assert booked == {f"{CARD}:3x8": 10, f"{CARD}:4x8": 200}
