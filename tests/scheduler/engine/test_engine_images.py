"""Images: a rental is placed only on nodes whose agent accepts its image (their allow-list, as
they reported it), and among otherwise equal nodes on one that already holds the image (no pull
before the start). The property tests draw allow-lists, held images and images too: the checker
in enginekit flags any placement on a node that refuses the image."""

from __future__ import annotations

from decimal import Decimal

from enginekit import make_busy, make_node, make_request, plan_violations, reason_of, snapshot

from scheduler.engine import DEFAULT_POLICY, Policy, never_fits, plan

HARNESS = ("gpumarket/harness:*",)
CUSTOM = "ghcr.io/team/train:1"


def _placed_on(result) -> list[int]:
    [placement] = result.placements
    return [node_id for node_id, _ in placement.nodes]


def test_a_rental_skips_the_cheaper_node_that_refuses_its_image():
    # Given a cheap node accepting only the harness image and a dearer one accepting any
    nodes = [
        make_node(1, price="1.00", image_allow=HARNESS),
        make_node(2, price="2.00", image_allow=("*",)),
    ]
    snap = snapshot(nodes, pending=[make_request(7, gpus_per_node=8, image=CUSTOM)])
    # When a cycle plans a rental of another image
    result = plan(snap, DEFAULT_POLICY)
    # Then it lands on the node that accepts it, at its price
    assert _placed_on(result) == [2]
    assert result.placements[0].price_per_gpu_hour == Decimal("2.00")
    assert plan_violations(snap, result, DEFAULT_POLICY) == []


def test_the_harness_image_still_takes_the_cheaper_node():
    nodes = [
        make_node(1, price="1.00", image_allow=HARNESS),
        make_node(2, price="2.00", image_allow=("*",)),
    ]
    image = "gpumarket/harness:dev"
    snap = snapshot(nodes, pending=[make_request(7, gpus_per_node=8, image=image)])
    assert _placed_on(plan(snap, DEFAULT_POLICY)) == [1]


def test_a_node_that_never_said_accepts_any_image_and_an_empty_list_none():
    nodes = [make_node(1, image_allow=()), make_node(2, image_allow=None)]
    snap = snapshot(nodes, pending=[make_request(7, gpus_per_node=8, image=CUSTOM)])
    assert _placed_on(plan(snap, DEFAULT_POLICY)) == [2]


def test_a_rental_waits_rather_than_take_a_free_node_that_refuses_its_image():
    # Given the accepting node full and the refusing one idle
    nodes = [make_node(1, image_allow=HARNESS), make_node(2, image_allow=("ghcr.io/*",))]
    busy = make_busy(2, range(8), rental_id=99)
    snap = snapshot(nodes, busy=busy, pending=[make_request(7, gpus_per_node=1, image=CUSTOM)])
    result = plan(snap, DEFAULT_POLICY)
    # Then nothing starts now on the refusing node: it waits for the accepting one
    assert all(node_id == 2 for p in result.placements for node_id, _ in p.nodes)
    assert all(p.start > snap.now for p in result.placements)


def test_a_rental_no_node_accepts_waits_with_a_reason_and_never_fits_names_image():
    nodes = (make_node(1, image_allow=HARNESS), make_node(2, image_allow=()))
    request = make_request(7, gpus_per_node=1, image=CUSTOM)
    result = plan(snapshot(nodes, pending=[request]), DEFAULT_POLICY)
    assert result.placements == ()
    assert "no node" in reason_of(result, 7)
    assert never_fits(request, nodes) == f"image: no matching node accepts the image {CUSTOM!r}"
    # and the same request with the harness image fits
    assert never_fits(make_request(7, image="gpumarket/harness:dev"), nodes) is None


def test_a_gang_needs_as_many_accepting_nodes_as_members():
    nodes = (make_node(1, image_allow=("*",)), make_node(2, image_allow=HARNESS))
    request = make_request(7, gpus_per_node=8, node_count=2, image=CUSTOM)
    assert never_fits(request, nodes) == (
        f"image: only 1 matching nodes accept the image {CUSTOM!r}, the request needs 2"
    )


def test_among_equal_nodes_one_holding_the_image_is_preferred():
    # Given two identical idle nodes, the second (higher id, last on a tie) holding the image
    nodes = [make_node(1), make_node(2, images=frozenset({CUSTOM}))]
    snap = snapshot(nodes, pending=[make_request(7, gpus_per_node=2, image=CUSTOM)])
    # When a rental of that image is planned
    result = plan(snap, DEFAULT_POLICY)
    # Then it goes where no pull is needed
    assert _placed_on(result) == [2]
    assert plan_violations(snap, result, DEFAULT_POLICY) == []
    # and a rental of another image keeps the usual order (the lowest id on a tie)
    other = snapshot(nodes, pending=[make_request(7, gpus_per_node=2, image="x/y:1")])
    assert _placed_on(plan(other, DEFAULT_POLICY)) == [1]


def test_the_preference_holds_for_a_later_start_too():
    nodes = [make_node(1), make_node(2, images=frozenset({CUSTOM}))]
    request = make_request(7, gpus_per_node=2, image=CUSTOM, start=snapshot([]).now + 3600)
    assert _placed_on(plan(snapshot(nodes, pending=[request]), DEFAULT_POLICY)) == [2]


def test_a_held_image_does_not_outweigh_packing_or_a_lower_price():
    # A node already half used (packing) and a cheaper node both beat an idle holder.
    holder = make_node(3, images=frozenset({CUSTOM}))
    busy = make_busy(1, range(6), rental_id=99)
    packed = snapshot([make_node(1), holder], busy=busy, pending=[make_request(7, image=CUSTOM)])
    assert _placed_on(plan(packed, DEFAULT_POLICY)) == [1]
    cheaper = snapshot(
        [make_node(1, price="1.90"), holder], pending=[make_request(7, image=CUSTOM)]
    )
    assert _placed_on(plan(cheaper, DEFAULT_POLICY)) == [1]
    # and the weight is a policy knob: a heavy one moves the rental to the holder
    heavy = Policy(cold_weight=100)
    assert _placed_on(plan(cheaper, heavy)) == [3]
