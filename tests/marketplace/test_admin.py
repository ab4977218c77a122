"""The ops console: staff only; node actions recorded with who and when."""

import pytest
from django.forms.models import model_to_dict
from django.test import Client
from django.urls import reverse

from marketplace.admin import NodeAdminForm
from marketplace.models import Gpu, GpuHealthEvent, NodeEvent, NodeStatus
from marketplace.services import cluster_create
from tests.factories import ProviderFactory, UserFactory

pytestmark = pytest.mark.django_db


@pytest.fixture
def ops_client():
    ops = UserFactory(is_staff=True, is_superuser=True)
    client = Client()
    client.force_login(ops)
    return client, ops


def _act(client, action, nodes):
    return client.post(
        reverse("admin:marketplace_node_changelist"),
        {"action": action, "_selected_action": [n.pk for n in nodes]},
        follow=True,
    )


def test_admin_is_staff_only(make_node):
    client = Client()
    client.force_login(UserFactory())
    r = client.get(reverse("admin:marketplace_node_changelist"))
    assert r.status_code == 302
    assert "/admin/login/" in r["Location"]


def test_node_changelist_shows_gpu_counts_by_model(ops_client, make_node):
    client, _ = ops_client
    make_node(card="h100-sxm5-80gb", gpus=8, hostname="fra-1")
    r = client.get(reverse("admin:marketplace_node_changelist"), {"q": "fra-1"})
    assert r.status_code == 200
    assert b"8x H100 SXM5 80 GB" in r.content


def test_drain_maintenance_online_are_recorded_with_actor(ops_client, make_node):
    client, ops = ops_client
    a, b = make_node(), make_node()
    assert _act(client, "node_drain", [a, b]).status_code == 200
    a.refresh_from_db()
    b.refresh_from_db()
    assert (a.status, b.status) == (NodeStatus.DRAINING, NodeStatus.DRAINING)
    _act(client, "node_maintenance", [a])
    _act(client, "node_online", [a])
    events = list(NodeEvent.objects.filter(node=a).order_by("id"))
    assert [(e.from_status, e.to_status) for e in events] == [
        (NodeStatus.ONLINE, NodeStatus.DRAINING),
        (NodeStatus.DRAINING, NodeStatus.MAINTENANCE),
        (NodeStatus.MAINTENANCE, NodeStatus.ONLINE),
    ]
    assert all(e.actor == ops and e.created_at is not None for e in events)


def test_refused_action_changes_nothing(ops_client, make_node):
    client, _ = ops_client
    node = make_node(status=NodeStatus.MAINTENANCE)
    r = _act(client, "node_drain", [node])
    assert b"cannot drain a node that is maintenance" in r.content
    node.refresh_from_db()
    assert node.status == NodeStatus.MAINTENANCE
    assert not NodeEvent.objects.filter(node=node).exists()


def test_ops_can_ask_for_a_new_benchmark(ops_client, make_node):
    client, _ = ops_client
    node = make_node()
    assert node.benchmark_requested is False
    _act(client, "request_benchmark", [node])
    node.refresh_from_db()
    assert node.benchmark_requested is True


def test_ops_see_clusters_and_cannot_put_a_node_in_another_providers(ops_client, make_node):
    client, _ = ops_client
    node = make_node(hostname="ib-1", cluster="h100-ib")
    r = client.get(reverse("admin:marketplace_cluster_change", args=[node.cluster_id]))
    assert r.status_code == 200 and b"ib-1" in r.content
    other = ProviderFactory()
    foreign = cluster_create(
        owner=other.owner,
        provider_id=other.pk,
        name="theirs",
        interconnect="ethernet",
        bandwidth_gbps=25,
    )
    form = NodeAdminForm(data={**model_to_dict(node), "cluster": foreign.pk}, instance=node)
    assert not form.is_valid()
    assert form.errors["cluster"] == ["a cluster of the node's own provider"]
    node.refresh_from_db()
    assert node.cluster.name == "h100-ib"


def test_ops_see_gpu_health_and_its_history_and_can_ask_for_the_check(ops_client, make_node):
    # given a node whose GPU 2 failed (Xid 79) and GPU 5 runs throttled
    client, _ = ops_client
    node = make_node(card="h100-sxm5-80gb", gpus=8, hostname="fra-9")
    gpu = node.gpus.get(index=2)
    GpuHealthEvent.objects.create(gpu=gpu, node=node, from_health="ok", to_health="failed",
                                  reason="Xid 79")  # fmt: skip
    Gpu.objects.filter(pk=gpu.pk).update(health="failed", health_reason="Xid 79")
    Gpu.objects.filter(node=node, index=5).update(health="degraded", health_reason="power brake")
    # then the node list says so, and filters by it
    r = client.get(reverse("admin:marketplace_node_changelist"), {"gpus__health": "failed"})
    assert "8x H100 SXM5 80 GB (GPU 2 failed, GPU 5 degraded)" in r.content.decode()
    # the history is there, read-only
    r = client.get(reverse("admin:marketplace_gpuhealthevent_changelist"))
    assert r.status_code == 200 and "Xid 79" in r.content.decode()
    assert client.get(reverse("admin:marketplace_gpuhealthevent_add")).status_code == 403
    # and "Benchmark again" asks for the check that may bring GPU 2 back
    _act(client, "request_benchmark", [node])
    node.refresh_from_db()
    assert node.benchmark_requested is True
