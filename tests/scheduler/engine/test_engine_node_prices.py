"""Prices are per node: nodes that differ only in price or minimum bid share a class, and a
request's price constraint is checked node by node inside it.

The scenarios compute their decisions by hand. The seeded clusters below give every node its
own price and minimum bid; their plans were recorded with price and minimum bid in the class key
(one class per price point), so any decision that depends on how nodes are grouped shows up as
a changed digest.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import replace
from decimal import Decimal

import pytest
from enginekit import (
    HOUR,
    NOW,
    decide,
    make_busy,
    make_node,
    make_request,
    plan_violations,
    reason_of,
    snapshot,
)

from scheduler.engine import (
    Placement,
    Plan,
    Policy,
    Preemption,
    Reservation,
    Snapshot,
    plan,
)
from scheduler.engine.bench_support import synthetic_busy, synthetic_nodes, synthetic_requests


def one_class(prices, min_bids=None):
    """Nodes 1, 2, ... of identical hardware, region and reliability, one price each."""
    bids = min_bids or ["0.50"] * len(prices)
    return [
        make_node(node_id, price=price, min_bid=bid)
        for node_id, (price, bid) in enumerate(zip(prices, bids, strict=True), start=1)
    ]


GPUS_OF = {node_id: tuple(range(node_id * 100, node_id * 100 + 8)) for node_id in range(1, 5)}

# -- scenarios ----------------------------------------------------------------------------------


def test_max_price_admits_only_nodes_within_it_and_the_cheapest_of_them_wins():
    # given one class whose nodes cost 3.00, 2.50, 2.00 and 2.60
    nodes = one_class(["3.00", "2.50", "2.00", "2.60"])
    request = make_request(1, max_price=Decimal("2.50"))
    # when all are idle, then the cheapest node takes it at its own price
    assert decide(snapshot(nodes, pending=[request])).placements == (
        Placement(
            rental_id=1,
            start=NOW,
            end=NOW + HOUR,
            price_per_gpu_hour=Decimal("2.00"),
            nodes=((3, (300,)),),
        ),
    )
    # when the cheapest is full, then the other node within the cap, never a dearer one
    full_3 = make_busy(3, range(8), rental_id=903)
    result = decide(snapshot(nodes, full_3, [request]))
    assert [(p.nodes, p.price_per_gpu_hour) for p in result.placements] == [
        (((2, (200,)),), Decimal("2.50"))
    ]
    # when both nodes within the cap are full, then it waits for them though nodes 1 and 4
    # are idle
    full_2_and_3 = full_3 + make_busy(2, range(8), rental_id=902)
    result = decide(snapshot(nodes, full_2_and_3, [request]))
    assert result.placements == ()
    assert reason_of(result, 1) == (
        "no capacity: 2 nodes match, none has 1 free GPUs for 1 h; "
        "expected to start at 2026-01-01T01:00:00Z"
    )
    assert [r.nodes for r in result.reservations] == [((3, (300,)),)]


def test_packing_still_beats_price_among_the_nodes_within_the_cap():
    # given node 2 (2.50) with one GPU free, node 3 (2.00) idle, node 1 (3.00, above the cap)
    # with one GPU free
    nodes = one_class(["3.00", "2.50", "2.00"])
    busy = make_busy(1, range(7), rental_id=901) + make_busy(2, range(7), rental_id=902)
    result = decide(snapshot(nodes, busy, [make_request(1, max_price=Decimal("2.50"))]))
    # then best fit fills node 2 and keeps the cheaper node 3 whole
    assert [(p.nodes, p.price_per_gpu_hour) for p in result.placements] == [
        (((2, (207,)),), Decimal("2.50"))
    ]


def test_gang_takes_the_cheapest_nodes_within_the_cap_at_the_dearest_of_their_prices():
    nodes = one_class(["3.00", "2.50", "2.00", "2.60"])
    request = make_request(1, gpus_per_node=8, node_count=2, max_price=Decimal("2.60"))
    result = decide(snapshot(nodes, pending=[request]))
    assert result.placements == (
        Placement(
            rental_id=1,
            start=NOW,
            end=NOW + HOUR,
            price_per_gpu_hour=Decimal("2.50"),
            nodes=((2, GPUS_OF[2]), (3, GPUS_OF[3])),
        ),
    )


def test_first_fit_takes_the_lowest_node_id_within_the_cap():
    nodes = one_class(["3.00", "2.50", "2.00"])
    result = decide(
        snapshot(nodes, pending=[make_request(1, max_price=Decimal("2.50"))]),
        Policy(first_fit=True),
    )
    assert [p.nodes for p in result.placements] == [((2, (200,)),)]


def test_bid_admits_only_nodes_whose_minimum_bid_it_reaches():
    # given one price, minimum bids 1.20, 0.80 and 0.60
    nodes = one_class(["2.00"] * 3, min_bids=["1.20", "0.80", "0.60"])
    request = make_request(1, interruptible=True, bid=Decimal("1.00"))
    # then equal scores go to the lowest node id the bid reaches, at the bid
    result = decide(snapshot(nodes, pending=[request]))
    assert [(p.nodes, p.price_per_gpu_hour) for p in result.placements] == [
        (((2, (200,)),), Decimal("1.00"))
    ]
    # and with node 2 full it is node 3, never node 1
    result = decide(snapshot(nodes, make_busy(2, range(8), rental_id=902), [request]))
    assert [p.nodes for p in result.placements] == [((3, (300,)),)]


def test_preemption_stays_within_the_cap_rather_than_use_an_idle_dearer_node():
    # given node 1 (3.00) idle and node 2 (2.00) full of interruptible work
    nodes = one_class(["3.00", "2.00"])
    busy = make_busy(2, range(8), rental_id=902, interruptible=True, price="0.50")
    result = decide(snapshot(nodes, busy, [make_request(7, max_price=Decimal("2.50"))]))
    assert result.preemptions == (
        Preemption(
            victim_rental_id=902, for_rental_id=7, reason="preempted for on-demand rental 7"
        ),
    )
    assert [(p.nodes, p.price_per_gpu_hour) for p in result.placements] == [
        (((2, (200,)),), Decimal("2.00"))
    ]


def test_future_window_and_reservation_use_only_nodes_within_the_cap():
    # given node 1 (3.00) idle, nodes 2 (2.50) and 3 (2.00) busy for two hours
    nodes = one_class(["3.00", "2.50", "2.00"])
    busy = make_busy(2, range(8), rental_id=902, end=NOW + 2 * HOUR)
    busy += make_busy(3, range(8), rental_id=903, end=NOW + 2 * HOUR)
    later = make_request(1, max_price=Decimal("2.50"), start=NOW + 3 * HOUR)
    now = make_request(2, max_price=Decimal("2.50"), created_at=NOW - 30)
    result = decide(snapshot(nodes, busy, [later, now]))
    # then the future start goes to the cheapest node within the cap on its window
    assert result.placements == (
        Placement(
            rental_id=1,
            start=NOW + 3 * HOUR,
            end=NOW + 4 * HOUR,
            price_per_gpu_hour=Decimal("2.00"),
            nodes=((3, (300,)),),
        ),
    )
    # and the one that cannot start now is reserved on node 3 as soon as it frees, just
    # before that placement, not on node 1
    assert result.reservations == (
        Reservation(rental_id=2, start=NOW + 2 * HOUR, end=NOW + 3 * HOUR, nodes=((3, (300,)),)),
    )
    assert reason_of(result, 2) == (
        "no capacity: 2 nodes match, none has 1 free GPUs for 1 h; "
        "expected to start at 2026-01-01T02:00:00Z"
    )


def test_reason_names_the_cheapest_node_of_a_class_priced_out():
    nodes = one_class(["2.50", "2.10", "2.30"], min_bids=["1.00", "0.90", "0.95"])
    result = decide(
        snapshot(
            nodes,
            pending=[
                make_request(1, max_price=Decimal("2.00")),
                make_request(2, interruptible=True, bid=Decimal("0.80")),
            ],
        )
    )
    assert reason_of(result, 1) == "price: cheapest matching node is $2.10 > max $2.00"
    assert reason_of(result, 2) == (
        "bid: $0.80 is below every matching node's minimum bid (lowest $0.90)"
    )


# -- seeded clusters with a price per node ------------------------------------------------------


def priced_per_node(seed: int, nodes: int, requests: int) -> Snapshot:
    """The synthetic marketplace, with every node's price drawn in cents around its model's
    price, its minimum bid a share of that, and its own reliability."""
    rng = random.Random(seed)
    cluster = []
    for node in synthetic_nodes(seed=seed, count=nodes):
        price = Decimal(rng.randint(int(node.price_per_gpu_hour * 60), 400)) / 100
        share = Decimal(rng.choice(("0.3", "0.4", "0.5")))
        cluster.append(
            replace(
                node,
                price_per_gpu_hour=price,
                min_bid=(price * share).quantize(Decimal("0.01")),
                reliability=rng.randint(800, 999) / 1000,
            )
        )
    return Snapshot(
        now=NOW,
        nodes=tuple(cluster),
        busy=synthetic_busy(
            seed=seed + 1, nodes=tuple(cluster), now=NOW, utilization=0.5, interruptible_share=0.4
        ),
        pending=synthetic_requests(
            seed=seed + 2,
            count=requests,
            now=NOW,
            gang_share=0.05,
            future_share=0.2,
            interruptible_share=0.3,
        ),
    )


def digest(result: Plan) -> str:
    return hashlib.sha256(repr(result).encode()).hexdigest()[:16]


def counts(result: Plan) -> tuple[int, ...]:
    return tuple(
        len(part)
        for part in (
            result.placements,
            result.preemptions,
            result.waiting,
            result.expired,
            result.reservations,
        )
    )


BEST_FIT = Policy(reserve_depth=4, future_candidates=4)
FIRST_FIT = Policy(first_fit=True, reserve_depth=2)

RECORDED = [
    (0, BEST_FIT, (1410, 114, 384, 6, 4), "103a160f06d4649c"),
    (0, FIRST_FIT, (1476, 112, 318, 6, 2), "8eae2c218bbfdd74"),
    (1, BEST_FIT, (1441, 141, 357, 2, 4), "ab0414409aa13bca"),
    (1, FIRST_FIT, (1497, 135, 301, 2, 2), "831016bbbbf06951"),
    (2, BEST_FIT, (1440, 86, 359, 1, 4), "2ceab9d57bcf6089"),
    (2, FIRST_FIT, (1482, 95, 317, 1, 2), "167abb62fe633c9e"),
]


@pytest.mark.parametrize(("seed", "policy", "expected_counts", "expected_digest"), RECORDED)
def test_per_node_prices_give_the_recorded_plan(seed, policy, expected_counts, expected_digest):
    snap = priced_per_node(seed, nodes=600, requests=1800)
    assert len({node.price_per_gpu_hour for node in snap.nodes}) > 100
    result = plan(snap, policy)
    assert plan_violations(snap, result, policy) == []
    assert (counts(result), digest(result)) == (expected_counts, expected_digest)
