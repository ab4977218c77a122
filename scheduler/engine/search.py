"""Finding the best m nodes that can each host a request over a window [t0, t1).

A request starting now only visits idle-count buckets with enough idle GPUs, in increasing order
of what would be left over, and stops as soon as no remaining node can beat the best found, or,
in a partly admitted class, once the static score passes that of the last admitted node.

A future window cannot use the idle-now buckets; it visits the admitted tiers' nodes (tiers in
order of price, or of first appearance when the request sets no price) and compares a bounded
number that fit (`Policy.future_candidates`).
"""

from __future__ import annotations

from bisect import insort

from scheduler.engine.capacity import Ask, CapacityIndex, Choice, NodeState
from scheduler.engine.intervals import interval_start, is_free
from scheduler.engine.topology import Pick, pick, spans


def search(index: CapacityIndex, ask: Ask, t0: float, t1: float) -> list[Choice]:
    """The best m nodes that can each host the request over [t0, t1), best first (fewer when
    fewer fit)."""
    if t0 == index.now:
        return search_now(index, ask, t1)
    return search_future(index, ask, t0, t1)


def search_now(index: CapacityIndex, ask: Ask, t1: float) -> list[Choice]:
    """The best m nodes for a request starting now and ending at t1, from the idle buckets."""
    k, m, same_group = ask.k, ask.m, ask.same_group
    match, classes, gate = ask.match, index.class_list, ask.match.gate
    pack, topo, nodes, live = index.pack, index.topo, index.nodes, index.live
    # (score, node id, state, full) of the nodes found, GPUs not chosen yet: only the best m
    # get chosen. Plain tuples, unpacked: this list takes an insertion per node that fits.
    best: list[tuple[int, int, NodeState, bool]] = []
    # (score, node id) a node must beat to enter the best m, once there are m.
    worst: tuple[int, int] | None = None
    # Buckets in increasing idle count: the packing term only grows, so once even the cheapest
    # node of a level cannot beat the m-th best, no later level can either. First fit's bucket
    # k already holds every node with k or more idle GPUs.
    top = index.max_level if index.best_fit else k
    for level in range(k, top + 1):
        base = pack * (level - k)
        if worst is not None and base + match.min_static > worst[0]:
            break
        for cid in live[level] & match.ids:
            cls = classes[cid]
            bucket = cls.buckets[level]
            head = bucket[0]
            if worst is not None and (base + head.static, head.node_id) >= worst:
                continue
            full = match.full[cid]
            partial = match.partial.get(cid)
            floor = base + topo * ((k - 1) // cls.max_group)
            for static, node_id in bucket:
                if worst is not None and (floor + static, node_id) >= worst:
                    break
                ns = nodes[node_id]
                if partial is not None and ns.ranks_in(cls)[gate] >= partial.tiers:
                    if static > partial.highest:
                        break
                    continue
                if full and t1 <= ns.idle_until:
                    # Every idle GPU is usable, so the score follows from the idle counts per
                    # group; the GPUs are chosen only if the node wins.
                    if ns.glevel >= k:
                        score = base + static
                    elif same_group:
                        continue
                    else:
                        score = base + static + topo * (spans(ns.idle_groups, k) - 1)
                else:
                    if same_group and ns.glevel < k:
                        continue
                    picked = pick_now(index, ns, ask, full, t1)
                    if picked is None:
                        continue
                    score = base + static + topo * (picked.spans - 1)
                # Never negative: the bounds above, which leave it out, stay lower bounds.
                score += index.cold(ask, ns)
                insort(best, (score, node_id, ns, full))
                if len(best) > m:
                    best.pop()
                if len(best) == m:
                    worst_score, worst_id, _, _ = best[-1]
                    worst = (worst_score, worst_id)
    return [
        Choice(score, node_id, ns, pick_now(index, ns, ask, full, t1).positions)
        for score, node_id, ns, full in best
    ]


def pick_now(index: CapacityIndex, ns: NodeState, ask: Ask, full: bool, t1: float) -> Pick | None:
    """The node's GPUs for a request starting now: those free until t1."""
    ivs = ns.ivs
    free = [p for p in ask.positions(ns, full) if not ivs[p] or interval_start(ivs[p][0]) >= t1]
    return pick(ns.group, free, ask.k, ask.same_group, index.best_fit)


def search_future(index: CapacityIndex, ask: Ask, t0: float, t1: float) -> list[Choice]:
    """Idle counts of now say nothing about a future window, so this visits the matching
    classes' nodes in static-score order and compares the first `future_candidates` that fit
    (at least m)."""
    k, m, same_group, best_fit = ask.k, ask.m, ask.same_group, index.best_fit
    pack, topo, nodes = index.pack, index.topo, index.nodes
    budget = max(index.policy.future_candidates, m)
    best: list[Choice] = []
    # (score, node id) a node must beat to enter the best m, once there are m.
    worst: tuple[int, int] | None = None
    full_of = ask.match.full
    for tier in ask.match.tiers():
        full = full_of[tier.cls.cid]
        floor = topo * ((k - 1) // tier.cls.max_group)
        for static, node_id in tier.entries:
            if worst is not None and (floor + static, node_id) >= worst:
                break
            ns = nodes[node_id]
            positions = ask.positions(ns, full)
            if t0 >= ns.clear or t1 <= ns.first:
                # Nothing on the node overlaps the window.
                free, spare = positions, len(ns.ivs)
            else:
                ivs = ns.ivs
                free = [p for p in positions if is_free(ivs[p], t0, t1)]
                spare = len(free) if full else sum(is_free(iv, t0, t1) for iv in ivs)
            picked = pick(ns.group, free, k, same_group, best_fit)
            if picked is None:
                continue
            score = pack * (spare - k) + static + topo * (picked.spans - 1) + index.cold(ask, ns)
            insort(best, Choice(score, node_id, ns, picked.positions))
            if len(best) > m:
                best.pop()
            if len(best) == m:
                worst = (best[-1].score, best[-1].node_id)
            budget -= 1
            if budget == 0:
                return best
    return best
