"""An agent joins its node into its provider's cluster by name (`--cluster`): the cluster must
exist, or the join says what its fabric is (`--interconnect`, `--interconnect-gbps`) and creates
it. A join that names no cluster is what it always was; a refused join writes nothing."""

from __future__ import annotations

import pytest

from marketplace.models import Cluster, Node
from marketplace.services import cluster_create
from provisioning.models import JoinToken
from tests.factories import ProviderFactory
from tests.provisioning.test_agent_api import HOST, _gpus

pytestmark = pytest.mark.django_db


def _join(api, token: str, hostname: str, **extra):
    gpus = [{**gpu, "uuid": f"{gpu['uuid']}-{hostname}"} for gpu in _gpus(2)]
    body = {
        "join_token": token,
        "hostname": hostname,
        "host": HOST,
        "internet_filtered": True,
        "gpus": gpus,
        **extra,
    }
    return api.post("/api/agent/v1/join/", body, format="json")


def _node(response) -> Node:
    assert response.status_code == 201, response.content
    return Node.objects.select_related("cluster").get(pk=response.json()["node_id"])


def test_the_first_node_creates_the_cluster_and_the_next_joins_it(api, make_join_token, provider):
    # When one agent joins with --cluster ib --interconnect infiniband --interconnect-gbps 400
    # and a second with --cluster ib alone
    first = _node(
        _join(
            api,
            make_join_token(),
            "ib-1",
            cluster="ib",
            interconnect="infiniband",
            interconnect_gbps=400,
        )
    )
    second = _node(_join(api, make_join_token(), "ib-2", cluster="ib"))

    # Then both nodes are in the provider's one cluster "ib", InfiniBand 400 Gb/s
    cluster = Cluster.objects.get()
    assert (cluster.provider_id, cluster.name, cluster.interconnect, cluster.bandwidth_gbps) == (
        provider.pk,
        "ib",
        "infiniband",
        400,
    )
    assert first.cluster_id == second.cluster_id == cluster.pk


def test_a_join_naming_no_cluster_lists_the_node_on_its_own(api, join_token):
    assert _node(_join(api, join_token, "plain")).cluster_id is None


def test_an_existing_cluster_keeps_what_it_was_declared_with(api, join_token, provider):
    declared = cluster_create(
        owner=provider.owner,
        provider_id=provider.pk,
        name="eth",
        interconnect="ethernet",
        bandwidth_gbps=25,
    )
    node = _node(
        _join(api, join_token, "e1", cluster="eth", interconnect="roce", interconnect_gbps=200)
    )
    assert node.cluster_id == declared.pk
    declared.refresh_from_db()
    assert (declared.interconnect, declared.bandwidth_gbps) == ("ethernet", 25)


def test_another_providers_cluster_of_the_same_name_is_not_joined(api, join_token, provider):
    other = ProviderFactory()
    cluster_create(
        owner=other.owner,
        provider_id=other.pk,
        name="ib",
        interconnect="infiniband",
        bandwidth_gbps=400,
    )
    r = _join(api, join_token, "x1", cluster="ib")
    assert r.status_code == 400 and "cluster" in r.json(), r.content
    assert not Node.objects.exists()


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"cluster": "missing"}, "cluster"),
        ({"cluster": "Not A Slug"}, "cluster"),
        ({"cluster": "ib", "interconnect": "infiniband"}, "interconnect_gbps"),
        ({"cluster": "ib", "interconnect_gbps": 400}, "interconnect"),
        ({"cluster": "ib", "interconnect": "token-ring", "interconnect_gbps": 4}, "interconnect"),
        (
            {"cluster": "ib", "interconnect": "ethernet", "interconnect_gbps": 0},
            "interconnect_gbps",
        ),
    ],
)
def test_a_bad_cluster_at_join_is_400_naming_the_field_and_writes_nothing(
    api, join_token, extra, field
):
    r = _join(api, join_token, "bad", **extra)
    assert r.status_code == 400 and field in r.json(), r.content
    assert not Node.objects.exists() and not Cluster.objects.exists()
    assert JoinToken.objects.get().used_at is None


def test_a_rejoin_naming_a_cluster_moves_the_node_and_one_naming_none_keeps_it(
    api, make_join_token
):
    node = _node(
        _join(
            api,
            make_join_token(),
            "re",
            cluster="one",
            interconnect="ethernet",
            interconnect_gbps=100,
        )
    )
    same = _node(_join(api, make_join_token(), "re"))
    assert (same.pk, same.cluster.name) == (node.pk, "one")
    moved = _node(
        _join(
            api,
            make_join_token(),
            "re",
            cluster="two",
            interconnect="ethernet",
            interconnect_gbps=100,
        )
    )
    assert (moved.pk, moved.cluster.name) == (node.pk, "two")
