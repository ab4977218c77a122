"""Each hand-written statement of provisioning/queries.py against the same question asked
through the ORM, on rows made by the real services."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from marketplace import lifecycle
from marketplace.models import Allocation, Gpu, GpuHealth, Node, NodeStatus, Rental
from marketplace.services.rentals import RentalRequest, RuntimeSpec, rental_create
from provisioning import queries
from provisioning.models import NodeCredential
from scheduler.services import scheduler_cycle_run
from tests.factories import personal_team

HEALTH = (GpuHealth.OK.value, GpuHealth.DEGRADED.value, GpuHealth.FAILED.value)

pytestmark = pytest.mark.django_db

WANTED = [str(s) for s in lifecycle.CONTAINER_WANTED]


def _credential(node: Node, key: str) -> str:
    key_hash = key * 64
    NodeCredential.objects.create(node=node, key_hash=key_hash)
    return key_hash


def _fields(obj) -> dict:
    return {f.attname: getattr(obj, f.attname) for f in obj._meta.concrete_fields}


def _placed(user, *, gpus: int) -> Rental:
    rental = rental_create(
        customer=user,
        team=personal_team(user),
        request=RentalRequest(
            gpus_per_node=gpus,
            node_count=1,
            duration_s=7200,
            runtime=RuntimeSpec(image="gpumarket/harness:dev"),
        ),
    )
    scheduler_cycle_run(pool=rental.pool)
    return Rental.objects.get(pk=rental.pk)


def _orm_held(node: Node, now) -> list[tuple]:
    return list(
        Allocation.objects.filter(
            node=node, released_at__isnull=True, during__contains=now, rental__status__in=WANTED
        )
        .order_by("rental_id", "gpu__index")
        .values_list("rental_id", "gpu__index", "gpu__uuid")
    )


def test_gpus_held_are_the_allocations_the_orm_finds(make_node, user):
    node = make_node(gpus=8)
    first = _placed(user, gpus=3)
    second = _placed(user, gpus=2)
    now = max(first.scheduled_start, second.scheduled_start) + timedelta(minutes=1)
    held = queries.gpus_held(node_id=node.pk, now=now, statuses=WANTED)
    assert held == _orm_held(node, now)
    assert len(held) == 5
    assert queries.gpus_held(node_id=node.pk, now=now, statuses=["running"]) == []


def test_an_idle_heartbeat_marks_the_node_seen_and_says_what_the_orm_says_it_holds(make_node, user):
    # Given a busy node (the cheaper one, where the rental is placed) and an idle one
    idle, busy = make_node(gpus=8, price="9.00"), make_node(gpus=8)
    idle_hash, busy_hash = _credential(idle, "a"), _credential(busy, "b")
    # and a throttled GPU on the idle one
    Gpu.objects.filter(node=idle, index=3).update(health=GpuHealth.DEGRADED)
    Gpu.objects.filter(node=idle, index__in=[5, 1]).update(health=GpuHealth.FAILED)
    rental = _placed(user, gpus=8)
    assert Allocation.objects.filter(rental=rental, node=busy).exists()
    now = rental.scheduled_start + timedelta(minutes=1)
    for node, key_hash in ((idle, idle_hash), (busy, busy_hash)):
        node_id, seen, benchmark, holds, degraded, failed = queries.idle_heartbeat(
            key_hash=key_hash, now=now, offline=NodeStatus.OFFLINE.value, statuses=WANTED,
            health=HEALTH,
        )  # fmt: skip
        stored = Node.objects.get(pk=node.pk)
        assert (node_id, seen, benchmark, holds, degraded, failed) == (
            node.pk,
            True,
            stored.benchmark_requested,
            bool(_orm_held(node, now)),
            Gpu.objects.filter(node=node, health=GpuHealth.DEGRADED).exists(),
            list(
                Gpu.objects.filter(node=node, health=GpuHealth.FAILED)
                .order_by("index")
                .values_list("index", flat=True)
            ),
        )
        assert stored.last_seen_at == now
    assert holds and not degraded


def test_an_idle_heartbeat_leaves_an_offline_node_and_refuses_an_unknown_token(make_node):
    node = make_node(gpus=8, status=NodeStatus.OFFLINE)
    key_hash = _credential(node, "c")
    before = Node.objects.get(pk=node.pk).last_seen_at
    now = timezone.now()
    assert queries.idle_heartbeat(
        key_hash=key_hash, now=now, offline=NodeStatus.OFFLINE.value, statuses=WANTED,
        health=HEALTH,
    ) == (node.pk, False, None, False, False, [])  # fmt: skip
    assert Node.objects.get(pk=node.pk).last_seen_at == before
    NodeCredential.objects.filter(node=node).update(revoked_at=now)
    for unknown in (key_hash, "d" * 64):
        assert (
            queries.idle_heartbeat(
                key_hash=unknown,
                now=now,
                offline=NodeStatus.OFFLINE.value,
                statuses=WANTED,
                health=HEALTH,
            )
            is None
        )


def test_node_by_token_reads_the_node_the_orm_reads(make_node):
    node = make_node(gpus=4)
    key_hash = _credential(node, "e")
    found = queries.node_by_token(key_hash=key_hash)
    assert _fields(found) == _fields(
        Node.objects.get(credentials__key_hash=key_hash, credentials__revoked_at__isnull=True)
    )
    NodeCredential.objects.filter(node=node).update(revoked_at=timezone.now())
    assert queries.node_by_token(key_hash=key_hash) is None
