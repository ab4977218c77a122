"""never_fits: each reason a request is refused at create time, and silence when it fits."""

from __future__ import annotations

from decimal import Decimal

import pytest
from enginekit import NOW, make_node, make_request

from scheduler.engine import never_fits

SPLIT = ["g0"] * 4 + ["g1"] * 4
CLUSTER = (
    make_node(1, price="2.10", min_bid="1.00"),
    make_node(2, price="2.50", min_bid="1.20", region="us-east"),
    make_node(3, groups=SPLIT, model="a100-sxm4-80gb", family="a100", price="1.50"),
)


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"gpus_per_node": 0}, "gpus_per_node and node_count must be at least 1"),
        ({"duration": 0}, "duration must be positive"),
        ({"start": NOW, "start_deadline": NOW - 1}, "start_deadline is before start"),
        ({"interruptible": True}, "an interruptible request needs a positive bid"),
        (
            {"interruptible": True, "bid": Decimal("1.50"), "max_price": Decimal("1.00")},
            "bid $1.50 is above max price $1.00",
        ),
        ({"region": "ap-south"}, "no node in region ap-south (pool default)"),
        ({"pool": "batch"}, "no node in pool batch"),
        ({"gpus_per_node": 16}, "no node in pool default has 16 matching GPUs"),
        (
            {"gpus_per_node": 2, "gpu_models": frozenset({"h200-sxm-141gb"})},
            "no node in pool default has 2 matching GPUs (model h200-sxm-141gb)",
        ),
        (
            {"region": "eu", "min_memory_gb": 100, "min_tensor_tflops": 1000},
            "no node in region eu (pool default) has 1 matching GPUs (>= 100 GB, >= 1000 TFLOPS)",
        ),
        (
            {"gpus_per_node": 8, "same_group": True, "gpu_families": frozenset({"a100"})},
            "no node has 8 matching GPUs (family a100) in one topology group",
        ),
        (
            {"gpu_families": frozenset({"h100"}), "max_price": Decimal("2.00")},
            "price: cheapest matching node is $2.10 > max $2.00",
        ),
        (
            {"interruptible": True, "bid": Decimal("0.50")},
            "bid: $0.50 is below every matching node's minimum bid (lowest $1.00)",
        ),
        (
            {"gpus_per_node": 8, "node_count": 3, "max_price": Decimal("2.20")},
            "only 2 matching nodes, the request needs 3",
        ),
    ],
)
def test_reason_names_the_first_constraint_no_node_meets(fields, reason):
    assert never_fits(make_request(1, **fields), CLUSTER) == reason


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"gpus_per_node": 8, "node_count": 3},
        {"gpus_per_node": 4, "same_group": True, "gpu_families": frozenset({"a100"})},
        {"region": "us", "interruptible": True, "bid": Decimal("1.20")},
        {"start": NOW + 3600, "start_deadline": NOW + 3600},
    ],
)
def test_requests_that_fit_an_idle_cluster_get_no_reason(fields):
    assert never_fits(make_request(1, **fields), CLUSTER) is None
