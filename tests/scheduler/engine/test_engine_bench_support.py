"""The synthetic cluster generator and the whole-free-node count the benchmark relies on."""

from __future__ import annotations

from collections import defaultdict
from decimal import Decimal

from enginekit import NOW, make_busy, make_node, overlaps, plan_violations, snapshot

from scheduler.engine import Placement, Plan, Policy, Preemption, plan
from scheduler.engine.bench_support import synthetic_snapshot, whole_free_nodes


def test_same_seed_same_snapshot_other_seed_another():
    a = synthetic_snapshot(seed=3, nodes=50, requests=80)
    assert a == synthetic_snapshot(seed=3, nodes=50, requests=80)
    assert a != synthetic_snapshot(seed=4, nodes=50, requests=80)


def test_synthetic_snapshot_has_the_asked_shape_and_valid_allocations():
    snap = synthetic_snapshot(seed=1, nodes=300, requests=500)
    assert len(snap.nodes) == 300
    assert {len(node.gpus) for node in snap.nodes} == {8}
    assert len({g.gpu_id for node in snap.nodes for g in node.gpus}) == 2400
    assert len(snap.pending) == 500
    held = defaultdict(list)
    for b in snap.busy:
        assert b.end > snap.now
        assert not any(overlaps((b.start, b.end), r) for r in held[b.gpu_id])
        held[b.gpu_id].append((b.start, b.end))
    assert 0.2 < len(snap.busy) / 2400 < 0.4


def test_planning_a_synthetic_snapshot_is_sound_and_best_fit_keeps_more_whole_nodes():
    snap = synthetic_snapshot(seed=0, nodes=400, requests=800)
    kept = {}
    for first_fit in (False, True):
        policy = Policy(first_fit=first_fit)
        result = plan(snap, policy)
        assert plan_violations(snap, result, policy) == []
        kept[first_fit] = whole_free_nodes(snap, result)
    assert kept[False] > kept[True]


def test_whole_free_nodes_counts_after_preemptions_and_placements():
    # given node 1 busy, node 2 taken by the plan, node 3's only rental preempted, node 4 idle
    # and node 5 too small
    snap = snapshot(
        [make_node(i) for i in (1, 2, 3, 4)] + [make_node(5, gpus=4)],
        make_busy(1, [0], rental_id=901) + make_busy(3, [7], rental_id=903, interruptible=True),
    )
    result = Plan(
        placements=(
            Placement(
                rental_id=1,
                start=NOW,
                end=NOW + 60,
                price_per_gpu_hour=Decimal(1),
                nodes=((2, (200,)),),
            ),
        ),
        preemptions=(Preemption(victim_rental_id=903, for_rental_id=1, reason="test"),),
    )
    assert whole_free_nodes(snap, result) == 2
    assert whole_free_nodes(snap, Plan()) == 2
    assert whole_free_nodes(snap, result, gpus=4) == 3
