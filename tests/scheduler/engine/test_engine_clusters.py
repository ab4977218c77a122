"""Clusters: a gang (node_count > 1) is placed on nodes that all share one cluster, never on a
node without one; a single-node rental goes anywhere. (The property tests draw nodes in two
clusters and in none: the checker in enginekit flags a gang across clusters or off them.)"""

from __future__ import annotations

from decimal import Decimal

from enginekit import HOUR, NOW, make_busy, make_node, make_request, plan_violations, snapshot

from scheduler.engine import DEFAULT_POLICY, Policy, never_fits, plan


def members(result) -> list[int]:
    [placement] = result.placements
    return [node_id for node_id, _ in placement.nodes]


def test_a_gang_stays_in_one_cluster_even_when_cheaper_nodes_are_in_two():
    # Given the two cheapest nodes in different clusters and two dearer ones sharing "b"
    nodes = [
        make_node(1, price="1.00", cluster="a"),
        make_node(2, price="1.00", cluster="b"),
        make_node(3, price="2.00", cluster="b"),
        make_node(4, price="3.00", cluster="a"),
    ]
    snap = snapshot(nodes, pending=[make_request(1, gpus_per_node=8, node_count=2)])

    # When a cycle plans a gang of two whole nodes
    result = plan(snap, DEFAULT_POLICY)

    # Then it takes the cluster whose pair scores best (1.00 + 2.00 beats 1.00 + 3.00), at the
    # dearer node's price
    assert members(result) == [2, 3]
    assert result.placements[0].price_per_gpu_hour == Decimal("2.00")
    assert plan_violations(snap, result, DEFAULT_POLICY) == []


def test_nodes_without_a_cluster_never_host_a_gang_member():
    # Given two idle nodes on their own and a cluster with only one idle node
    nodes = [
        make_node(1, cluster=None),
        make_node(2, cluster=None),
        make_node(3, cluster="ib"),
    ]
    snap = snapshot(nodes, pending=[make_request(1, gpus_per_node=8, node_count=2)])

    # When a cycle plans a gang of two
    result = plan(snap, DEFAULT_POLICY)

    # Then it waits, saying why: no cluster is big enough
    assert result.placements == ()
    [waiting] = result.waiting
    assert waiting.reason == (
        "no cluster has 2 matching nodes (the largest has 1): a multi-node rental runs inside "
        "one cluster"
    )


def test_a_gang_with_no_cluster_at_all_waits_naming_clusters():
    nodes = [make_node(1, cluster=None), make_node(2, cluster=None)]
    result = plan(snapshot(nodes, pending=[make_request(1, gpus_per_node=8, node_count=2)]))
    assert result.placements == ()
    assert result.waiting[0].reason.startswith("no cluster in pool default has nodes with 8 ")


def test_single_node_rentals_go_anywhere_clustered_or_not():
    # Given the cheapest node on its own and a dearer clustered one
    nodes = [make_node(1, price="1.00", cluster=None), make_node(2, price="2.00", cluster="ib")]

    # When two single-node rentals of 8 GPUs are planned
    pending = [make_request(1, gpus_per_node=8), make_request(2, gpus_per_node=8)]
    result = plan(snapshot(nodes, pending=pending))

    # Then both are placed, the first on the unclustered node
    assert {p.rental_id: p.nodes[0][0] for p in result.placements} == {1: 1, 2: 2}


def test_a_busy_cluster_makes_the_gang_wait_though_enough_nodes_are_free_elsewhere():
    # Given cluster "a" with one of its two nodes busy for 2 h and cluster "b" of one node
    nodes = [
        make_node(1, cluster="a"),
        make_node(2, cluster="a"),
        make_node(3, cluster="b"),
    ]
    busy = make_busy(2, range(8), rental_id=900, start=NOW - HOUR, end=NOW + 2 * HOUR)
    snap = snapshot(nodes, busy, pending=[make_request(1, gpus_per_node=8, node_count=2)])

    # When a cycle plans a gang of two
    result = plan(snap, DEFAULT_POLICY)

    # Then it is not placed on nodes 1 and 3 (two free nodes, two clusters): it is reserved in
    # cluster "a" from when node 2 frees up
    assert result.placements == ()
    [reservation] = result.reservations
    assert reservation.start == NOW + 2 * HOUR
    assert [node_id for node_id, _ in reservation.nodes] == [1, 2]
    assert "at most 1 in one cluster have 8 free GPUs" in result.waiting[0].reason


