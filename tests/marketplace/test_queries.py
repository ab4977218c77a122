"""Each hand-written statement of marketplace/queries.py against the same question asked through
the ORM, on rows made by the real services."""

from __future__ import annotations

import re
from datetime import timedelta
from decimal import Decimal

import pytest
from django.db import connection
from django.utils import timezone
from psycopg import sql as psql

from marketplace import queries
from marketplace.models import Allocation, Gpu, Node, NodeStatus, Rental, RentalEvent, RentalStatus
from marketplace.selectors import MEASURED_TFLOPS_MAX_SHARE, MEASURED_TFLOPS_MIN_SHARE, OfferFilters
from scheduler.services import scheduler_cycle_run

pytestmark = pytest.mark.django_db

SHARES = (MEASURED_TFLOPS_MIN_SHARE, MEASURED_TFLOPS_MAX_SHARE)


def _fields(obj) -> dict:
    return {f.attname: getattr(obj, f.attname) for f in obj._meta.concrete_fields}


def _orm_free(node: Node) -> int:
    now = timezone.now()
    held = Allocation.objects.filter(node=node, released_at__isnull=True, during__contains=now)
    return node.gpu_count - held.count()


@pytest.fixture
def market(make_node, rent):
    """Five nodes of two regions and prices, one offline, with some GPUs rented."""
    nodes = [
        make_node(gpus=8, price="1.00"),
        make_node(gpus=4, price="0.90", region="us-east", cluster=None),
        make_node(gpus=8, price="0.80", region="us-east"),
        make_node(gpus=2, price="0.50"),
        make_node(gpus=8, price="0.70", status=NodeStatus.OFFLINE),
    ]
    rent(2)
    rent(8)
    scheduler_cycle_run()
    return nodes


@pytest.mark.parametrize(
    ("filters", "orm"),
    [
        (OfferFilters(), {}),
        (OfferFilters(region="us-east", ordering="-free_gpus"), {"region": "us-east"}),
        (OfferFilters(min_free_gpus=3, max_price=Decimal("0.95")), {"price__lte": "0.95"}),
    ],
    ids=["all", "region-by-free", "free-and-price"],
)
# Committed rows: the statement reads "now" as its transaction's start, as each request does.
@pytest.mark.django_db(transaction=True)
def test_offers_are_the_online_nodes_with_free_gpus_the_orm_counts(market, filters, orm):
    rows = queries.offers(filters=filters, limit=50, offset=0, shares=SHARES)
    orm = {k.replace("price__", "price_per_gpu_hour__"): v for k, v in orm.items()}
    nodes = Node.objects.filter(status=NodeStatus.ONLINE, **orm)
    wanted = filters.min_free_gpus or 1
    free = {n.pk: _orm_free(n) for n in nodes if _orm_free(n) >= wanted}
    by_price = sorted(free, key=lambda pk: (Node.objects.get(pk=pk).price_per_gpu_hour, pk))
    if filters.ordering == "-free_gpus":
        expected = sorted(
            free, key=lambda pk: (-free[pk], Node.objects.get(pk=pk).price_per_gpu_hour, pk)
        )
    else:
        expected = by_price
    assert [r["node_id"] for r in rows] == expected
    assert {r["node_id"]: r["free_gpus"] for r in rows} == free
    for row in rows:
        node = Node.objects.select_related("gpu_model", "provider").get(pk=row["node_id"])
        assert (row["hostname"], row["provider"], row["gpu_model"], row["price_per_gpu_hour"]) == (
            node.hostname,
            node.provider.name,
            node.gpu_model.slug,
            node.price_per_gpu_hour,
        )
        cluster = node.cluster
        assert (row["cluster_id"], row["interconnect"], row["interconnect_gbps"]) == (
            (cluster.pk, cluster.interconnect, cluster.bandwidth_gbps) if cluster else (None,) * 3
        )
        online = Node.objects.filter(cluster=cluster, status=NodeStatus.ONLINE).count()
        assert row["cluster_nodes"] == (online if cluster else None)


def test_nodes_cheapest_are_the_orm_s_matching_nodes_cheapest_first(market):
    params = {
        "pool": "default",
        "region": "us",
        "zones": "us-%",
        "models": [],
        "families": [],
        "memory": 0,
        "tflops": 0,
        "gpus": 4,
        "bid": None,
        "price": Decimal("0.95"),
        "ssh": False,
        "internet": True,
        "clustered": False,
        "gbps": 0,
        "limit": 10,
    }
    rows = queries.nodes_cheapest(params=params)
    expected = Node.objects.filter(
        pool="default", region__startswith="us-", gpu_count__gte=4, price_per_gpu_hour__lte="0.95"
    ).order_by("price_per_gpu_hour", "id")
    assert [row[0] for row in rows] == [n.pk for n in expected]
    for row, node in zip(rows, expected, strict=True):
        gpus = Gpu.objects.filter(node=node).order_by("index")
        assert row[: len(queries.NODE_COLUMNS) + 1] == (
            *(getattr(node, Node._meta.get_field(name).attname) for name in queries.NODE_COLUMNS),
            node.cluster.bandwidth_gbps if node.cluster else None,
        )
        assert row[-3:] == (
            [g.pk for g in gpus],
            [g.index for g in gpus],
            [g.topology_group for g in gpus],
        )


