"""Property tests: random clusters, allocations and request mixes against the plan's invariants.

Times are multiples of a quarter hour so that ranges often touch exactly, which is where an
off-by-one in a half-open range check would show.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from decimal import Decimal

from enginekit import HOUR, NOW, overlaps, plan_violations
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentprotocol.images import image_allowed
from scheduler.engine import (
    Busy,
    Gpu,
    Node,
    Policy,
    Request,
    Snapshot,
    effective_priority,
    never_fits,
    plan,
)
from scheduler.engine.feasibility import gpu_matches, location_ok, price_ok

QUARTER = HOUR / 4
MODELS = {"a100": ("a100", 40, 312.0), "h100": ("h100", 80, 989.0)}
PRICES = [Decimal("1.00"), Decimal("1.50"), Decimal("2.00")]
PROPERTY = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# Each cluster's bandwidth, as the database gives every node of one cluster the same.
CLUSTER_GBPS = {"a": 100, "b": 400}
# What agents accept (None: never said, any) and hold, drawn per node.
IMAGE_ALLOW = [None, None, ("gpumarket/harness:*",), ("*",), ()]
HELD_IMAGES = [frozenset(), frozenset({"gpumarket/harness:dev"})]


@st.composite
def nodes_strategy(draw) -> tuple[Node, ...]:
    nodes = []
    for node_id in range(1, draw(st.integers(1, 8)) + 1):
        size = draw(st.sampled_from([1, 2, 4, 4, 8, 8]))
        model = draw(st.sampled_from(sorted(MODELS)))
        family, memory, tflops = MODELS[model]
        layout = draw(st.sampled_from(["one", "halves", "none", "mixed"]))
        if layout == "one":
            groups = ["nvl"] * size
        elif layout == "halves":
            groups = [f"g{i * 2 // size}" for i in range(size)]
        elif layout == "none":
            groups = [""] * size
        else:
            groups = draw(st.lists(st.sampled_from(["", "g0", "g1"]), min_size=size, max_size=size))
        price = draw(st.sampled_from(PRICES))
        nodes.append(
            Node(
                node_id=node_id,
                region=draw(st.sampled_from(["eu-west", "eu-west", "us-east"])),
                price_per_gpu_hour=price,
                min_bid=price / 2,
                reliability=draw(st.sampled_from([0.9, 0.99])),
                ssh_capable=draw(st.sampled_from([True, True, False])),
                internet_capable=draw(st.sampled_from([True, True, False])),
                image_allow=draw(st.sampled_from(IMAGE_ALLOW)),
                images=draw(st.sampled_from(HELD_IMAGES)),
                cluster=(cluster := draw(st.sampled_from([None, "a", "a", "b"]))),
                interconnect_gbps=CLUSTER_GBPS.get(cluster, 0),
                gpus=tuple(
                    Gpu(
                        gpu_id=node_id * 100 + i,
                        node_id=node_id,
                        index=i,
                        model=model,
                        family=family,
                        memory_gb=memory,
                        tensor_tflops=tflops,
                        group=groups[i],
                        nvlink=bool(groups[i]),
                    )
                    for i in range(size)
                ),
            )
        )
    return tuple(nodes)


@st.composite
def busy_strategy(draw, nodes: tuple[Node, ...], crowded: bool) -> tuple[Busy, ...]:
    """Existing allocations that never overlap on a GPU, some already over, some future; when
    crowded, many more, all running now, mostly interruptible."""
    taken: dict[int, list[tuple[float, float]]] = defaultdict(list)
    busy = []
    for rental_id in range(900, 900 + draw(st.integers(0, 25 if crowded else 12))):
        node = draw(st.sampled_from(nodes))
        if crowded or draw(st.booleans()):
            start = NOW - QUARTER * draw(st.integers(0, 12))
            end = NOW + QUARTER * draw(st.integers(-1, 24))
        else:
            start = NOW + QUARTER * draw(st.integers(0, 20))
            end = start + QUARTER * draw(st.integers(1, 24))
        gpus = [
            g
            for g in draw(st.sets(st.sampled_from(node.gpus), min_size=1))
            if not any(overlaps((start, end), r) for r in taken[g.gpu_id])
        ]
        interruptible = draw(st.sampled_from([True, True, False] if crowded else [True, False]))
        price = draw(st.sampled_from(PRICES)) / (2 if interruptible else 1)
        priority = draw(st.sampled_from([0, 0, 0, 1, 2]))
        for g in gpus:
            taken[g.gpu_id].append((start, end))
            busy.append(
                Busy(
                    gpu_id=g.gpu_id,
                    rental_id=rental_id,
                    start=start,
                    end=end,
                    interruptible=interruptible,
                    price=price,
                    priority=priority,
                )
            )
    return tuple(busy)


@st.composite
def request_strategy(draw, rental_id: int) -> Request:
    interruptible = draw(st.booleans())
    start = draw(
        st.sampled_from([0.0, 0.0, NOW - QUARTER, NOW + QUARTER * draw(st.integers(1, 24))])
    )
    deadline = draw(st.sampled_from([None, None, None, None, NOW, NOW - QUARTER, NOW + 8 * HOUR]))
    if deadline is not None and deadline < start:
        deadline = None
    return Request(
        rental_id=rental_id,
        created_at=NOW - QUARTER * draw(st.integers(0, 12)),
        priority=draw(st.integers(0, 2)),
        gpus_per_node=draw(st.sampled_from([1, 1, 2, 2, 3, 4, 8])),
        node_count=draw(st.sampled_from([1, 1, 1, 2, 2, 3])),
        duration=QUARTER * draw(st.integers(1, 24)),
        start=start,
        start_deadline=deadline,
        gpu_models=draw(st.sampled_from([None, None, frozenset({"a100"}), frozenset({"h100"})])),
        gpu_families=draw(st.sampled_from([None, None, frozenset({"a100", "h100"})])),
        min_memory_gb=draw(st.sampled_from([0, 0, 0, 80])),
        same_group=draw(st.booleans()),
        region=draw(st.sampled_from([None, None, None, None, "eu", "us-east"])),
        max_price=draw(st.sampled_from([None, None, Decimal("1.50"), Decimal("2.00")])),
        interruptible=interruptible,
        bid=draw(st.sampled_from(PRICES)) * draw(st.sampled_from([Decimal("0.5"), 1]))
        if interruptible
        else None,
        ssh=draw(st.sampled_from([False, False, True])),
        internet=draw(st.sampled_from([False, True, True])),
        min_interconnect_gbps=draw(st.sampled_from([0, 0, 0, 200])),
        image=draw(st.sampled_from(["", "gpumarket/harness:dev", "ghcr.io/team/train:1"])),
    )


@st.composite
def policy_strategy(draw) -> Policy:
    return Policy(
        first_fit=draw(st.booleans()),
        preemption=draw(st.booleans()),
        reserve_depth=draw(st.integers(0, 3)),
        future_candidates=draw(st.integers(1, 3)),
        horizon=draw(st.sampled_from([4 * HOUR, 48 * HOUR])),
    )


@st.composite
def scenario(draw, crowded: bool = False) -> tuple[Snapshot, Policy]:
    nodes = draw(nodes_strategy())
    busy = draw(busy_strategy(nodes, crowded))
    pending = tuple(draw(request_strategy(i)) for i in range(1, draw(st.integers(1, 10)) + 1))
    return Snapshot(now=NOW, nodes=nodes, busy=busy, pending=pending), draw(policy_strategy())


# -- an independent referee: can the request be hosted, whatever the engine's index says? --------


def node_can_host(node: Node, req: Request, held, t0: float, t1: float) -> bool:
    free = [
        g
        for g in node.gpus
        if gpu_matches(req, g) and not any(overlaps((t0, t1), r) for r in held[g.gpu_id])
    ]
    if not req.same_group:
        return len(free) >= req.gpus_per_node
    if req.gpus_per_node == 1:
        return bool(free)
    counts: dict[str, int] = defaultdict(int)
    for g in free:
        if g.group:
            counts[g.group] += 1
    return max(counts.values(), default=0) >= req.gpus_per_node


def fits(snap: Snapshot, req: Request, held) -> bool:
    t0 = max(snap.now, req.start)
    hosts = [
        n
        for n in snap.nodes
        if location_ok(req, n)
        and price_ok(req, n)
        and (n.ssh_capable or not req.ssh)
        and (n.internet_capable or not req.internet)
        and (not req.image or image_allowed(n.image_allow, req.image))
        and node_can_host(n, req, held, t0, t0 + req.duration)
    ]
    if req.node_count == 1:
        return bool(hosts)
    # A gang's members share one cluster; a node without one hosts no member.
    per_cluster = Counter(
        n.cluster
        for n in hosts
        if n.cluster is not None and n.interconnect_gbps >= req.min_interconnect_gbps
    )
    return max(per_cluster.values(), default=0) >= req.node_count


def may_stop(req: Request, b: Busy) -> bool:
    return (
        b.interruptible
        and b.priority <= req.priority
        and (not req.interruptible or b.price < req.bid)
    )


def replay_completeness(snap: Snapshot, policy: Policy, result) -> list[str]:
    """Replay the decisions in the engine's order and check that every request left waiting for
    capacity could really not be placed then, not even by stopping every eligible victim."""
    errors = []
    busy_on: dict[int, list[Busy]] = defaultdict(list)
    for b in snap.busy:
        if b.end > snap.now:
            busy_on[b.gpu_id].append(b)
    planned_on: dict[int, list[tuple[float, float]]] = defaultdict(list)

    def held(spare=lambda b: False):
        view = defaultdict(list)
        for gpu, items in busy_on.items():
            view[gpu] += [(b.start, b.end) for b in items if not spare(b)]
        for gpu, ranges in planned_on.items():
            view[gpu] += ranges
        return view

    def hold(nodes, start, end):
        for _, gpus in nodes:
            for g in gpus:
                planned_on[g].append((start, end))

    placements = {p.rental_id: p for p in result.placements}
    reservations = {r.rental_id: r for r in result.reservations}
    waiting = {w.rental_id: w.reason for w in result.waiting}
    stopped_for = defaultdict(set)
    for p in result.preemptions:
        stopped_for[p.for_rental_id].add(p.victim_rental_id)
    order = sorted(
        snap.pending,
        key=lambda r: (-effective_priority(r, snap.now, policy), r.created_at, r.rental_id),
    )
    for req in order:
        if req.rental_id in placements:
            victims = stopped_for[req.rental_id]
            for gpu, items in busy_on.items():
                busy_on[gpu] = [b for b in items if b.rental_id not in victims]
            p = placements[req.rental_id]
            hold(p.nodes, p.start, p.end)
            continue
        reason = waiting.get(req.rental_id)
        start = max(snap.now, req.start)
        if reason is None or start > snap.now + policy.horizon:
            continue
        if fits(snap, req, held()):
            errors.append(f"{req.rental_id} waits ({reason}) but fits")
        preemptible = policy.preemption and start == snap.now
        if preemptible and fits(snap, req, held(lambda b, req=req: may_stop(req, b))):
            errors.append(f"{req.rental_id} waits ({reason}) but preemption would place it")
        if req.rental_id in reservations:
            r = reservations[req.rental_id]
            hold(r.nodes, r.start, r.end)
    return errors


@PROPERTY
@given(st.one_of(scenario(), scenario(crowded=True)))
def test_plan_never_over_allocates_and_keeps_every_constraint(case):
    snap, policy = case
    result = plan(snap, policy)
    assert plan_violations(snap, result, policy) == []


@PROPERTY
@given(st.one_of(scenario(), scenario(crowded=True)))
def test_nothing_waits_for_capacity_that_is_there(case):
    snap, policy = case
    result = plan(snap, policy)
    assert replay_completeness(snap, policy, result) == []


@PROPERTY
@given(scenario())
def test_plan_is_deterministic(case):
    snap, policy = case
    assert plan(snap, policy) == plan(snap, policy)


@settings(max_examples=200, deadline=None)
@given(nodes_strategy(), request_strategy(1), st.booleans())
def test_never_fits_agrees_with_placing_on_an_idle_cluster(nodes, req, first_fit):
    reason = never_fits(req, nodes)
    deadline_ok = req.start_deadline is None or req.start_deadline >= max(NOW, req.start)
    result = plan(Snapshot(now=NOW, nodes=nodes, pending=(req,)), Policy(first_fit=first_fit))
    placed = bool(result.placements)
    if reason is None and deadline_ok:
        assert placed, result
    if reason is not None:
        assert not placed, reason