def test_preemption_for_a_gang_frees_nodes_of_one_cluster():
    # Given cluster "a" of two nodes, one running an interruptible rental, and an idle node in "b"
    nodes = [make_node(1, cluster="a"), make_node(2, cluster="a"), make_node(3, cluster="b")]
    busy = make_busy(2, range(8), rental_id=900, interruptible=True, price="0.50")
    snap = snapshot(nodes, busy, pending=[make_request(1, gpus_per_node=8, node_count=2)])

    # When an on-demand gang of two is planned with preemption on
    result = plan(snap, DEFAULT_POLICY)

    # Then the interruptible rental is stopped and the gang takes both nodes of "a"
    assert [p.victim_rental_id for p in result.preemptions] == [900]
    assert members(result) == [1, 2]
    assert plan_violations(snap, result, DEFAULT_POLICY) == []


def test_first_fit_keeps_a_gang_in_one_cluster_too():
    nodes = [
        make_node(1, cluster="a"),
        make_node(2, cluster="b"),
        make_node(3, cluster="b"),
    ]
    result = plan(
        snapshot(nodes, pending=[make_request(1, gpus_per_node=8, node_count=2)]),
        Policy(first_fit=True),
    )
    assert members(result) == [2, 3]


def test_never_fits_names_node_count_when_no_cluster_is_big_enough():
    nodes = [make_node(1, cluster="a"), make_node(2, cluster="b"), make_node(3, cluster=None)]
    gang = make_request(1, gpus_per_node=8, node_count=2)
    assert never_fits(gang, nodes) == (
        "node_count: the largest cluster has 1 matching nodes, the request needs 2 in one cluster"
    )
    assert never_fits(gang, [make_node(1, cluster=None), make_node(2, cluster=None)]) == (
        "node_count: no matching node is in a cluster; a multi-node rental runs inside one "
        "cluster (nodes a provider declared on one fabric)"
    )
    assert never_fits(make_request(2, gpus_per_node=8), [make_node(3, cluster=None)]) is None


def test_a_gang_asking_a_fast_interconnect_skips_the_cheaper_slower_cluster():
    # Given a cheap 25 Gb/s Ethernet cluster and a dearer 400 Gb/s InfiniBand one
    nodes = [
        make_node(1, price="1.00", cluster="eth", gbps=25),
        make_node(2, price="1.00", cluster="eth", gbps=25),
        make_node(3, price="2.00", cluster="ib", gbps=400),
        make_node(4, price="2.00", cluster="ib", gbps=400),
    ]
    gang = {"gpus_per_node": 8, "node_count": 2}

    # When one gang asks for at least 200 Gb/s and another for any fabric
    fast = plan(snapshot(nodes, pending=[make_request(1, min_interconnect_gbps=200, **gang)]))
    any_fabric = plan(snapshot(nodes, pending=[make_request(2, **gang)]))

    # Then the first takes the InfiniBand cluster, the second the cheaper Ethernet one
    assert members(fast) == [3, 4]
    assert members(any_fabric) == [1, 2]

    # And a gang asking more than any cluster has waits, saying so; never_fits agrees
    too_fast = make_request(3, min_interconnect_gbps=800, **gang)
    result = plan(snapshot(nodes, pending=[too_fast]))
    expected = (
        "min_interconnect_gbps: no matching cluster is that fast (the fastest has 400 Gb/s, "
        "800 asked)"
    )
    assert (result.placements, result.waiting[0].reason) == ((), expected)
    assert never_fits(too_fast, nodes) == expected
