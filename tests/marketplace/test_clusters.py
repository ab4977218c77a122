"""Clusters through the provider API and the scheduler on real PostgreSQL: a provider declares
which of its nodes share a fabric; a gang is placed inside one cluster, a single-node rental
anywhere; another provider's cluster is 404 (or a 400 naming `cluster` when put on a node), and
the database itself refuses a node in another provider's cluster."""

from __future__ import annotations

import pytest
from django.db import IntegrityError, transaction
from rest_framework.test import APIClient

from core.errors import ValidationFailed
from marketplace.models import Allocation, Cluster, Node, RentalStatus
from marketplace.services import cluster_create
from scheduler.services import scheduler_cycle_run
from tests.factories import ProviderFactory, UserFactory

pytestmark = pytest.mark.django_db


@pytest.fixture
def owner_api(provider) -> APIClient:
    client = APIClient()
    client.force_authenticate(user=provider.owner)
    return client


@pytest.fixture
def stranger_api() -> APIClient:
    client = APIClient()
    client.force_authenticate(user=UserFactory())
    return client


def _declare(client, provider, **body):
    body = {"name": "h100-ib", "interconnect": "infiniband", "bandwidth_gbps": 400, **body}
    return client.post(f"/api/v1/providers/{provider.pk}/clusters/", body, format="json")


def _members(rental) -> set[str]:
    return set(
        Allocation.objects.filter(rental=rental).values_list("node__hostname", flat=True).distinct()
    )


def test_a_provider_declares_a_cluster_puts_nodes_in_it_and_sees_them(
    owner_api, provider, make_node
):
    # Given two nodes on their own
    a = make_node(hostname="a", cluster=None)
    make_node(hostname="b", cluster=None)

    # When the provider declares a cluster and puts node a in it
    r = _declare(owner_api, provider)
    assert r.status_code == 201, r.content
    cluster_id = r.json()["id"]
    r = owner_api.patch(f"/api/v1/providers/nodes/{a.pk}/", {"cluster": cluster_id}, format="json")
    assert r.status_code == 200, r.content
    assert (r.json()["cluster"], r.json()["cluster_name"]) == (cluster_id, "h100-ib")

    # Then its clusters list shows the node and the interconnect
    [row] = owner_api.get(f"/api/v1/providers/{provider.pk}/clusters/").json()
    assert {
        k: row[k] for k in ("name", "interconnect", "bandwidth_gbps", "interconnect_label")
    } == {
        "name": "h100-ib",
        "interconnect": "infiniband",
        "bandwidth_gbps": 400,
        "interconnect_label": "InfiniBand 400 Gb/s",
    }
    assert [n["hostname"] for n in row["nodes"]] == ["a"]

    # And a rename and a new bandwidth apply; taking the node out leaves it listed on its own
    r = owner_api.patch(
        f"/api/v1/providers/clusters/{cluster_id}/",
        {"name": "ib-2", "bandwidth_gbps": 800},
        format="json",
    )
    assert (r.status_code, r.json()["name"], r.json()["bandwidth_gbps"]) == (200, "ib-2", 800)
    r = owner_api.patch(f"/api/v1/providers/nodes/{a.pk}/", {"cluster": None}, format="json")
    assert r.json()["cluster"] is None


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"name": "H100 IB"}, "name"),
        ({"name": ""}, "name"),
        ({"interconnect": "carrier-pigeon"}, "interconnect"),
        ({"bandwidth_gbps": 0}, "bandwidth_gbps"),
        ({"bandwidth_gbps": 10**9}, "bandwidth_gbps"),
        ({"colour": "red"}, "colour"),
    ],
)
def test_a_bad_cluster_is_400_naming_the_field_and_writes_nothing(owner_api, provider, body, field):
    r = _declare(owner_api, provider, **body)
    assert r.status_code == 400 and field in r.json(), r.content
    assert not Cluster.objects.exists()


def test_a_name_is_unique_per_provider_not_across_providers(owner_api, provider):
    assert _declare(owner_api, provider).status_code == 201
    r = _declare(owner_api, provider, interconnect="ethernet", bandwidth_gbps=25)
    assert r.status_code == 400 and "name" in r.json()
    other = ProviderFactory()
    cluster_create(
        owner=other.owner,
        provider_id=other.pk,
        name="h100-ib",
        interconnect="roce",
        bandwidth_gbps=200,
    )
    assert Cluster.objects.filter(name="h100-ib").count() == 2


