"""SSH capability: a rental with SSH is placed only on nodes whose agent can give it an sshd with
a published port, and refused with a reason naming SSH when none of the nodes that meet the rest
of the request can. (The property tests draw incapable nodes and SSH requests too: the checker
in enginekit flags any SSH placement on an incapable node.)"""

from __future__ import annotations

from decimal import Decimal

from enginekit import make_node, make_request, plan_violations, snapshot

from scheduler.engine import DEFAULT_POLICY, never_fits, plan

# The cheapest node cannot give SSH (its agent runs rentals as local processes).
CHEAP_NO_SSH = make_node(1, price="1.00", ssh_capable=False)
DEARER_SSH = make_node(2, price="2.00")


def test_an_ssh_rental_skips_the_incapable_node_and_lands_on_a_capable_one():
    # Given a cheap node without SSH and a dearer one with it
    snap = snapshot(
        [CHEAP_NO_SSH, DEARER_SSH], pending=[make_request(7, gpus_per_node=8, ssh=True)]
    )

    # When a cycle plans an 8-GPU rental that asks for SSH
    result = plan(snap, DEFAULT_POLICY)

    # Then it is placed on the capable node, at its price
    [placement] = result.placements
    assert [node_id for node_id, _ in placement.nodes] == [2]
    assert placement.price_per_gpu_hour == Decimal("2.00")
    assert plan_violations(snap, result, DEFAULT_POLICY) == []


def test_without_ssh_the_same_rental_takes_the_cheaper_incapable_node():
    snap = snapshot([CHEAP_NO_SSH, DEARER_SSH], pending=[make_request(7, gpus_per_node=8)])
    [placement] = plan(snap, DEFAULT_POLICY).placements
    assert [node_id for node_id, _ in placement.nodes] == [1]


def test_an_ssh_rental_waits_rather_than_take_a_free_incapable_node():
    # Given the capable node full and the incapable one idle
    from enginekit import make_busy

    busy = make_busy(2, range(8), rental_id=99)
    snap = snapshot(
        [CHEAP_NO_SSH, DEARER_SSH], busy=busy, pending=[make_request(7, gpus_per_node=1, ssh=True)]
    )
    result = plan(snap, DEFAULT_POLICY)
    # Then nothing is placed now: it waits for the capable node
    assert all(p.start > snap.now for p in result.placements)
    assert all(node_id == 2 for p in result.placements for node_id, _ in p.nodes)


def test_never_fits_names_ssh_only_when_ssh_alone_stands_in_the_way():
    nodes = (CHEAP_NO_SSH, make_node(3, price="1.50", ssh_capable=False))
    assert never_fits(make_request(1, ssh=True), nodes) == (
        "ssh: no matching node can run an sshd with a published port"
    )
    assert never_fits(make_request(1), nodes) is None
    # A gang of two with one capable node among the matching ones
    gang = make_request(1, gpus_per_node=8, node_count=2, ssh=True)
    assert never_fits(gang, (CHEAP_NO_SSH, DEARER_SSH)) == (
        "ssh: only 1 matching nodes can run an sshd, the request needs 2"
    )
    # Another constraint that no node meets is named first, SSH or not
    assert never_fits(make_request(1, ssh=True, gpus_per_node=16), nodes) == (
        "no node in pool default has 16 matching GPUs"
    )
    assert never_fits(make_request(1, ssh=True), (DEARER_SSH, *nodes)) is None
