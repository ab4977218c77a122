"""Builders for small engine scenarios, and an independent checker of a plan's invariants.

The checker re-derives every rule from the inputs without using the engine's index, so a bug in
the index cannot hide itself.
"""

from __future__ import annotations

from collections import defaultdict
from decimal import Decimal
from itertools import pairwise

from agentprotocol.images import image_allowed
from scheduler.engine import DEFAULT_POLICY, Busy, Gpu, Node, Plan, Policy, Request, Snapshot, plan
from scheduler.engine.feasibility import gpu_matches, location_ok

NOW = 1_767_225_600.0
HOUR = 3600.0


def gpu_id(node_id: int, index: int) -> int:
    """GPU ids in scenarios: node 3, index 5 -> 305."""
    return node_id * 100 + index


def make_node(
    node_id: int,
    *,
    gpus: int = 8,
    model: str = "h100-sxm5-80gb",
    family: str = "h100",
    memory_gb: int = 80,
    tflops: float = 989.0,
    groups: list[str] | None = None,
    price: str = "2.00",
    min_bid: str = "1.00",
    reliability: float = 0.99,
    region: str = "eu-west",
    pool: str = "default",
    ssh_capable: bool = True,
    internet_capable: bool = True,
    cluster: int | str | None = "fabric",
    gbps: int = 200,
    image_allow: tuple[str, ...] | None = None,
    images: frozenset[str] = frozenset(),
) -> Node:
    """A node whose GPUs all share group "nvl" unless `groups` gives one label per GPU; nodes
    share the cluster "fabric" (so may host one gang together) unless `cluster` says otherwise."""
    labels = groups if groups is not None else ["nvl"] * gpus
    return Node(
        node_id=node_id,
        region=region,
        price_per_gpu_hour=Decimal(price),
        min_bid=Decimal(min_bid),
        reliability=reliability,
        pool=pool,
        ssh_capable=ssh_capable,
        internet_capable=internet_capable,
        cluster=cluster,
        interconnect_gbps=gbps if cluster is not None else 0,
        image_allow=image_allow,
        images=images,
        gpus=tuple(
            Gpu(
                gpu_id=gpu_id(node_id, i),
                node_id=node_id,
                index=i,
                model=model,
                family=family,
                memory_gb=memory_gb,
                tensor_tflops=tflops,
                group=labels[i],
                nvlink=bool(labels[i]),
            )
            for i in range(gpus)
        ),
    )


def make_busy(
    node_id: int,
    indexes: range | list[int],
    rental_id: int,
    *,
    start: float = NOW - HOUR,
    end: float = NOW + HOUR,
    interruptible: bool = False,
    price: str = "2.00",
    priority: int = 0,
) -> list[Busy]:
    return [
        Busy(
            gpu_id=gpu_id(node_id, i),
            rental_id=rental_id,
            start=start,
            end=end,
            interruptible=interruptible,
            price=Decimal(price),
            priority=priority,
        )
        for i in indexes
    ]


def make_request(rental_id: int, **fields) -> Request:
    fields.setdefault("created_at", NOW - 60)
    return Request(rental_id=rental_id, **fields)


def snapshot(nodes, busy=(), pending=(), now: float = NOW) -> Snapshot:
    return Snapshot(now=now, nodes=tuple(nodes), busy=tuple(busy), pending=tuple(pending))