def test_another_providers_clusters_are_404_and_unchanged(
    owner_api, stranger_api, provider, make_node
):
    cluster_id = _declare(owner_api, provider).json()["id"]
    assert stranger_api.get(f"/api/v1/providers/{provider.pk}/clusters/").status_code == 404
    assert _declare(stranger_api, provider, name="mine").status_code == 404
    url = f"/api/v1/providers/clusters/{cluster_id}/"
    assert stranger_api.get(url).status_code == 404
    assert stranger_api.patch(url, {"bandwidth_gbps": 1}, format="json").status_code == 404
    assert stranger_api.delete(url).status_code == 404
    cluster = Cluster.objects.get()
    assert (cluster.name, cluster.bandwidth_gbps) == ("h100-ib", 400)


def test_a_node_joins_only_its_own_providers_cluster(owner_api, provider, make_node):
    # Given a node of this provider, and a cluster of another provider
    node = make_node(cluster=None)
    other = ProviderFactory()
    foreign = cluster_create(
        owner=other.owner,
        provider_id=other.pk,
        name="theirs",
        interconnect="infiniband",
        bandwidth_gbps=400,
    )

    # When the owner puts its node in the other provider's cluster
    r = owner_api.patch(
        f"/api/v1/providers/nodes/{node.pk}/",
        {"cluster": foreign.pk, "price_per_gpu_hour": "9.00"},
        format="json",
    )

    # Then it is a 400 naming the field, and neither the cluster nor the price was written
    assert r.status_code == 400 and "cluster" in r.json(), r.content
    node.refresh_from_db()
    assert (node.cluster_id, str(node.price_per_gpu_hour)) == (None, "1.0000")

    # And the database refuses it whatever writes the row
    with pytest.raises(IntegrityError), transaction.atomic():
        Node.objects.filter(pk=node.pk).update(cluster=foreign)


def test_deleting_a_cluster_leaves_its_nodes_listed_on_their_own(owner_api, provider, make_node):
    node = make_node(cluster="doomed")
    r = owner_api.delete(f"/api/v1/providers/clusters/{node.cluster_id}/")
    assert r.status_code == 204
    node.refresh_from_db()
    assert node.cluster_id is None and Node.objects.filter(pk=node.pk).exists()


def test_a_gang_is_placed_inside_one_cluster_and_a_single_node_rental_anywhere(make_node, rent):
    # Given the cheapest node on its own, one cheap node in "a", and two dearer nodes in "b"
    make_node(hostname="alone", price="0.50", cluster=None)
    make_node(hostname="a1", price="1.00", cluster="a")
    make_node(hostname="b1", price="2.00", cluster="b")
    make_node(hostname="b2", price="2.00", cluster="b")

    # When a gang of two whole nodes and a single-node rental are scheduled
    gang = rent(8, node_count=2)
    single = rent(8)
    scheduler_cycle_run()

    # Then the gang takes the one cluster that can hold it, at its price, and the single-node
    # rental the cheapest node, which has no cluster
    gang.refresh_from_db()
    single.refresh_from_db()
    assert (gang.status, str(gang.price_per_gpu_hour)) == (RentalStatus.SCHEDULED, "2.0000")
    assert _members(gang) == {"b1", "b2"}
    assert _members(single) == {"alone"}


def test_a_gang_waits_while_its_cluster_is_short_and_runs_once_a_node_joins_it(
    owner_api, make_node, rent
):
    # Given a cluster of two nodes and a node on its own
    first = make_node(hostname="c1", cluster="c")
    second = make_node(hostname="c2", cluster="c")
    alone = make_node(hostname="c3", cluster=None)
    gang = rent(8, node_count=2)

    # When the provider takes one node out of the cluster before the cycle
    owner_api.patch(f"/api/v1/providers/nodes/{second.pk}/", {"cluster": None}, format="json")
    scheduler_cycle_run()

    # Then the gang waits, saying why, though two nodes are free
    gang.refresh_from_db()
    assert gang.status == RentalStatus.PENDING
    assert gang.status_reason == (
        "no cluster has 2 matching nodes (the largest has 1): a multi-node rental runs inside "
        "one cluster"
    )

    # And once the provider puts the other node in the cluster, the next cycle places it there
    r = owner_api.patch(
        f"/api/v1/providers/nodes/{alone.pk}/", {"cluster": first.cluster_id}, format="json"
    )
    assert r.status_code == 200
    scheduler_cycle_run()
    gang.refresh_from_db()
    assert gang.status == RentalStatus.SCHEDULED
    assert _members(gang) == {"c1", "c3"}