def _generic_plan(sql: str, params: dict) -> dict:
    """PostgreSQL's generic plan of `sql` (what it keeps for a statement prepared and run more
    than five times, as the create path's are), as EXPLAIN's JSON."""
    names: list[str] = []

    def number(match: re.Match) -> str:
        if match[1] not in names:
            names.append(match[1])
        return f"${names.index(match[1]) + 1}"

    numbered = re.sub(r"%\((\w+)\)s", number, sql)
    with connection.cursor() as cursor:
        cursor.execute("SET LOCAL plan_cache_mode = force_generic_plan")
        cursor.execute(f"PREPARE generic_plan AS {numbered}")
        args = psql.SQL(", ").join(psql.Literal(params[name]) for name in names)
        explain = psql.SQL("EXPLAIN (FORMAT JSON) EXECUTE generic_plan({})").format(args)
        cursor.execute(explain.as_string(cursor.cursor))
        (plan,) = cursor.fetchone()[0]
        cursor.execute("DEALLOCATE generic_plan")
    return plan["Plan"]


def _plan_nodes(plan: dict):
    yield plan
    for child in plan.get("Plans", ()):
        yield from _plan_nodes(child)


def _nodes_cloned(node: Node, count: int) -> None:
    """`count` more listings like `node` (no GPUs: the plan is the question), then the table's
    statistics, as a marketplace of that many nodes would have them."""
    columns = [f.column for f in Node._meta.concrete_fields if f.name not in ("id", "hostname")]
    names = ", ".join(connection.ops.quote_name(c) for c in columns)
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {Node._meta.db_table} (hostname, {names})"
            f" SELECT 'clone-' || i, {names} FROM {Node._meta.db_table},"
            " generate_series(1, %s) i WHERE id = %s",
            [count, node.pk],
        )
        cursor.execute(f"ANALYZE {Node._meta.db_table}")


@pytest.mark.parametrize(
    "given",
    [
        {},
        {"price": Decimal("0.95")},
        {"region": "us", "zones": "us-%", "internet": True},
        {"families": ["a100"], "memory": 40, "ssh": True},
    ],
)
def test_the_refusal_check_s_generic_plan_reads_nodes_in_price_order(market, given):
    """Every create runs the refusal check's statement; prepared, PostgreSQL plans it once for
    any parameters. Its plan reads the pool's price index up to the limit, never every node of
    the pool sorted (which an optional filter written `(%(price)s IS NULL OR ...)` made it
    choose: 3-4 ms a create at 1,000 nodes, growing with the pool)."""
    _nodes_cloned(market[0], 2000)
    params = {
        "pool": "default", "region": "", "zones": "-%", "models": [], "families": [],
        "memory": 0, "tflops": 0, "gpus": 1, "bid": None, "price": None, "ssh": False,
        "internet": False, "clustered": False, "gbps": 0, "limit": 4, **given,
    }  # fmt: skip
    plan = _generic_plan(*queries.nodes_cheapest_statement(params=params))
    steps = list(_plan_nodes(plan))
    assert not [s for s in steps if s["Node Type"] == "Sort" and "price" in str(s["Sort Key"])]
    assert {"Index Scan", "node_pool_cheapest"} <= {
        value for s in steps for value in (s["Node Type"], s.get("Index Name"))
    }
    assert queries.nodes_cheapest(params=params)  # and the statement runs


def test_schedule_latencies_are_the_orm_s_create_to_first_scheduled(make_node, rent):
    make_node(gpus=8)
    rentals = [rent(1), rent(2), rent(1)]
    scheduler_cycle_run()
    since = timezone.now() - timedelta(minutes=15)
    buckets = (0.05, 1.0, 60.0)
    latencies = []
    for rental in Rental.objects.filter(pk__in=[r.pk for r in rentals]):
        first = (
            RentalEvent.objects.filter(rental=rental, to_status=RentalStatus.SCHEDULED)
            .order_by("created_at")
            .first()
        )
        latencies.append((first.created_at - rental.created_at).total_seconds())
    cumulative, total, total_sum = queries.schedule_latencies(
        buckets=buckets, last_events=1000, status=RentalStatus.SCHEDULED, since=since
    )
    assert cumulative == [sum(lat <= b for lat in latencies) for b in buckets]
    assert total == 3
    assert total_sum == pytest.approx(sum(latencies), abs=1e-6)
    assert queries.schedule_latencies(
        buckets=buckets, last_events=1000, status=RentalStatus.RUNNING, since=since
    ) == ([0, 0, 0], 0, 0.0)