def overlaps(a: tuple[float, float], b: tuple[float, float]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def plan_violations(snap: Snapshot, plan: Plan, policy: Policy) -> list[str]:
    """Every broken invariant of `plan` for `snap`, as readable lines (empty when sound)."""
    errors: list[str] = []
    now = snap.now
    requests = {r.rental_id: r for r in snap.pending}
    nodes = {n.node_id: n for n in snap.nodes}
    gpus = {g.gpu_id: (n, g) for n in snap.nodes for g in n.gpus}
    busy_by_rental: dict[object, list[Busy]] = defaultdict(list)
    for b in snap.busy:
        busy_by_rental[b.rental_id].append(b)

    decided = (
        [p.rental_id for p in plan.placements]
        + [w.rental_id for w in plan.waiting]
        + [e.rental_id for e in plan.expired]
    )
    if sorted(decided) != sorted(requests):
        errors.append(f"every request must be decided exactly once: {sorted(decided)}")

    stopped = {p.victim_rental_id for p in plan.preemptions}
    if len(stopped) != len(plan.preemptions):
        errors.append("a rental is preempted twice")

    # No GPU in two overlapping ranges: existing allocations (a preempted one ends now),
    # placements, and reservations against both.
    held: dict[int, list[tuple[float, float, object]]] = defaultdict(list)
    for b in snap.busy:
        if b.end <= now or b.gpu_id not in gpus:
            continue
        end = min(b.end, now) if b.rental_id in stopped else b.end
        if b.start < end:
            held[b.gpu_id].append((b.start, end, b.rental_id))
    placed_gpus: dict[object, set[int]] = {}
    for p in plan.placements:
        ids = [g for _, gs in p.nodes for g in gs]
        if len(ids) != len(set(ids)):
            errors.append(f"{p.rental_id}: a GPU twice in one placement")
        placed_gpus[p.rental_id] = set(ids)
        for g in ids:
            held[g].append((p.start, p.end, p.rental_id))
    for g, ranges in held.items():
        ranges.sort(key=lambda r: (r[0], r[1]))
        for a, b in pairwise(ranges):
            if overlaps(a[:2], b[:2]):
                errors.append(f"GPU {g} double booked: {a} and {b}")
    for r in plan.reservations:
        for _, gs in r.nodes:
            for g in gs:
                for rng in held.get(g, []):
                    if overlaps((r.start, r.end), rng[:2]):
                        errors.append(f"reservation {r.rental_id} on GPU {g} overlaps {rng}")

    for p in plan.placements:
        req = requests.get(p.rental_id)
        if req is None:
            errors.append(f"placement for unknown rental {p.rental_id}")
            continue
        errors += _placement_violations(req, p, nodes, gpus, now, policy)

    for pre in plan.preemptions:
        victims = busy_by_rental.get(pre.victim_rental_id)
        req = requests.get(pre.for_rental_id)
        if not victims or req is None or pre.for_rental_id not in placed_gpus:
            errors.append(f"preemption {pre} is not for a placed request of a known victim")
            continue
        if not all(b.interruptible for b in victims):
            errors.append(f"{pre.victim_rental_id} is not interruptible")
        if any(b.priority > req.priority for b in victims):
            errors.append(f"{pre.victim_rental_id} has a higher class than {req.rental_id}")
        if req.interruptible and not all(b.price < req.bid for b in victims):
            errors.append(f"{pre.victim_rental_id} does not bid less than {req.rental_id}")
        placement = next(p for p in plan.placements if p.rental_id == req.rental_id)
        if placement.start != now:
            errors.append(f"{req.rental_id} preempted for a future start")
        needed = any(
            b.gpu_id in placed_gpus[req.rental_id]
            and overlaps((b.start, b.end), (placement.start, placement.end))
            for b in victims
        )
        if not needed:
            errors.append(f"{pre.victim_rental_id} preempted but holds none of the GPUs taken")

    for e in plan.expired:
        req = requests[e.rental_id]
        if req.start_deadline is None or req.start_deadline > now:
            errors.append(f"{e.rental_id} expired before its deadline")
    return errors


def decide(snap: Snapshot, policy: Policy = DEFAULT_POLICY) -> Plan:
    """Plan, and fail on any broken invariant before the test looks at the decisions."""
    result = plan(snap, policy)
    assert plan_violations(snap, result, policy) == []
    return result


def reason_of(result: Plan, rental_id) -> str:
    return next(w.reason for w in result.waiting if w.rental_id == rental_id)


def _placement_violations(req, p, nodes, gpus, now, policy) -> list[str]:
    errors = []
    start = max(now, req.start)
    if p.start != start or p.end != start + req.duration:
        errors.append(f"{req.rental_id}: window {p.start}-{p.end}, expected from {start}")
    if req.start_deadline is not None and p.start > req.start_deadline:
        errors.append(f"{req.rental_id}: starts after its deadline")
    if p.start > now + policy.horizon:
        errors.append(f"{req.rental_id}: starts beyond the horizon")
    node_ids = [node_id for node_id, _ in p.nodes]
    if len(node_ids) != req.node_count or len(set(node_ids)) != req.node_count:
        errors.append(f"{req.rental_id}: {len(node_ids)} nodes, needs {req.node_count} distinct")
    if req.node_count > 1:
        clusters = {nodes[node_id].cluster for node_id in node_ids}
        if len(clusters) != 1 or None in clusters:
            errors.append(f"{req.rental_id}: a gang across clusters {clusters}")
        slow = [i for i in node_ids if nodes[i].interconnect_gbps < req.min_interconnect_gbps]
        if slow:
            errors.append(f"{req.rental_id}: nodes {slow} slower than its interconnect")
    prices = []
    for node_id, gpu_ids in p.nodes:
        node = nodes[node_id]
        prices.append(node.price_per_gpu_hour)
        if len(gpu_ids) != req.gpus_per_node:
            errors.append(f"{req.rental_id}: {len(gpu_ids)} GPUs on node {node_id}")
        if not location_ok(req, node):
            errors.append(f"{req.rental_id}: node {node_id} in the wrong pool or region")
        if req.ssh and not node.ssh_capable:
            errors.append(f"{req.rental_id}: SSH asked for on node {node_id}, which has none")
        if req.internet and not node.internet_capable:
            errors.append(f"{req.rental_id}: internet asked for on node {node_id}, unfiltered")
        if req.image and not image_allowed(node.image_allow, req.image):
            errors.append(f"{req.rental_id}: node {node_id} refuses its image {req.image}")
        for g in gpu_ids:
            owner, gpu = gpus[g]
            if owner.node_id != node_id:
                errors.append(f"{req.rental_id}: GPU {g} is not on node {node_id}")
            if not gpu_matches(req, gpu):
                errors.append(f"{req.rental_id}: GPU {g} does not match")
        if req.same_group and req.gpus_per_node > 1:
            labels = {gpus[g][1].group for g in gpu_ids}
            if len(labels) != 1 or "" in labels:
                errors.append(f"{req.rental_id}: GPUs on node {node_id} span groups {labels}")
        if req.interruptible and not node.min_bid <= req.bid:
            errors.append(f"{req.rental_id}: bid below node {node_id}'s minimum")
    if req.interruptible:
        if p.price_per_gpu_hour != req.bid:
            errors.append(f"{req.rental_id}: locked {p.price_per_gpu_hour}, bid {req.bid}")
        if req.max_price is not None and req.bid > req.max_price:
            errors.append(f"{req.rental_id}: bid above max price")
    else:
        if p.price_per_gpu_hour != max(prices):
            errors.append(f"{req.rental_id}: locked {p.price_per_gpu_hour}, nodes {prices}")
        if req.max_price is not None and max(prices) > req.max_price:
            errors.append(f"{req.rental_id}: node price above max price")
    return errors