def test_a_gang_no_cluster_can_hold_is_refused_at_create_naming_node_count(make_node, rent):
    make_node(cluster=None)
    make_node(cluster=None)
    with pytest.raises(ValidationFailed) as refused:
        rent(8, node_count=2)
    assert refused.value.field == "node_count"
    assert "no matching node is in a cluster" in refused.value.message


def test_offers_show_the_interconnect_and_the_cluster_size(api, client, make_node):
    # Given two online nodes in cluster "fabric" (InfiniBand 200 Gb/s) and one on its own
    make_node(hostname="ib-1", price="1.00")
    make_node(hostname="ib-2", price="1.10")
    make_node(hostname="alone", price="1.20", cluster=None)

    # When anyone reads the offers
    rows = {r["hostname"]: r for r in api.get("/api/v1/offers/").json()["results"]}

    # Then a clustered node says its fabric and how many nodes share it, the other nothing
    fields = ("cluster", "interconnect", "interconnect_gbps", "cluster_nodes")
    assert {h: tuple(r[f] for f in fields) for h, r in rows.items()} == {
        "ib-1": ("fabric", "infiniband", 200, 2),
        "ib-2": ("fabric", "infiniband", 200, 2),
        "alone": (None, None, None, None),
    }
    # And the offers page shows it as a person reads it
    html = client.get("/").content.decode()
    assert "InfiniBand 200 Gb/s" in html and "2 nodes in fabric" in html


def test_the_provider_page_shows_clusters_and_each_nodes_cluster(client, provider, make_node):
    make_node(hostname="in-cluster", cluster="h100-ib")
    make_node(hostname="on-its-own", cluster=None)
    client.force_login(provider.owner)
    html = client.get("/provider/").content.decode()
    assert "Declare a cluster" in html and "InfiniBand 200 Gb/s" in html
    cluster = Cluster.objects.get(name="h100-ib")
    assert f'<option value="{cluster.pk}" selected>h100-ib</option>' in html
    assert '<option value="" selected>on its own</option>' in html


def test_a_gang_can_ask_for_a_fast_interconnect_and_a_single_node_cannot(auth_api, make_node, rent):
    # Given a cheap 25 Gb/s Ethernet cluster and a dearer 200 Gb/s InfiniBand one
    for name in ("e1", "e2"):
        make_node(hostname=name, price="1.00", cluster="eth")
    eth = Cluster.objects.get(name="eth")
    Cluster.objects.filter(pk=eth.pk).update(interconnect="ethernet", bandwidth_gbps=25)
    for name in ("i1", "i2"):
        make_node(hostname=name, price="2.00", cluster="ib")

    # When a gang asks for at least 100 Gb/s
    body = {
        "gpus_per_node": 8,
        "node_count": 2,
        "min_interconnect_gbps": 100,
        "duration_s": 3600,
        "runtime": {"image": "gpumarket/harness:dev"},
    }
    r = auth_api.post("/api/v1/rentals/", body, format="json")
    assert r.status_code == 201, r.content
    assert r.json()["min_interconnect_gbps"] == 100
    scheduler_cycle_run()

    # Then it is placed on the InfiniBand cluster, not the cheaper Ethernet one
    from marketplace.models import Rental

    assert _members(Rental.objects.get(pk=r.json()["id"])) == {"i1", "i2"}

    # And asking more than any cluster has, or asking it of one node, is a 400 naming the field
    for extra in ({"min_interconnect_gbps": 400}, {"node_count": 1}):
        refused = auth_api.post("/api/v1/rentals/", {**body, **extra}, format="json")
        assert refused.status_code == 400 and "min_interconnect_gbps" in refused.json(), (
            refused.content
        )
    assert Rental.objects.count() == 1
