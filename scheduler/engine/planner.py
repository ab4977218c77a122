"""One scheduling cycle: an in-memory capacity index, then one decision per pending request.

Capacity is kept per GPU as a sorted list of time intervals (existing allocations, placements
made earlier in this plan, and backfill holds), so every check is a time-range check and a GPU
can never be given out twice for overlapping times.

To avoid scanning every node per request, nodes are grouped into classes of identical hardware
and location (pool, region, GPU kinds, size, largest topology group), so a request's hardware
and location constraints select whole classes. Prices are set per node, so they are kept out of
the class: within a class, nodes of one price and minimum bid form a tier, and a request's price
constraint admits tiers (cheapest first, by bisection). A class some of whose tiers are priced
out is still visited, and its nodes are checked one by one against the admitted tiers.

Within a class each node sits in a bucket by the number of its GPUs idle now, sorted by its
static score (price, reliability), and each GPU count keeps the set of classes with a non-empty
bucket. A request starting now only visits buckets with enough idle GPUs, in increasing order of
what would be left over, and stops as soon as no remaining node can beat the best found, or, in
a partly admitted class, once the static score passes that of the last admitted node. A second
bucket index counts GPUs that preemption could free, sorted by the cheapest victim, so
preemption only visits nodes running interruptible work and stops where victims get dearer than
the best found.

A future window cannot use the idle-now buckets; it visits the admitted tiers' nodes (tiers in
order of price, or of first appearance when the request sets no price) and compares a bounded
number that fit (`Policy.future_candidates`). Finding the earliest start of a blocked request
sweeps interval boundaries over every admitted node, which is why only `Policy.reserve_depth`
requests per cycle get one.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right, insort
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from decimal import Decimal
from itertools import accumulate, islice
from math import inf, nextafter
from operator import attrgetter, itemgetter

from scheduler.engine.feasibility import (
    describe_hardware,
    describe_location,
    gpu_matches,
    location_ok,
)
from scheduler.engine.types import (
    Busy,
    Expired,
    Gpu,
    Node,
    NodeGpus,
    Placement,
    Plan,
    Policy,
    Preemption,
    RentalId,
    Request,
    Reservation,
    Snapshot,
    Waiting,
)

# Interval tags: what holds a GPU for a time range. Only _SPOT intervals can be preempted.
_PLAN, _HOLD, _FIXED, _SPOT = range(4)

Interval = tuple[float, float, RentalId, int]
"""(start, end, rental id, tag); lists are sorted by start only, so ids are never compared."""

_by_start = itemgetter(0)
_by_index = attrgetter("index")
_ZERO = Decimal(0)

DEFAULT_POLICY = Policy()


def plan(snapshot: Snapshot, policy: Policy = DEFAULT_POLICY) -> Plan:
    """Decide, for every pending request of the snapshot, a placement or why it waits."""
    return _Planner(snapshot, policy).run()


def effective_priority(request: Request, now: float, policy: Policy = DEFAULT_POLICY) -> float:
    """Priority class plus `aging_per_second` for every second the request has waited."""
    return request.priority + policy.aging_per_second * max(0.0, now - request.created_at)


class _Victim:
    """An interruptible rental of the snapshot and every GPU interval it holds."""

    __slots__ = ("cost", "price", "priority", "start", "where")

    def __init__(self, price: Decimal, priority: int, start: float) -> None:
        self.price = price
        self.priority = priority
        self.start = start
        self.where: list[tuple[_NodeState, int]] = []
        # Revenue per hour lost by stopping it: its price on every GPU it holds.
        self.cost = Decimal(0)


class _Class:
    """Nodes of identical hardware and location; the unit of matching a request."""

    __slots__ = (
        "buckets",
        "cid",
        "entries",
        "example",
        "kinds",
        "ladders",
        "max_group",
        "rbuckets",
        "size",
        "tiers",
    )

    def __init__(self, cid: int, node: Node, kinds: frozenset[int], max_group: int) -> None:
        self.cid = cid
        self.example = node
        self.kinds = kinds
        self.max_group = max_group
        self.size = len(node.gpus)
        # In order of first appearance, and by price (gate 0) and minimum bid (gate 1).
        self.tiers: list[_Tier] = []
        self.ladders: tuple[_Ladder, _Ladder]
        # (static score, node id), sorted: all nodes, and nodes by idle count.
        self.entries: list[tuple[int, int]] = []
        self.buckets: list[list[tuple[int, int]]] = [[] for _ in range(self.size + 1)]
        # (cheapest victim's cost, node id), sorted: nodes by reclaimable count.
        self.rbuckets: list[list[tuple[Decimal, int]]] = [[] for _ in range(self.size + 1)]


class _Tier:
    """The nodes of one class at one price and minimum bid."""

    __slots__ = ("cls", "entries", "min_bid", "price", "ranks", "tid")

    def __init__(self, tid: int, cls: _Class, node: Node) -> None:
        self.tid = tid
        self.cls = cls
        self.price = node.price_per_gpu_hour
        self.min_bid = node.min_bid
        # (static score, node id), sorted.
        self.entries: list[tuple[int, int]] = []
        # Its place on the class's price and minimum-bid ladders.
        self.ranks = [0, 0]


class _Ladder:
    """A class's tiers by one gate (price or minimum bid), cheapest first, ties by first
    appearance, with running figures so that a cap admits a prefix found by one bisection."""

    __slots__ = ("highest", "lowest", "nodes", "tiers", "values")

    def __init__(self, tiers: list[_Tier], gate: int) -> None:
        self.tiers = sorted(tiers, key=_GATE_ORDER[gate])
        self.values = [_gate(tier, gate) for tier in self.tiers]
        # Over the first i + 1 tiers: how many nodes, their lowest and highest static score.
        self.nodes = list(accumulate(len(tier.entries) for tier in self.tiers))
        self.lowest = list(accumulate((tier.entries[0][0] for tier in self.tiers), min))
        self.highest = list(accumulate((tier.entries[-1][0] for tier in self.tiers), max))
        for rank, tier in enumerate(self.tiers):
            tier.ranks[gate] = rank


class _Shape:
    """What nodes with the same GPUs in the same topology have in common."""

    __slots__ = ("group", "kind", "kinds", "max_group", "positions")

    def __init__(self, kind: list[int], gpus: Sequence[Gpu]) -> None:
        self.kind = kind
        self.kinds = frozenset(kind)
        self.positions = list(range(len(gpus)))
        self.group = _group_ids(gpus)
        self.max_group = _max_group(self.group, len(gpus))


class _NodeState:
    """Mutable per-node capacity: intervals per GPU position (GPUs sorted by index)."""

    __slots__ = (
        "clear",
        "cls",
        "first",
        "glevel",
        "gpu_ids",
        "group",
        "idle_groups",
        "idle_until",
        "ivs",
        "kind",
        "level",
        "min_spot",
        "min_victim",
        "node",
        "node_id",
        "positions",
        "ranks",
        "rentry",
        "rlevel",
        "static",
    )

    def __init__(self, node: Node, gpus: Sequence[Gpu], shape: _Shape, static: int) -> None:
        self.node = node
        self.node_id = node.node_id
        self.gpu_ids = [gpu.gpu_id for gpu in gpus]
        # Shared by every node of the same shape, never mutated.
        self.kind = shape.kind
        self.positions = shape.positions
        self.group = shape.group
        self.ivs: list[list[Interval]] = [[] for _ in gpus]
        self.static = static
        # Summaries kept up to date by _Planner._refresh: GPUs idle now; most of them in one
        # topology group; until when all of them stay idle; GPUs idle now or held now only by
        # interruptible work; first interval start; last interval end; lowest interruptible
        # price and victim cost on the node.
        self.level = 0
        self.glevel = 0
        self.idle_groups: list[int] = []
        self.idle_until = inf
        self.rlevel = 0
        self.rentry: tuple[Decimal, int] = (_ZERO, node.node_id)
        self.first = inf
        self.clear = -inf
        self.min_spot: Decimal | None = None
        self.min_victim: Decimal | None = None
        self.cls: _Class
        # Its tier's place on its class's price and minimum-bid ladders.
        self.ranks: list[int]

    def matching(self, kinds: frozenset[int]) -> list[int]:
        return [p for p in self.positions if self.kind[p] in kinds]


class _Match:
    """Nodes admitted by a set of constraints. Hardware and location admit whole classes (a
    match); a price cap then admits, in each class, the first tiers of its ladder for the gate
    the cap applies to (a view of the match, made by `priced`)."""

    __slots__ = (
        "base",
        "classes",
        "count",
        "full",
        "gate",
        "ids",
        "kinds",
        "min_static",
        "nodes",
        "orders",
        "partial",
        "views",
    )

    def __init__(
        self,
        kinds: frozenset[int],
        classes: list[tuple[_Class, bool]],
        base: _Match | None = None,
        gate: int = 0,
        cap: Decimal | None = None,
    ) -> None:
        self.kinds = kinds
        self.base = base
        self.gate = gate
        # (class, whether every GPU kind of the class matches) of the classes with a node
        # admitted, and the same by class id.
        self.classes: list[tuple[_Class, bool]] = []
        # Classes only some of whose tiers are admitted: by class id, how many tiers of the
        # ladder and the highest static score of their nodes (buckets are sorted by it).
        self.partial: dict[int, tuple[int, int]] = {}
        # Tiers and nodes admitted.
        self.count = self.nodes = 0
        lowest: list[int] = []
        for cls, full in classes:
            ladder = cls.ladders[gate]
            n = len(ladder.tiers) if cap is None else bisect_right(ladder.values, cap)
            if n == 0:
                continue
            if n < len(ladder.tiers):
                self.partial[cls.cid] = (n, ladder.highest[n - 1])
            self.count += n
            self.nodes += ladder.nodes[n - 1]
            lowest.append(ladder.lowest[n - 1])
            self.classes.append((cls, full))
        self.min_static = min(lowest, default=0)
        self.full = {cls.cid: full for cls, full in self.classes}
        self.ids = set(self.full)
        self.orders: dict[int | None, list[_Tier]] = {}
        self.views: dict[tuple[int, Decimal], _Match] = {}

    def priced(self, gate: int, cap: Decimal | None) -> _Match:
        """The nodes whose price (gate 0) or minimum bid (gate 1) is within cap (cached)."""
        if cap is None:
            return self
        view = self.views.get((gate, cap))
        if view is None:
            view = self.views[gate, cap] = _Match(self.kinds, self.classes, self, gate, cap)
        return view

    def tiers(self) -> Iterable[_Tier]:
        """The admitted tiers: a view's cheapest first by its gate (a prefix of the match's
        tiers in that order), a match's in order of first appearance; ties in order of first
        appearance."""
        if self.base is None:
            return self.ordered(None)
        return islice(self.base.ordered(self.gate), self.count)

    def ordered(self, gate: int | None) -> list[_Tier]:
        """Every tier of the match by a gate, or by first appearance (None); sorted on first
        use, as only future windows and reservations need it."""
        order = self.orders.get(gate)
        if order is None:
            key = _TIER_ORDER if gate is None else _GATE_ORDER[gate]
            tiers = (tier for cls, _ in self.classes for tier in cls.tiers)
            order = self.orders[gate] = sorted(tiers, key=key)
        return order


def _gate(tier: _Tier, gate: int) -> Decimal:
    return tier.min_bid if gate else tier.price


_TIER_ORDER = attrgetter("tid")
_GATE_ORDER = (attrgetter("price", "tid"), attrgetter("min_bid", "tid"))


class _Ask:
    """A request with what every search step needs precomputed."""

    __slots__ = ("k", "m", "match", "req", "same_group")

    def __init__(self, req: Request, match: _Match) -> None:
        self.req = req
        self.k = req.gpus_per_node
        self.m = req.node_count
        self.same_group = req.same_group
        # On-demand compares the node price with max_price, interruptible the node's minimum
        # bid with its bid.
        if req.interruptible:
            self.match = match.priced(1, req.bid)
        else:
            self.match = match.priced(0, req.max_price)

    def positions(self, ns: _NodeState, full: bool) -> list[int]:
        return ns.positions if full else ns.matching(self.match.kinds)


# A candidate node: (score, node id, state, chosen positions); tuples sort by score then node id.
_Choice = tuple[int, int, _NodeState, list[int]]


def _group_ids(gpus: Sequence[Gpu]) -> list[int] | None:
    """Small-int topology group per position, or None when all GPUs share one group.

    A GPU without a group label is a group of its own.
    """
    labels: dict[str, int] = {}
    ids = []
    for position, gpu in enumerate(gpus):
        if gpu.group:
            ids.append(labels.setdefault(gpu.group, len(labels)))
        else:
            ids.append(-1 - position)
    if len(set(ids)) == 1:
        return None
    return ids


def _max_group(group: list[int] | None, size: int) -> int:
    if group is None:
        return size
    counts: dict[int, int] = {}
    for g in group:
        counts[g] = counts.get(g, 0) + 1
    return max(counts.values())


def _pick(
    group: list[int] | None, free: list[int], k: int, same_group: bool, best_fit: bool
) -> tuple[list[int], int] | None:
    """Choose k of the free positions; returns them with the number of topology groups spanned.

    Best fit takes the smallest group that holds all k, so larger groups stay whole; failing
    that it spans the fewest groups. First fit takes the lowest indices.
    """
    if len(free) < k:
        return None
    if group is None:
        return free[:k], 1
    if not best_fit and not same_group:
        chosen = free[:k]
        return chosen, len({group[p] for p in chosen})
    by_group: dict[int, list[int]] = {}
    for p in free:
        by_group.setdefault(group[p], []).append(p)
    fitting = [ps for ps in by_group.values() if len(ps) >= k]
    if fitting:
        ps = min(fitting, key=len) if best_fit else fitting[0]
        return ps[:k], 1
    if same_group:
        return None
    chosen = []
    spans = 0
    for ps in sorted(by_group.values(), key=len, reverse=True):
        chosen += ps[: k - len(chosen)]
        spans += 1
        if len(chosen) == k:
            break
    return sorted(chosen), spans


def _spans(sizes: list[int], k: int) -> int:
    """How many groups k GPUs span when taken from the largest groups first."""
    total = 0
    for spans, size in enumerate(sizes, start=1):
        total += size
        if total >= k:
            return spans
    return len(sizes)


def _free(intervals: list[Interval], t0: float, t1: float) -> bool:
    # A plain loop: this runs for every GPU of every node a future window visits, and a
    # generator costs more than the check itself.
    for start, end, _, _ in intervals:  # noqa: SIM110
        if start < t1 and end > t0:
            return False
    return True


def _latest_start(start: float, duration: float) -> float:
    """The latest t with t + duration <= start, exact under float rounding."""
    t = start - duration
    while t + duration > start:
        t = nextafter(t, -inf)
    return t


def _covered(events: list[tuple[float, int]], need: int) -> list[tuple[float, float]]:
    """Closed ranges covered by at least `need` of the closed ranges given as open/close events."""
    events.sort()
    out = []
    count = 0
    opened = 0.0
    for x, kind in events:
        if kind == 0:
            count += 1
            if count == need:
                opened = x
        else:
            if count == need:
                out.append((opened, x))
            count -= 1
    return out


def _merge(ranges: list[tuple[float, float]]) -> list[tuple[float, float]]:
    ranges.sort()
    out: list[tuple[float, float]] = []
    for lo, hi in ranges:
        if out and lo <= out[-1][1]:
            if hi > out[-1][1]:
                out[-1] = (out[-1][0], hi)
        else:
            out.append((lo, hi))
    return out


def _node_gpus(chosen: list[_Choice]) -> NodeGpus:
    return tuple(
        sorted(
            (ns.node_id, tuple(ns.gpu_ids[p] for p in positions)) for _, _, ns, positions in chosen
        )
    )


def _drop(bucket: list[tuple], entry: tuple, live: set[int], cid: int) -> None:
    del bucket[bisect_left(bucket, entry)]
    if not bucket:
        live.discard(cid)


def _move(
    cls: _Class,
    buckets: list[list],
    live: list[set[int]],
    old: tuple[int, tuple],
    new: tuple[int, tuple],
) -> None:
    """Move a node's entry from bucket old[0] to bucket new[0] (the entry may change too)."""
    _drop(buckets[old[0]], old[1], live[old[0]], cls.cid)
    insort(buckets[new[0]], new[1])
    live[new[0]].add(cls.cid)


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _hours(seconds: float) -> str:
    return f"{seconds / 3600:g} h"


