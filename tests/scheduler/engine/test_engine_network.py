"""The internet: a rental with it is placed only on nodes that can keep it to public addresses,
and refused with a reason naming the network when none of the nodes that meet the rest of the
request can. (The property tests draw incapable nodes and internet requests too: the checker in
enginekit flags any internet placement on an incapable node.)"""

from __future__ import annotations

from enginekit import make_busy, make_node, make_request, plan_violations, snapshot

from scheduler.engine import DEFAULT_POLICY, never_fits, plan

# The cheapest node cannot filter (its engine runs without iptables).
CHEAP_UNFILTERED = make_node(1, price="1.00", internet_capable=False)
DEARER_FILTERED = make_node(2, price="2.00")


def test_an_internet_rental_skips_the_unfiltered_node_and_an_internal_one_takes_it():
    # Given a cheap node that cannot filter and a dearer one that can
    internet = make_request(7, gpus_per_node=8, internet=True)
    internal = make_request(8, gpus_per_node=8)

    # When a cycle plans an 8-GPU rental of each network
    for request, node_id in ((internet, 2), (internal, 1)):
        snap = snapshot([CHEAP_UNFILTERED, DEARER_FILTERED], pending=[request])
        result = plan(snap, DEFAULT_POLICY)

        # Then the internet one is on the filtering node, the internal one on the cheaper
        [placement] = result.placements
        assert [n for n, _ in placement.nodes] == [node_id]
        assert plan_violations(snap, result, DEFAULT_POLICY) == []


def test_an_internet_rental_waits_rather_than_take_a_free_unfiltered_node():
    busy = make_busy(2, range(8), rental_id=99)
    snap = snapshot(
        [CHEAP_UNFILTERED, DEARER_FILTERED],
        busy=busy,
        pending=[make_request(7, gpus_per_node=1, internet=True)],
    )
    result = plan(snap, DEFAULT_POLICY)
    assert all(p.start > snap.now for p in result.placements)
    assert all(node_id == 2 for p in result.placements for node_id, _ in p.nodes)


def test_never_fits_names_the_network_only_when_it_alone_stands_in_the_way():
    nodes = (CHEAP_UNFILTERED, make_node(3, price="1.50", internet_capable=False))
    assert never_fits(make_request(1, internet=True), nodes) == (
        "network: only 0 matching nodes can keep a rental's internet to public addresses, "
        "the request needs 1; network internal runs anywhere"
    )
    assert never_fits(make_request(1), nodes) is None
    assert never_fits(make_request(1, internet=True, gpus_per_node=16), nodes) == (
        "no node in pool default has 16 matching GPUs"
    )
    assert never_fits(make_request(1, internet=True), (DEARER_FILTERED, *nodes)) is None
