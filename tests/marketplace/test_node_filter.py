"""The refusal check's node query (selectors.engine_nodes_cheapest, one hand-written statement)
against the same filters written with the ORM, over a small inventory of every kind."""

from decimal import Decimal

import pytest
from django.db.models import Q

from marketplace.models import Node
from marketplace.selectors import NodeFilter, engine_nodes_cheapest

pytestmark = pytest.mark.django_db


def _orm(f: NodeFilter, limit: int) -> list[int]:
    nodes = Node.objects.filter(pool=f.pool)
    if f.region:
        nodes = nodes.filter(Q(region=f.region) | Q(region__startswith=f"{f.region}-"))
    if f.gpu_models:
        nodes = nodes.filter(gpu_model__slug__in=f.gpu_models)
    if f.gpu_families:
        nodes = nodes.filter(gpu_model__family__in=f.gpu_families)
    nodes = nodes.filter(
        gpu_model__memory_gb__gte=f.min_memory_gb,
        gpu_model__tensor_tflops__gte=f.min_tensor_tflops,
        gpu_count__gte=f.min_gpus,
    )
    if f.max_min_bid is not None:
        nodes = nodes.filter(min_bid_per_gpu_hour__lte=f.max_min_bid)
    if f.max_price is not None:
        nodes = nodes.filter(price_per_gpu_hour__lte=f.max_price)
    if f.ssh:
        nodes = nodes.filter(ssh_capable=True)
    return list(nodes.order_by("price_per_gpu_hour", "id").values_list("id", flat=True)[:limit])


@pytest.fixture
def inventory(make_node):
    made = [
        make_node(card="h100-sxm5-80gb", gpus=8, price="2.50", region="eu-west", nvlink=True),
        make_node(card="h100-sxm5-80gb", gpus=4, price="2.10", region="eu", min_bid="0.90"),
        make_node(card="a100-sxm4-80gb", gpus=8, price="1.40", region="us-east", group_size=4),
        make_node(card="a100-sxm4-80gb", gpus=2, price="1.40", region="eu_x"),
        make_node(card="rtx4090-24gb", gpus=1, price="0.40", region="euxw-1"),
        make_node(card="v100-sxm2-32gb", gpus=8, price="0.90", region="eu-north", pool="batch"),
        make_node(card="h100-sxm5-80gb", gpus=8, price="1.90", region="eu-west"),
    ]
    # The cheapest eu H100 node's agent runs rentals as local processes: no SSH.
    Node.objects.filter(pk=made[-1].pk).update(runtime="process", ssh_capable=False)
    return made


@pytest.mark.parametrize(
    "nodes",
    [
        NodeFilter(pool="default"),
        NodeFilter(pool="batch"),
        NodeFilter(pool="nowhere"),
        NodeFilter(pool="default", region="eu"),
        NodeFilter(pool="default", region="eu-west"),
        NodeFilter(pool="default", region="e_"),  # an underscore is a letter here, not a wildcard
        NodeFilter(pool="default", region="eu_x"),
        NodeFilter(pool="default", region="%"),
        NodeFilter(pool="default", gpu_models=("h100-sxm5-80gb", "rtx4090-24gb")),
        NodeFilter(pool="default", gpu_families=("a100",)),
        NodeFilter(pool="default", min_memory_gb=40),
        NodeFilter(pool="default", min_tensor_tflops=Decimal("500")),
        NodeFilter(pool="default", min_gpus=4),
        NodeFilter(pool="default", min_gpus=9),
        NodeFilter(pool="default", max_price=Decimal("1.40")),
        NodeFilter(pool="default", max_min_bid=Decimal("0.90")),
        NodeFilter(pool="default", region="eu", gpu_families=("h100",), min_gpus=4,
                   max_price=Decimal("2.20")),
        NodeFilter(pool="default", ssh=True),
        NodeFilter(pool="default", region="eu", gpu_families=("h100",), ssh=True),
    ],
)  # fmt: skip
def test_the_statement_picks_what_the_orm_picks_cheapest_first(inventory, nodes):
    for limit in (1, 2, 256):
        found = engine_nodes_cheapest(nodes, limit=limit)
        assert [n.node_id for n in found] == _orm(nodes, limit)


def test_each_node_comes_with_its_gpus_and_listing(inventory):
    node = inventory[2]
    (found,) = engine_nodes_cheapest(NodeFilter(pool="default", region="us"), limit=5)
    assert (found.node_id, found.region, found.pool) == (node.pk, "us-east", "default")
    assert (found.price_per_gpu_hour, found.min_bid) == (Decimal("1.40"), Decimal("0.70"))
    assert [g.index for g in found.gpus] == list(range(8))
    assert [g.gpu_id for g in found.gpus] == list(
        node.gpus.order_by("index").values_list("pk", flat=True)
    )
    assert {g.group for g in found.gpus[:4]} != {g.group for g in found.gpus[4:]}
    assert {(g.model, g.family, g.memory_gb) for g in found.gpus} == {
        ("a100-sxm4-80gb", "a100", 80)
    }


def test_each_node_says_whether_it_can_give_ssh(inventory):
    found = engine_nodes_cheapest(NodeFilter(pool="default", gpu_families=("h100",)), limit=5)
    assert [(n.node_id, n.ssh_capable) for n in found] == [
        (inventory[-1].pk, False), (inventory[1].pk, True), (inventory[0].pk, True)
    ]  # fmt: skip