class _Planner:
    def __init__(self, snapshot: Snapshot, policy: Policy) -> None:
        self.now = snapshot.now
        self.policy = policy
        self.pending = snapshot.pending
        self.best_fit = not policy.first_fit
        self.pack = policy.pack_weight if self.best_fit else 0
        self.topo = policy.topology_weight if self.best_fit else 0
        self.kind_ids: dict[tuple[str, str, int, float], int] = {}
        self.kind_gpus: list[Gpu] = []
        self.nodes: dict[int, _NodeState] = {}
        self.classes: dict[tuple, _Class] = {}
        self.class_list: list[_Class] = []
        self.tiers: dict[tuple, _Tier] = {}
        self.victims: dict[RentalId, _Victim] = {}
        # Request constraints repeat, so what they admit is cached at three levels: GPU kinds,
        # classes by location, and classes by both (each match keeps its views by price cap).
        self.kinds_cache: dict[tuple, frozenset[int]] = {}
        self.located: dict[tuple[str | None, str], list[_Class]] = {}
        self.matches: dict[tuple, _Match] = {}
        self.reserves_left = policy.reserve_depth
        self.placements: list[Placement] = []
        self.preemptions: list[Preemption] = []
        self.waiting: list[Waiting] = []
        self.expired: list[Expired] = []
        self.reservations: list[Reservation] = []
        self.max_level = 0
        # Per GPU count, the ids of the classes with a non-empty (reclaimable) bucket of it.
        self.live: list[set[int]] = []
        self.rlive: list[set[int]] = []
        where = self._index_nodes(snapshot.nodes)
        self._index_busy(snapshot.busy, where)

    # -- building the index -----------------------------------------------------------------------

    def _static_score(self, node: Node) -> int:
        if not self.best_fit:
            return 0
        cents = int((node.price_per_gpu_hour * 100).to_integral_value())
        unreliability = round((1.0 - node.reliability) * 1000)
        return self.policy.price_weight * cents + self.policy.reliability_weight * unreliability

    def _index_nodes(self, nodes: Sequence[Node]) -> dict[int, tuple[_NodeState, int]]:
        where: dict[int, tuple[_NodeState, int]] = {}
        shapes: dict[tuple, _Shape] = {}
        statics: dict[tuple[Decimal, float], int] = {}
        for node in nodes:
            if not node.gpus:
                continue
            gpus = sorted(node.gpus, key=_by_index)
            shape_key = tuple(
                (gpu.model, gpu.family, gpu.memory_gb, gpu.tensor_tflops, gpu.group) for gpu in gpus
            )
            shape = shapes.get(shape_key)
            if shape is None:
                shape = shapes[shape_key] = _Shape([self._kind_id(gpu) for gpu in gpus], gpus)
            static_key = (node.price_per_gpu_hour, node.reliability)
            static = statics.get(static_key)
            if static is None:
                static = statics[static_key] = self._static_score(node)
            ns = _NodeState(node, gpus, shape, static)
            tier_key = (
                node.pool,
                node.region,
                shape.kinds,
                len(gpus),
                shape.max_group,
                node.price_per_gpu_hour,
                node.min_bid,
            )
            tier = self.tiers.get(tier_key)
            if tier is None:
                class_key = tier_key[:5]
                cls = self.classes.get(class_key)
                if cls is None:
                    cls = _Class(len(self.class_list), node, shape.kinds, shape.max_group)
                    self.classes[class_key] = cls
                    self.class_list.append(cls)
                tier = self.tiers[tier_key] = _Tier(len(self.tiers), cls, node)
                cls.tiers.append(tier)
            cls = tier.cls
            ns.cls, ns.ranks = cls, tier.ranks
            entry = (static, ns.node_id)
            cls.entries.append(entry)
            tier.entries.append(entry)
            self.nodes[ns.node_id] = ns
            for position, gpu in enumerate(gpus):
                where[gpu.gpu_id] = (ns, position)
        for tier in self.tiers.values():
            tier.entries.sort()
        for cls in self.class_list:
            cls.ladders = (_Ladder(cls.tiers, 0), _Ladder(cls.tiers, 1))
        return where

    def _kind_id(self, gpu: Gpu) -> int:
        key = (gpu.model, gpu.family, gpu.memory_gb, gpu.tensor_tflops)
        kind_id = self.kind_ids.get(key)
        if kind_id is None:
            kind_id = self.kind_ids[key] = len(self.kind_gpus)
            self.kind_gpus.append(gpu)
        return kind_id

    def _index_busy(self, busy: Sequence[Busy], where: dict[int, tuple[_NodeState, int]]) -> None:
        now = self.now
        for b in busy:
            located = where.get(b.gpu_id)
            if b.end <= now or located is None:
                continue
            ns, position = located
            tag = _SPOT if b.interruptible else _FIXED
            ns.ivs[position].append((b.start, b.end, b.rental_id, tag))
            if b.interruptible:
                victim = self.victims.get(b.rental_id)
                if victim is None:
                    victim = _Victim(b.price, b.priority, b.start)
                    self.victims[b.rental_id] = victim
                victim.start = min(victim.start, b.start)
                victim.where.append(located)
        for victim in self.victims.values():
            gpus = len({(ns.node_id, p) for ns, p in victim.where})
            victim.cost = victim.price * gpus
        for ns in self.nodes.values():
            for intervals in ns.ivs:
                if len(intervals) > 1:
                    intervals.sort(key=_by_start)
            ns.level, ns.rlevel = self._summarize(ns)
        self.max_level = max((cls.size for cls in self.class_list), default=0)
        self.live = [set() for _ in range(self.max_level + 1)]
        self.rlive = [set() for _ in range(self.max_level + 1)]
        for cls in self.class_list:
            cls.entries.sort()
            for static, node_id in cls.entries:
                ns = self.nodes[node_id]
                for level in self._bucket_levels(ns.level, ns.level):
                    cls.buckets[level].append((static, node_id))
                    self.live[level].add(cls.cid)
                cls.rbuckets[ns.rlevel].append(ns.rentry)
                self.rlive[ns.rlevel].add(cls.cid)
            for rbucket in cls.rbuckets:
                rbucket.sort()

    def _bucket_levels(self, low: int, high: int) -> range:
        """The idle-count buckets a node at idle count `high` belongs to and one at `low` does not
        (low == high: all of them). Best fit files a node under its exact count; first fit under
        every count up to it, so the node with the lowest id that has k idle GPUs heads bucket k."""
        if self.best_fit:
            return range(high, high + 1)
        return range(0 if low == high else low + 1, high + 1)

    def _summarize(self, ns: _NodeState) -> tuple[int, int]:
        """Update the node's time and price summaries; returns its idle and reclaimable counts."""
        now, group = self.now, ns.group
        level = reclaimable = 0
        first, clear, idle_until = inf, -inf, inf
        spots: list[_Victim] = []
        idle_by_group: dict[int, int] = {}
        for p, intervals in enumerate(ns.ivs):
            if intervals:
                # Sorted by start, so the head is the earliest and the only one that can be
                # running now.
                head_start = intervals[0][0]
                first = min(first, head_start)
                for _, end, rental_id, tag in intervals:
                    clear = max(clear, end)
                    if tag == _SPOT:
                        spots.append(self.victims[rental_id])
                if head_start <= now:
                    reclaimable += intervals[0][3] == _SPOT
                    continue
                idle_until = min(idle_until, head_start)
            level += 1
            reclaimable += 1
            if group is not None:
                idle_by_group[group[p]] = idle_by_group.get(group[p], 0) + 1
        ns.first, ns.clear, ns.idle_until = first, clear, idle_until
        if spots:
            ns.min_spot = min(victim.price for victim in spots)
            ns.min_victim = min(victim.cost for victim in spots)
        else:
            ns.min_spot = ns.min_victim = None
        if group is None:
            ns.idle_groups = [level]
        else:
            ns.idle_groups = sorted(idle_by_group.values(), reverse=True) or [0]
        ns.glevel = ns.idle_groups[0]
        return level, reclaimable

    def _refresh(self, ns: _NodeState) -> None:
        level, reclaimable = self._summarize(ns)
        entry, cls = (ns.static, ns.node_id), ns.cls
        if level != ns.level:
            if self.best_fit:
                _move(cls, cls.buckets, self.live, (ns.level, entry), (level, entry))
            elif level < ns.level:
                for stale in self._bucket_levels(level, ns.level):
                    _drop(cls.buckets[stale], entry, self.live[stale], cls.cid)
            else:
                for fresh in self._bucket_levels(ns.level, level):
                    insort(cls.buckets[fresh], entry)
                    self.live[fresh].add(cls.cid)
            ns.level = level
        rentry = (ns.min_victim or _ZERO, ns.node_id)
        if reclaimable != ns.rlevel or rentry != ns.rentry:
            _move(cls, cls.rbuckets, self.rlive, (ns.rlevel, ns.rentry), (reclaimable, rentry))
            ns.rlevel, ns.rentry = reclaimable, rentry

    def _match(self, req: Request) -> _Match:
        """The classes the request's hardware and location constraints admit (cached)."""
        key = (
            req.gpu_models,
            req.gpu_families,
            req.min_memory_gb,
            req.min_tensor_tflops,
            req.region,
            req.pool,
            req.gpus_per_node,
            req.same_group,
        )
        match = self.matches.get(key)
        if match is None:
            kinds_key = key[:4]
            kinds = self.kinds_cache.get(kinds_key)
            if kinds is None:
                kinds = frozenset(i for i, g in enumerate(self.kind_gpus) if gpu_matches(req, g))
                self.kinds_cache[kinds_key] = kinds
            located = self.located.get((req.region, req.pool))
            if located is None:
                located = [cls for cls in self.class_list if location_ok(req, cls.example)]
                self.located[req.region, req.pool] = located
            k = req.gpus_per_node
            classes = [
                (cls, cls.kinds <= kinds)
                for cls in located
                if cls.kinds & kinds
                and cls.size >= k
                and (not req.same_group or cls.max_group >= k)
            ]
            match = self.matches[key] = _Match(kinds, classes)
        return match

    # -- the cycle --------------------------------------------------------------------------------

    def run(self) -> Plan:
        now, policy = self.now, self.policy
        order = sorted(
            self.pending,
            key=lambda r: (-effective_priority(r, now, policy), r.created_at, r.rental_id),
        )
        for req in order:
            reason = self._decide(req)
            if reason is not None:
                self.waiting.append(Waiting(rental_id=req.rental_id, reason=reason))
        return Plan(
            placements=tuple(self.placements),
            preemptions=tuple(self.preemptions),
            waiting=tuple(self.waiting),
            expired=tuple(self.expired),
            reservations=tuple(self.reservations),
        )

    def _expire(self, req: Request, reason: str) -> None:
        self.expired.append(Expired(rental_id=req.rental_id, reason=reason))

    def _decide(self, req: Request) -> str | None:
        """Place, preempt for, expire or hold the request; returns why it waits, if it does."""
        now = self.now
        deadline = req.start_deadline
        if deadline is not None and deadline < now:
            self._expire(req, f"start deadline {_iso(deadline)} passed without a placement")
            return None
        start = max(now, req.start)
        if deadline is not None and start > deadline:
            self._expire(req, "start_deadline is before start")
            return None
        if start > now + self.policy.horizon:
            return (
                f"start in the future: {_iso(start)} is beyond the "
                f"{_hours(self.policy.horizon)} planning horizon"
            )
        if req.interruptible and (req.bid is None or req.bid <= 0):
            return "an interruptible request needs a positive bid"
        if req.interruptible and req.max_price is not None and req.bid > req.max_price:
            return f"bid ${req.bid:.2f} is above max price ${req.max_price:.2f}"
        match = self._match(req)
        if not match.classes:
            group = " in one topology group" if req.same_group else ""
            return (
                f"no node in {describe_location(req)} has {req.gpus_per_node} matching "
                f"GPUs{describe_hardware(req)}{group}"
            )
        ask = _Ask(req, match)
        if not ask.match.classes:
            return self._priced_out(req, match)
        end = start + req.duration
        chosen = self._search(ask, start, end)
        if len(chosen) == ask.m:
            self._place(req, start, end, chosen)
            return None
        if start == now and self.policy.preemption and self._preempt(ask, end, chosen):
            return None
        reason = self._no_capacity(ask, start, len(chosen))
        if deadline is not None and deadline <= now:
            self._expire(
                req, f"start deadline {_iso(deadline)} reached without a placement: {reason}"
            )
            return None
        if self.reserves_left > 0:
            self.reserves_left -= 1
            reason += self._reserve(ask, start)
        return reason

    # -- finding nodes ----------------------------------------------------------------------------

    def _search(self, ask: _Ask, t0: float, t1: float) -> list[_Choice]:
        """The best m nodes that can each host the request over [t0, t1), best first."""
        if t0 == self.now:
            return self._search_now(ask, t1)
        return self._search_future(ask, t0, t1)

    def _search_now(self, ask: _Ask, t1: float) -> list[_Choice]:
        k, m, same_group = ask.k, ask.m, ask.same_group
        match, classes, gate = ask.match, self.class_list, ask.match.gate
        pack, topo, nodes = self.pack, self.topo, self.nodes
        best: list[tuple[int, int, _NodeState, bool]] = []
        worst: tuple[int, int] | None = None
        # Buckets in increasing idle count: the packing term only grows, so once even the
        # cheapest node of a level cannot beat the m-th best, no later level can either. First
        # fit's bucket k already holds every node with k or more idle GPUs.
        top = self.max_level if self.best_fit else k
        for level in range(k, top + 1):
            base = pack * (level - k)
            if worst is not None and base + match.min_static > worst[0]:
                break
            for cid in self.live[level] & match.ids:
                bucket = classes[cid].buckets[level]
                if worst is not None and (base + bucket[0][0], bucket[0][1]) >= worst:
                    continue
                full = match.full[cid]
                partial = match.partial.get(cid)
                floor = base + topo * ((k - 1) // classes[cid].max_group)
                for static, node_id in bucket:
                    if worst is not None and (floor + static, node_id) >= worst:
                        break
                    ns = nodes[node_id]
                    if partial is not None and ns.ranks[gate] >= partial[0]:
                        if static > partial[1]:
                            break
                        continue
                    if full and t1 <= ns.idle_until:
                        # Every idle GPU is usable, so the score follows from the idle counts
                        # per group; the GPUs are chosen only if the node wins.
                        if ns.glevel >= k:
                            score = base + static
                        elif same_group:
                            continue
                        else:
                            score = base + static + topo * (_spans(ns.idle_groups, k) - 1)
                    else:
                        if same_group and ns.glevel < k:
                            continue
                        picked = self._pick_now(ns, ask, full, t1)
                        if picked is None:
                            continue
                        score = base + static + topo * (picked[1] - 1)
                    insort(best, (score, node_id, ns, full))
                    if len(best) > m:
                        best.pop()
                    if len(best) == m:
                        worst = best[-1][:2]
        return [
            (score, node_id, ns, self._pick_now(ns, ask, full, t1)[0])
            for score, node_id, ns, full in best
        ]

    def _pick_now(
        self, ns: _NodeState, ask: _Ask, full: bool, t1: float
    ) -> tuple[list[int], int] | None:
        ivs = ns.ivs
        free = [p for p in ask.positions(ns, full) if not ivs[p] or ivs[p][0][0] >= t1]
        return _pick(ns.group, free, ask.k, ask.same_group, self.best_fit)

    def _search_future(self, ask: _Ask, t0: float, t1: float) -> list[_Choice]:
        """Idle counts of now say nothing about a future window, so this visits the matching
        classes' nodes in static-score order and compares the first `future_candidates` that
        fit (at least m)."""
        k, m, same_group, best_fit = ask.k, ask.m, ask.same_group, self.best_fit
        pack, topo, nodes = self.pack, self.topo, self.nodes
        budget = max(self.policy.future_candidates, m)
        best: list[_Choice] = []
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
                    free = [p for p in positions if _free(ivs[p], t0, t1)]
                    spare = len(free) if full else sum(_free(iv, t0, t1) for iv in ivs)
                picked = _pick(ns.group, free, k, same_group, best_fit)
                if picked is None:
                    continue
                score = pack * (spare - k) + static + topo * (picked[1] - 1)
                insort(best, (score, node_id, ns, picked[0]))
                if len(best) > m:
                    best.pop()
                if len(best) == m:
                    worst = best[-1][:2]
                budget -= 1
                if budget == 0:
                    return best
        return best

    def _place(self, req: Request, t0: float, t1: float, chosen: list[_Choice]) -> None:
        self._hold(req, t0, t1, chosen, _PLAN)
        # Interruptible pays its bid; a gang pays one rate, its dearest node's (within max_price).
        price = (
            req.bid
            if req.interruptible
            else max(ns.node.price_per_gpu_hour for _, _, ns, _ in chosen)
        )
        self.placements.append(
            Placement(
                rental_id=req.rental_id,
                start=t0,
                end=t1,
                price_per_gpu_hour=price,
                nodes=_node_gpus(chosen),
            )
        )

    def _hold(self, req: Request, t0: float, t1: float, chosen: list[_Choice], tag: int) -> None:
        interval = (t0, t1, req.rental_id, tag)
        for _, _, ns, positions in chosen:
            for p in positions:
                insort(ns.ivs[p], interval, key=_by_start)
            self._refresh(ns)

    # -- preemption -------------------------------------------------------------------------------

    def _preempt(self, ask: _Ask, t1: float, fitting: list[_Choice]) -> bool:
        """Place the request now by stopping the cheapest set of interruptible rentals.

        `fitting` are the nodes that already fit without preemption (fewer than m): they cost
        nothing. Other nodes are visited only if their GPUs are idle or held by interruptible
        work, skipping those whose victims cannot cost less than the m-th best found; each is
        given its cheapest sufficient set of victims and the m cheapest nodes are taken. Nothing
        is preempted unless all m nodes fit once their victims are gone.
        """
        k, m, match, req = ask.k, ask.m, ask.match, ask.req
        best: list[tuple] = [
            (_ZERO, 0, score, node_id, ns, positions, [])
            for score, node_id, ns, positions in fitting
        ]
        free_ids = {node_id for _, node_id, _, _ in fitting}
        for level in range(k, self.max_level + 1):
            for cid in self.rlive[level] & match.ids:
                full = match.full[cid]
                partial = match.partial.get(cid)
                for cheapest, node_id in self.class_list[cid].rbuckets[level]:
                    # Every node left needs a victim, which costs at least the node's
                    # cheapest, and the bucket is sorted by that.
                    if len(best) == m and cheapest > best[-1][0]:
                        break
                    if node_id in free_ids:
                        continue
                    ns = self.nodes[node_id]
                    if partial is not None and ns.ranks[match.gate] >= partial[0]:
                        continue
                    if ns.level < k and ns.min_spot is not None:
                        # At least k - level GPUs must be freed, each at a bid of min_spot or
                        # more; an interruptible request can only stop lower bids.
                        if len(best) == m and ns.min_spot * (k - ns.level) > best[-1][0]:
                            continue
                        if req.interruptible and ns.min_spot >= req.bid:
                            continue
                    found = self._victims_on(ns, ask.positions(ns, full), ask, t1)
                    if found is None:
                        continue
                    cost, victims, chosen, spans = found
                    score = ns.static + self.topo * (spans - 1)
                    insort(best, (cost, len(victims), score, node_id, ns, chosen, victims))
                    if len(best) > m:
                        best.pop()
        if len(best) < m:
            return False
        stopped: dict[RentalId, None] = {}
        for candidate in best:
            stopped.update(dict.fromkeys(candidate[6]))
        for rental_id in stopped:
            self._evict(rental_id, ask.req)
        self._place(ask.req, self.now, t1, [(c[2], c[3], c[4], c[5]) for c in best])
        return True

    def _victim_order(self, rental_id: RentalId) -> tuple[Decimal, float]:
        """Lowest bid first, then the one that started longest ago (it has had its run)."""
        victim = self.victims[rental_id]
        return victim.price, victim.start

    def _victims_on(
        self, ns: _NodeState, positions: list[int], ask: _Ask, t1: float
    ) -> tuple[Decimal, list[RentalId], list[int], int] | None:
        """The cheapest victims on one node that free k fitting GPUs over [now, t1)."""
        req = ask.req
        blockers: dict[int, set[RentalId]] = {}
        for p in positions:
            held: set[RentalId] | None = set()
            for start, _, rental_id, tag in ns.ivs[p]:
                if start >= t1:
                    break
                victim = self.victims.get(rental_id) if tag == _SPOT else None
                if victim is None or not self._may_preempt(req, victim):
                    held = None
                    break
                held.add(rental_id)
            if held is not None:
                blockers[p] = held
        k, same_group, best_fit = ask.k, ask.same_group, self.best_fit
        if len(blockers) < k:
            return None
        stopped: set[RentalId] = set()

        def fit() -> tuple[list[int], int] | None:
            free = [p for p, held in blockers.items() if held <= stopped]
            return _pick(ns.group, free, k, same_group, best_fit)

        picked = fit()
        order = sorted({r for held in blockers.values() for r in held}, key=self._victim_order)
        taken: list[RentalId] = []
        for rental_id in order:
            if picked is not None:
                break
            taken.append(rental_id)
            stopped.add(rental_id)
            picked = fit()
        if picked is None:
            return None
        # Greedy order may have taken victims a later one made unnecessary: drop the dearest
        # first while the request still fits.
        for rental_id in reversed(taken[:-1]):
            stopped.discard(rental_id)
            trial = fit()
            if trial is None:
                stopped.add(rental_id)
            else:
                picked = trial
        taken = [r for r in taken if r in stopped]
        cost = sum((self.victims[r].cost for r in taken), start=Decimal(0))
        return cost, taken, picked[0], picked[1]

    @staticmethod
    def _may_preempt(req: Request, victim: _Victim) -> bool:
        """Never a higher class; an interruptible request only outbids strictly lower bids."""
        if victim.priority > req.priority:
            return False
        return not req.interruptible or (req.bid is not None and victim.price < req.bid)

    def _evict(self, rental_id: RentalId, req: Request) -> None:
        victim = self.victims[rental_id]
        touched: dict[int, _NodeState] = {}
        for ns, p in victim.where:
            ns.ivs[p] = [iv for iv in ns.ivs[p] if iv[2] != rental_id or iv[3] != _SPOT]
            touched[ns.node_id] = ns
        del self.victims[rental_id]
        for ns in touched.values():
            self._refresh(ns)
        if req.interruptible:
            reason = (
                f"outbid by rental {req.rental_id}: "
                f"${req.bid:.2f} > ${victim.price:.2f} per GPU-hour"
            )
        else:
            reason = f"preempted for on-demand rental {req.rental_id}"
        self.preemptions.append(
            Preemption(victim_rental_id=rental_id, for_rental_id=req.rental_id, reason=reason)
        )

    # -- backfill reservation ---------------------------------------------------------------------

    def _reserve(self, ask: _Ask, start: float) -> str:
        """Hold GPUs for a blocked request at its earliest possible start, so that requests
        behind it can only backfill where they do not delay it; returns the reason's suffix."""
        at = self._earliest(ask, start)
        if at is None:
            return f"; cannot start within the {_hours(self.policy.horizon)} planning horizon"
        end = at + ask.req.duration
        chosen = self._search(ask, at, end)
        # The sweep and the search apply the same interval rule, so this only guards against a
        # disagreement at a range end.
        if len(chosen) < ask.m:
            return ""
        self._hold(ask.req, at, end, chosen, _HOLD)
        self.reservations.append(
            Reservation(rental_id=ask.req.rental_id, start=at, end=end, nodes=_node_gpus(chosen))
        )
        return f"; expected to start at {_iso(at)}"

    def _earliest(self, ask: _Ask, start: float) -> float | None:
        """Earliest t in [start, limit] at which m nodes can each host the request over
        [t, t + duration), given every interval known to this plan."""
        limit = self.now + self.policy.horizon
        if ask.req.start_deadline is not None:
            limit = min(limit, ask.req.start_deadline)
        if start > limit:
            return None
        m = ask.m
        first: float | None = None
        events: list[tuple[float, int]] = []
        full_of = ask.match.full
        for tier in ask.match.tiers():
            full = full_of[tier.cls.cid]
            for _, node_id in tier.entries:
                ns = self.nodes[node_id]
                ranges = _start_ranges(ns, ask.positions(ns, full), ask, start, limit)
                if not ranges:
                    continue
                if m == 1:
                    if first is None or ranges[0][0] < first:
                        first = ranges[0][0]
                else:
                    for lo, hi in ranges:
                        events.append((lo, 0))
                        events.append((hi, 1))
        if m == 1:
            return first
        covered = _covered(events, m)
        return covered[0][0] if covered else None

    # -- reasons ----------------------------------------------------------------------------------

    @staticmethod
    def _priced_out(req: Request, match: _Match) -> str:
        if req.interruptible:
            lowest = min(cls.ladders[1].values[0] for cls, _ in match.classes)
            return (
                f"bid: ${req.bid:.2f} is below every matching node's minimum bid "
                f"(lowest ${lowest:.2f})"
            )
        cheapest = min(cls.ladders[0].values[0] for cls, _ in match.classes)
        return f"price: cheapest matching node is ${cheapest:.2f} > max ${req.max_price:.2f}"

    def _no_capacity(self, ask: _Ask, start: float, found: int) -> str:
        req, k, m, priced = ask.req, ask.k, ask.m, ask.match.nodes
        group = " in one topology group" if req.same_group else ""
        when = f" from {_iso(start)}" if start > self.now else ""
        span = f"{group}{when} for {_hours(req.duration)}"
        if m == 1:
            return f"no capacity: {priced} nodes match, none has {k} free GPUs{span}"
        return f"no capacity: {priced} nodes match, {found} have {k} free GPUs{span}, {m} needed"


def _start_ranges(
    ns: _NodeState, positions: list[int], ask: _Ask, start: float, limit: float
) -> list[tuple[float, float]]:
    """Disjoint closed ranges of t in [start, limit] at which the node can host the request."""
    k, duration = ask.k, ask.req.duration
    if ask.same_group and ns.group is not None:
        groups: dict[int, list[int]] = {}
        for p in positions:
            groups.setdefault(ns.group[p], []).append(p)
        pools = list(groups.values())
    else:
        pools = [positions]
    ranges = []
    for pool in pools:
        if len(pool) < k:
            continue
        events: list[tuple[float, int]] = []
        for p in pool:
            lo = start
            for s, e, _, _ in ns.ivs[p]:
                hi = min(_latest_start(s, duration), limit)
                if hi >= lo:
                    events.append((lo, 0))
                    events.append((hi, 1))
                lo = max(lo, e)
                if lo > limit:
                    break
            else:
                events.append((lo, 0))
                events.append((limit, 1))
        ranges += _covered(events, k)
    return _merge(ranges)
