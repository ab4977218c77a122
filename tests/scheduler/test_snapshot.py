"""The snapshot a cycle plans on: what it reads, and that a worker's kept copy of the inventory
never hides a change the engine would see."""

from datetime import timedelta
from decimal import Decimal

import pytest
from django.utils import timezone

from marketplace.models import Gpu, GpuModel, Node, NodeStatus
from marketplace.services import node_set_maintenance
from scheduler.services import scheduler_cycle_run, snapshot_take

pytestmark = pytest.mark.django_db


def _take():
    return snapshot_take(pool="default", now=timezone.now())


def test_the_snapshot_holds_nodes_busy_gpus_and_the_queue_with_epoch_times(make_node, rent):
    node = make_node(gpus=4, price="1.25", group_size=2)
    held = rent(2)
    scheduler_cycle_run()
    waiting = rent(4)
    snap = _take()
    (engine_node,) = snap.nodes
    assert engine_node.node_id == node.pk and engine_node.price_per_gpu_hour == Decimal("1.25")
    assert [g.group for g in engine_node.gpus] == ["g0", "g0", "g1", "g1"]
    assert sorted(b.rental_id for b in snap.busy) == [held.pk, held.pk]
    busy = snap.busy[0]
    held.refresh_from_db()
    assert busy.start == pytest.approx(held.scheduled_start.timestamp(), abs=1e-5)
    assert busy.end == pytest.approx(held.scheduled_end.timestamp(), abs=1e-5)
    (request,) = snap.pending
    assert request.rental_id == waiting.pk and request.gpus_per_node == 4
    assert request.created_at == pytest.approx(waiting.created_at.timestamp(), abs=1e-5)
    assert request.start_deadline == pytest.approx(waiting.start_deadline.timestamp(), abs=1e-5)


# Committed writes, as in production: outside a transaction the worker keeps the inventory.
@pytest.mark.django_db(transaction=True)
def test_every_change_the_engine_reads_reaches_the_next_snapshot(make_node):
    node = make_node(gpus=2, price="1.00")
    other = make_node(gpus=2, price="2.00")
    assert [n.price_per_gpu_hour for n in _take().nodes] == [Decimal("1.00"), Decimal("2.00")]
    assert _take().nodes is _take().nodes  # unchanged: the kept inventory, not read again
    # a price
    Node.objects.filter(pk=node.pk).update(price_per_gpu_hour=Decimal("0.90"))
    assert _take().nodes[0].price_per_gpu_hour == Decimal("0.90")
    # reliability and NVLink
    Node.objects.filter(pk=node.pk).update(reliability=Decimal("0.5"), nvlink=True)
    first = _take().nodes[0]
    assert (first.reliability, first.gpus[0].nvlink) == (0.5, True)
    # a GPU's topology group
    Gpu.objects.filter(node=node, index=1).update(topology_group="other")
    assert [g.group for g in _take().nodes[0].gpus] == ["g0", "other"]
    # the catalog's figures for the card
    GpuModel.objects.filter(slug="a100-sxm4-80gb").update(tensor_tflops=Decimal("300"))
    assert {g.tensor_tflops for n in _take().nodes for g in n.gpus} == {300.0}
    # a node leaving the pool's online set, and coming back
    node_set_maintenance(node_id=other.pk, actor=None, reason="test")
    assert [n.node_id for n in _take().nodes] == [node.pk]
    Node.objects.filter(pk=other.pk).update(status=NodeStatus.ONLINE, pool="elsewhere")
    assert [n.node_id for n in _take().nodes] == [node.pk]
    assert [n.node_id for n in snapshot_take(pool="elsewhere", now=timezone.now()).nodes] == [
        other.pk
    ]


def test_a_busy_gpu_whose_booking_has_ended_is_not_in_the_snapshot(make_node, rent):
    make_node(gpus=1)
    rent(1, duration_s=60)
    scheduler_cycle_run()
    assert len(_take().busy) == 1
    later = timezone.now() + timedelta(minutes=2)
    assert snapshot_take(pool="default", now=later).busy == ()
