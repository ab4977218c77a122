"""Each hand-written statement of scheduler/queries.py against the same question asked through
the ORM, on rows made by the real services."""

from __future__ import annotations

import hashlib
import json
from datetime import timedelta

import pytest
from django.db import connection, transaction
from django.db.backends.postgresql.psycopg_any import DateTimeTZRange
from django.utils import timezone

from marketplace.models import Allocation, Gpu, Node, NodeStatus, Rental, RentalStatus
from scheduler import queries
from scheduler.services import scheduler_cycle_run

pytestmark = pytest.mark.django_db

EPOCH = {"created_at", "start_at", "start_deadline"}


def _epoch(value):
    return None if value is None else round(value.timestamp(), 6)


def _rounded(row: tuple) -> tuple:
    """Epoch seconds to the microsecond, as the database stores times."""
    return tuple(round(v, 6) if isinstance(v, float) else v for v in row)


def test_allocations_busy_are_the_unreleased_allocations_the_orm_finds(make_node, rent):
    first, second = make_node(gpus=4), make_node(gpus=4, price="2.00")
    rent(3)
    rent(2)
    scheduler_cycle_run()
    now = timezone.now()
    expected = sorted(
        (
            a.gpu_id,
            a.rental_id,
            _epoch(a.during.lower),
            _epoch(a.during.upper),
            a.rental.kind,
            a.rental.price_per_gpu_hour,
            a.rental.priority,
        )
        for a in Allocation.objects.filter(
            node__in=[first, second], released_at__isnull=True, during__endswith__gt=now
        ).select_related("rental")
    )
    busy = queries.allocations_busy(node_ids=[first.pk, second.pk], now=now)
    assert len(expected) == 5
    assert sorted(_rounded(row) for row in busy) == expected
    assert queries.allocations_busy(node_ids=[second.pk], now=now + timedelta(days=1)) == []


def test_rentals_pending_are_the_orm_s_pending_queue_oldest_first(make_node, rent):
    make_node(gpus=8)
    make_node(gpus=8, region="us-east")
    rent(1)
    scheduler_cycle_run()
    waiting = [rent(4, max_price_per_gpu_hour="3.00"), rent(8), rent(2, region="us-east")]
    rows = queries.rentals_pending(pool="default", pending=RentalStatus.PENDING)
    expected = [
        {name: _epoch(value) if name in EPOCH else value for name, value in row.items()}
        for row in Rental.objects.filter(pool="default", status=RentalStatus.PENDING)
        .order_by("created_at")
        .values(*queries.PENDING_FIELDS)
    ]
    assert [row["id"] for row in rows] == [r.pk for r in waiting]
    assert [
        {k: round(v, 6) if isinstance(v, float) else v for k, v in row.items()} for row in rows
    ] == expected
    limited = queries.rentals_pending(pool="default", pending=RentalStatus.PENDING, limit=2)
    assert [row["id"] for row in limited] == [r.pk for r in waiting[:2]]


def _orm_digest(pool: str) -> tuple[int, str | None]:
    """The digest of what the ORM reads of the pool's online nodes, formatted as PostgreSQL
    writes each value."""

    def text(value) -> str:
        return (
            {True: "t", False: "f"}.get(value, str(value))
            if isinstance(value, bool)
            else str(value)
        )

    nodes = Node.objects.filter(pool=pool, status=NodeStatus.ONLINE).select_related("gpu_model")
    parts = []
    for node in nodes.order_by("id"):
        model = node.gpu_model
        gpus = ",".join(
            f"{g.id}/{g.index}/{g.topology_group}"
            for g in Gpu.objects.filter(node=node).order_by("index")
        )
        values = (
            node.id, node.region, node.price_per_gpu_hour, node.min_bid_per_gpu_hour,
            node.reliability, node.nvlink, node.ssh_capable, node.internet_capable,
            node.cluster_id or 0,
            "*unset*" if node.image_allow is None else " ".join(node.image_allow),
            json.dumps(node.images),
            node.cluster.bandwidth_gbps if node.cluster else 0, model.slug, model.family,
            model.memory_gb, model.tensor_tflops, gpus,
        )  # fmt: skip
        parts.append(":".join(text(v) for v in values))
    if not parts:
        return 0, None
    return len(parts), hashlib.md5(",".join(parts).encode()).hexdigest()


