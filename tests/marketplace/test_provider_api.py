"""The provider's side: its nodes, what is rented, prices for new bookings, drain and relist."""

from __future__ import annotations

from decimal import Decimal

import pytest
from rest_framework.test import APIClient

from marketplace.models import Node, NodeEvent, NodeStatus
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


def test_an_owner_sees_its_providers_and_nodes_with_what_is_rented(
    owner_api, stranger_api, provider, make_node, rent
):
    node = make_node(gpus=8, hostname="gpu-a")
    ProviderFactory()  # someone else's
    rent(2)
    scheduler_cycle_run()
    assert owner_api.get("/api/v1/providers/").json() == [
        {"id": provider.pk, "name": provider.name}
    ]
    rows = owner_api.get(f"/api/v1/providers/{provider.pk}/nodes/").json()
    assert [(r["id"], r["hostname"], r["gpu_count"], r["rented_gpus"]) for r in rows] == [
        (node.pk, "gpu-a", 8, 2)
    ]
    assert stranger_api.get("/api/v1/providers/").json() == []
    assert stranger_api.get(f"/api/v1/providers/{provider.pk}/nodes/").status_code == 404


def test_a_new_price_applies_to_new_bookings_and_booked_rentals_keep_theirs(
    owner_api, make_node, rent
):
    node = make_node(gpus=4, price="1.00")
    booked = rent(1)
    scheduler_cycle_run()
    r = owner_api.patch(
        f"/api/v1/providers/nodes/{node.pk}/",
        {"price_per_gpu_hour": "1.80", "min_bid_per_gpu_hour": "0.90"},
        format="json",
    )
    assert r.status_code == 200, r.content
    assert (r.json()["price_per_gpu_hour"], r.json()["min_bid_per_gpu_hour"]) == (
        "1.8000",
        "0.9000",
    )
    later = rent(1)
    scheduler_cycle_run()
    booked.refresh_from_db()
    later.refresh_from_db()
    assert (booked.price_per_gpu_hour, later.price_per_gpu_hour) == (
        Decimal("1.0000"),
        Decimal("1.8000"),
    )


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"price_per_gpu_hour": "0"}, "price_per_gpu_hour"),
        ({"price_per_gpu_hour": "cheap"}, "price_per_gpu_hour"),
        ({"min_bid_per_gpu_hour": "5.00"}, "min_bid_per_gpu_hour"),  # above the price
        ({"price_per_gpu_hour": "0.50"}, "price_per_gpu_hour"),  # below the minimum bid
        ({"colour": "red"}, "colour"),
        ({}, "price_per_gpu_hour"),
    ],
)
def test_a_bad_price_is_400_naming_the_field_and_changes_nothing(owner_api, make_node, body, field):
    node = make_node(price="2.00", min_bid="1.00")
    r = owner_api.patch(f"/api/v1/providers/nodes/{node.pk}/", body, format="json")
    assert r.status_code == 400 and field in r.json(), r.content
    node.refresh_from_db()
    assert (node.price_per_gpu_hour, node.min_bid_per_gpu_hour) == (
        Decimal("2.0000"),
        Decimal("1.0000"),
    )


def test_another_owners_node_is_404_and_unchanged(stranger_api, make_node):
    node = make_node(price="2.00")
    r = stranger_api.patch(
        f"/api/v1/providers/nodes/{node.pk}/", {"price_per_gpu_hour": "0.01"}, format="json"
    )
    assert r.status_code == 404
    r = stranger_api.post(
        f"/api/v1/providers/nodes/{node.pk}/action/", {"action": "drain"}, format="json"
    )
    assert r.status_code == 404
    node.refresh_from_db()
    assert (node.price_per_gpu_hour, node.status) == (Decimal("2.0000"), NodeStatus.ONLINE)


def _heard_from(node) -> None:
    from django.utils import timezone

    Node.objects.filter(pk=node.pk).update(last_seen_at=timezone.now())


def test_drain_unlists_the_node_and_online_lists_it_again(owner_api, api, provider, make_node):
    node = make_node(hostname="gpu-b")
    _heard_from(node)

    def listed() -> bool:
        return any(o["node_id"] == node.pk for o in api.get("/api/v1/offers/").json()["results"])

    assert listed()
    r = owner_api.post(
        f"/api/v1/providers/nodes/{node.pk}/action/",
        {"action": "drain", "reason": "disk swap"},
        format="json",
    )
    assert (r.status_code, r.json()["status"]) == (200, NodeStatus.DRAINING)
    assert not listed()
    event = NodeEvent.objects.filter(node=node).latest("id")
    assert (event.to_status, event.actor, event.reason) == (
        NodeStatus.DRAINING,
        provider.owner,
        "disk swap",
    )
    r = owner_api.post(
        f"/api/v1/providers/nodes/{node.pk}/action/", {"action": "online"}, format="json"
    )
    assert (r.status_code, r.json()["status"]) == (200, NodeStatus.ONLINE)
    assert listed()


def _act(client, node, action):
    return client.post(
        f"/api/v1/providers/nodes/{node.pk}/action/", {"action": action}, format="json"
    )


def test_only_the_agent_brings_an_offline_node_online(owner_api, make_node):
    node = make_node(status=NodeStatus.OFFLINE)
    events = NodeEvent.objects.count()
    # neither directly, nor by way of maintenance
    for action in ("online", "maintenance"):
        r = _act(owner_api, node, action)
        assert r.status_code == 409 and "action" in r.json()
    assert Node.objects.get(pk=node.pk).status == NodeStatus.OFFLINE
    assert NodeEvent.objects.count() == events


def test_a_drained_node_whose_agent_is_silent_is_not_listed_again(owner_api, make_node):
    node = make_node()
    assert _act(owner_api, node, "drain").status_code == 200  # never heard from
    r = _act(owner_api, node, "online")
    assert r.status_code == 409 and "not been heard from" in r.json()["action"][0]
    assert Node.objects.get(pk=node.pk).status == NodeStatus.DRAINING


def test_maintenance_waits_for_the_rentals_on_the_node(owner_api, make_node, rent):
    node = make_node(gpus=2)
    rent(1)
    scheduler_cycle_run()
    r = _act(owner_api, node, "maintenance")
    assert r.status_code == 409 and "drain" in r.json()["action"][0]
    assert Node.objects.get(pk=node.pk).status == NodeStatus.ONLINE
    assert _act(owner_api, node, "drain").status_code == 200
    r = owner_api.post(
        f"/api/v1/providers/nodes/{node.pk}/action/", {"action": "reboot"}, format="json"
    )
    assert r.status_code == 400 and "action" in r.json()