def test_the_inventory_digest_is_the_md5_of_what_the_orm_reads(make_node):
    make_node(gpus=4, group_size=2, nvlink=True)
    accepting = make_node(gpus=2, price="1.50", region="us-east", cluster=None)
    Node.objects.filter(pk=accepting.pk).update(image_allow=["a/*", "b:1"])
    make_node(gpus=2, status=NodeStatus.OFFLINE)
    make_node(gpus=2, pool="other")
    assert queries.inventory_digest(pool="default", online=NodeStatus.ONLINE) == _orm_digest(
        "default"
    )
    assert queries.inventory_digest(pool="none", online=NodeStatus.ONLINE) == (0, None)


def test_candidate_nodes_are_the_orm_s_fitting_nodes_fullest_then_cheapest(make_node, rent):
    nodes = [
        make_node(gpus=8, price="1.00"),
        make_node(gpus=4, price="0.90"),
        make_node(gpus=8, price="0.80", region="us-east"),
        make_node(gpus=2, price="0.50"),
        make_node(gpus=8, price="0.70", status=NodeStatus.OFFLINE),
    ]
    rent(5)
    scheduler_cycle_run()
    start = timezone.now() + timedelta(minutes=1)
    end = start + timedelta(hours=1)
    params = {
        "pool": "default",
        "online": NodeStatus.ONLINE,
        "start": start,
        "end": end,
        "region": "",
        "models": [],
        "families": [],
        "memory": 0,
        "tflops": 0,
        "max_price": None,
        "k": 3,
        "ssh": False,
        "internet": True,
        "limit": 10,
    }

    def free(node: Node) -> int:
        held = (
            Allocation.objects.filter(
                node=node,
                released_at__isnull=True,
                during__overlap=DateTimeTZRange(start, end),
            )
            .values("gpu_id")
            .distinct()
            .count()
        )
        return node.gpu_count - held

    fitting = [
        n
        for n in Node.objects.filter(pool="default", status=NodeStatus.ONLINE)
        if free(n) >= params["k"]
    ]
    expected = [n.pk for n in sorted(fitting, key=lambda n: (free(n), n.price_per_gpu_hour, n.pk))]
    assert queries.candidate_nodes(params=params) == expected
    assert nodes[4].pk not in expected and nodes[3].pk not in expected
    in_us = queries.candidate_nodes(params={**params, "region": "us-east"})
    assert in_us == [n for n in expected if Node.objects.get(pk=n).region == "us-east"]


def test_allocations_copy_writes_the_rows_the_orm_reads_back(make_node, rent):
    node = make_node(gpus=4)
    rental = rent(2)
    gpus = list(Gpu.objects.filter(node=node).order_by("index")[:2])
    start = timezone.now().replace(microsecond=0)
    end = start + timedelta(hours=1)
    during = f"[{start.isoformat()},{end.isoformat()})"
    with transaction.atomic():
        queries.allocations_copy(
            rows=[(str(rental.pk), g.pk, node.pk, during, start) for g in gpus]
        )
    stored = Allocation.objects.filter(rental=rental).order_by("gpu_id")
    assert [
        (a.gpu_id, a.node_id, a.during.lower, a.during.upper, a.created_at) for a in stored
    ] == [(g.pk, node.pk, start, end, start) for g in gpus]


def test_waiting_reasons_change_only_pending_rentals_with_another_reason(make_node, rent):
    make_node(gpus=8)
    placed = rent(1)
    scheduler_cycle_run()
    first, second = rent(4), rent(8)
    Rental.objects.filter(pk=second.pk).update(status_reason="no node has 8 GPUs")
    before = Rental.objects.get(pk=placed.pk).status_reason
    queries.waiting_reasons_set(
        reasons=[
            (str(first.pk), "no node has 4 GPUs"),
            (str(second.pk), "no node has 8 GPUs"),
            (str(placed.pk), "must not be written"),
        ],
        status=RentalStatus.PENDING,
    )
    reasons = dict(Rental.objects.values_list("pk", "status_reason"))
    assert reasons == {
        placed.pk: before,
        first.pk: "no node has 4 GPUs",
        second.pk: "no node has 8 GPUs",
    }


@pytest.mark.django_db(transaction=True)
def test_snapshot_isolation_makes_the_transaction_repeatable_read_and_read_only():
    with transaction.atomic():
        queries.snapshot_isolation_set()
        with connection.cursor() as cursor:
            cursor.execute("SHOW transaction_isolation")
            isolation = cursor.fetchone()[0]
            cursor.execute("SHOW transaction_read_only")
            read_only = cursor.fetchone()[0]
    assert (isolation, read_only) == ("repeatable read", "on")
