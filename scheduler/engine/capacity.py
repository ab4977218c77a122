"""The capacity index of one cycle: per-GPU intervals, and nodes grouped so a request visits few.

Capacity is kept per GPU as a sorted list of time intervals (existing allocations, placements
made earlier in this plan, and backfill holds), so every check is a time-range check and a GPU
can never be given out twice for overlapping times.

To avoid scanning every node per request, nodes are grouped into classes of identical hardware
and location (pool, region, SSH capability, GPU kinds, size, largest topology group), so a
request's hardware, location and SSH constraints select whole classes (a `Match`). A node in a
cluster is also in a cluster class (the same key and its cluster): a gang matches cluster
classes only and is searched once per cluster (`Match.clusters`), while single-node requests
see the plain classes, as many as without clusters. Prices are
set per node, so they are kept out of the class: within a class, nodes of one price and minimum
bid form a tier, and a request's price constraint admits tiers (cheapest first, by bisection on
a `Ladder`). A class some of whose tiers are priced out is still visited, and its nodes are
checked one by one against the admitted tiers.

A node's image allow-list is part of its class too (a request's image admits whole classes);
the images it holds are not: they only add to a node's score (`CapacityIndex.cold`).

Within a class each node sits in a bucket by the number of its GPUs idle now, sorted by its
static score (price, reliability), and each GPU count keeps the set of classes with a non-empty
bucket. A second bucket index counts GPUs that preemption could free, sorted by the cheapest
victim. `CapacityIndex.refresh` keeps both up to date whenever a node's intervals change.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right, insort
from collections.abc import Iterable, Sequence
from decimal import Decimal
from enum import IntEnum
from itertools import accumulate, islice
from math import inf
from operator import attrgetter
from typing import NamedTuple, TypeAlias

from scheduler.engine.feasibility import gpu_matches, location_ok, runtime_ok
from scheduler.engine.intervals import Interval, Tag, interval_start
from scheduler.engine.topology import group_ids, max_group
from scheduler.engine.types import Busy, Gpu, Node, Policy, RentalId, Request, Snapshot

_ZERO = Decimal(0)
_by_index = attrgetter("index")


class Gate(IntEnum):
    """Which node figure a request's price constraint is checked against; indexes the per-gate
    ladders and ranks."""

    PRICE = 0
    """On-demand: the node's price per GPU-hour must be within `max_price`."""
    MIN_BID = 1
    """Interruptible: the node's minimum bid must be within the request's bid."""


class Entry(NamedTuple):
    """A node in an idle-count bucket or tier; sorts by static score, then node id."""

    static: int
    node_id: int


ReclaimEntry: TypeAlias = tuple[Decimal, int]
"""(cheapest victim's cost, node id): a node in a reclaimable-count bucket, sorted by both. A plain
tuple, read by unpacking, for the reason given at `intervals.Interval`: a new one is made whenever
a node's victims change."""


class Slot(NamedTuple):
    """One GPU of a node: its state and its position among the node's GPUs."""

    state: NodeState
    position: int


class Partial(NamedTuple):
    """A class only some of whose tiers a price cap admits: how many tiers of the ladder, and the
    highest static score of their nodes (buckets are sorted by it)."""

    tiers: int
    highest: int


class Choice(NamedTuple):
    """A node chosen for a request, with the GPU positions taken; sorts by score, then node id."""

    score: int
    node_id: int
    state: NodeState
    positions: list[int]


class Victim:
    """An interruptible rental of the snapshot and every GPU interval it holds."""

    __slots__ = ("cost", "price", "priority", "start", "where")

    def __init__(self, price: Decimal, priority: int, start: float) -> None:
        self.price = price
        self.priority = priority
        self.start = start
        self.where: list[Slot] = []
        # Revenue per hour lost by stopping it: its price on every GPU it holds.
        self.cost = Decimal(0)


class NodeClass:
    """Nodes of identical hardware, location and SSH capability (and cluster, for a cluster
    class: `cluster` is not None); the unit of matching a request."""

    __slots__ = (
        "buckets",
        "cid",
        "cluster",
        "entries",
        "example",
        "kinds",
        "ladders",
        "max_group",
        "rbuckets",
        "size",
        "tiers",
    )

    def __init__(
        self, cid: int, node: Node, kinds: frozenset[int], max_group: int, cluster: object
    ) -> None:
        self.cid = cid
        self.cluster = cluster
        self.example = node
        self.kinds = kinds
        self.max_group = max_group
        self.size = len(node.gpus)
        # In order of first appearance; `ladders` orders them by each gate.
        self.tiers: list[Tier] = []
        self.ladders: tuple[Ladder, Ladder]
        # Sorted: all nodes, and nodes by idle count.
        self.entries: list[Entry] = []
        self.buckets: list[list[Entry]] = [[] for _ in range(self.size + 1)]
        # Sorted: nodes by reclaimable count.
        self.rbuckets: list[list[ReclaimEntry]] = [[] for _ in range(self.size + 1)]


class Tier:
    """The nodes of one class at one price and minimum bid."""

    __slots__ = ("cls", "entries", "min_bid", "price", "ranks", "tid")

    def __init__(self, tid: int, cls: NodeClass, node: Node) -> None:
        self.tid = tid
        self.cls = cls
        self.price = node.price_per_gpu_hour
        self.min_bid = node.min_bid
        # Sorted.
        self.entries: list[Entry] = []
        # Its place on the class's ladder of each gate.
        self.ranks = [0, 0]

    def gate_value(self, gate: Gate) -> Decimal:
        return self.min_bid if gate is Gate.MIN_BID else self.price


_TIER_ORDER = attrgetter("tid")
_GATE_ORDER = {
    Gate.PRICE: attrgetter("price", "tid"),
    Gate.MIN_BID: attrgetter("min_bid", "tid"),
}


class Ladder:
    """A class's tiers by one gate, cheapest first, ties by first appearance, with running
    figures so that a cap admits a prefix found by one bisection."""

    __slots__ = ("highest", "lowest", "nodes", "tiers", "values")

    def __init__(self, tiers: list[Tier], gate: Gate) -> None:
        self.tiers = sorted(tiers, key=_GATE_ORDER[gate])
        self.values = [tier.gate_value(gate) for tier in self.tiers]
        # Over the first i + 1 tiers: how many nodes, their lowest and highest static score.
        self.nodes = list(accumulate(len(tier.entries) for tier in self.tiers))
        self.lowest = list(accumulate((tier.entries[0].static for tier in self.tiers), min))
        self.highest = list(accumulate((tier.entries[-1].static for tier in self.tiers), max))
        for rank, tier in enumerate(self.tiers):
            tier.ranks[gate] = rank


class Shape:
    """What nodes with the same GPUs in the same topology have in common."""

    __slots__ = ("group", "kind", "kinds", "max_group", "positions")

    def __init__(self, kind: list[int], gpus: Sequence[Gpu]) -> None:
        self.kind = kind
        self.kinds = frozenset(kind)
        self.positions = list(range(len(gpus)))
        self.group = group_ids(gpus)
        self.max_group = max_group(self.group, len(gpus))


class NodeState:
    """Mutable per-node capacity: intervals per GPU position (GPUs sorted by index)."""

    __slots__ = (
        "ccls",
        "clear",
        "cls",
        "cranks",
        "entry",
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

    def __init__(self, node: Node, gpus: Sequence[Gpu], shape: Shape, static: int) -> None:
        self.node = node
        self.node_id = node.node_id
        self.gpu_ids = [gpu.gpu_id for gpu in gpus]
        # Shared by every node of the same shape, never mutated.
        self.kind = shape.kind
        self.positions = shape.positions
        self.group = shape.group
        self.ivs: list[list[Interval]] = [[] for _ in gpus]
        self.static = static
        # Its place in its class's idle buckets; fixed, as static score and id never change.
        self.entry = Entry(static, node.node_id)
        # Summaries kept up to date by CapacityIndex.refresh: GPUs idle now; most of them in one
        # topology group; until when all of them stay idle; GPUs idle now or held now only by
        # interruptible work; first interval start; last interval end; lowest interruptible
        # price and victim cost on the node.
        self.level = 0
        self.glevel = 0
        self.idle_groups: list[int] = []
        self.idle_until = inf
        self.rlevel = 0
        self.rentry: ReclaimEntry = (_ZERO, node.node_id)
        self.first = inf
        self.clear = -inf
        self.min_spot: Decimal | None = None
        self.min_victim: Decimal | None = None
        self.cls: NodeClass
        # Its tier's place on its class's ladder of each gate.
        self.ranks: list[int]
        # Its cluster class and the same place there (None: in no cluster).
        self.ccls: NodeClass | None = None
        self.cranks: list[int] = self.ranks_unset

    ranks_unset: list[int] = []

    def ranks_in(self, cls: NodeClass) -> list[int]:
        """Its tier's place on the ladders of `cls`, its plain or its cluster class."""
        return self.ranks if cls.cluster is None else self.cranks

    def matching(self, kinds: frozenset[int]) -> list[int]:
        return [p for p in self.positions if self.kind[p] in kinds]


class Match:
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
        "parts",
        "views",
    )

    def __init__(
        self,
        kinds: frozenset[int],
        classes: list[tuple[NodeClass, bool]],
        base: Match | None = None,
        gate: Gate = Gate.PRICE,
        cap: Decimal | None = None,
    ) -> None:
        self.kinds = kinds
        self.base = base
        self.gate = gate
        # (class, whether every GPU kind of the class matches) of the classes with a node
        # admitted, and the same by class id.
        self.classes: list[tuple[NodeClass, bool]] = []
        # Classes only some of whose tiers are admitted, by class id.
        self.partial: dict[int, Partial] = {}
        # Tiers and nodes admitted.
        self.count = self.nodes = 0
        lowest: list[int] = []
        for cls, full in classes:
            ladder = cls.ladders[gate]
            n = len(ladder.tiers) if cap is None else bisect_right(ladder.values, cap)
            if n == 0:
                continue
            if n < len(ladder.tiers):
                self.partial[cls.cid] = Partial(n, ladder.highest[n - 1])
            self.count += n
            self.nodes += ladder.nodes[n - 1]
            lowest.append(ladder.lowest[n - 1])
            self.classes.append((cls, full))
        self.min_static = min(lowest, default=0)
        self.full = {cls.cid: full for cls, full in self.classes}
        self.ids = set(self.full)
        self.orders: dict[Gate | None, list[Tier]] = {}
        self.views: dict[tuple[Gate, Decimal], Match] = {}
        self.parts: list[Match] | None = None

    def clusters(self) -> list[Match]:
        """The match split by cluster, one match per cluster with a class admitted, in order of
        first appearance; nodes without a cluster are left out (cached)."""
        if self.parts is None:
            by_cluster: dict[object, list[tuple[NodeClass, bool]]] = {}
            for cls, full in self.classes:
                if cls.cluster is not None:
                    by_cluster.setdefault(cls.cluster, []).append((cls, full))
            self.parts = [Match(self.kinds, classes) for classes in by_cluster.values()]
        return self.parts

    def priced(self, gate: Gate, cap: Decimal | None) -> Match:
        """The nodes whose figure for `gate` is within cap (cached)."""
        if cap is None:
            return self
        view = self.views.get((gate, cap))
        if view is None:
            view = self.views[gate, cap] = Match(self.kinds, self.classes, self, gate, cap)
        return view

    def tiers(self) -> Iterable[Tier]:
        """The admitted tiers: a view's cheapest first by its gate (a prefix of the match's
        tiers in that order), a match's in order of first appearance; ties in order of first
        appearance."""
        if self.base is None:
            return self.ordered(None)
        return islice(self.base.ordered(self.gate), self.count)

    def ordered(self, gate: Gate | None) -> list[Tier]:
        """Every tier of the match by a gate, or by first appearance (None); sorted on first
        use, as only future windows and reservations need it."""
        order = self.orders.get(gate)
        if order is None:
            key = _TIER_ORDER if gate is None else _GATE_ORDER[gate]
            tiers = (tier for cls, _ in self.classes for tier in cls.tiers)
            order = self.orders[gate] = sorted(tiers, key=key)
        return order


class Ask:
    """A request with what every search step needs precomputed."""

    __slots__ = ("k", "m", "match", "req", "same_group")

    def __init__(self, req: Request, match: Match) -> None:
        self.req = req
        self.k = req.gpus_per_node
        self.m = req.node_count
        self.same_group = req.same_group
        if req.interruptible:
            self.match = match.priced(Gate.MIN_BID, req.bid)
        else:
            self.match = match.priced(Gate.PRICE, req.max_price)

    def positions(self, ns: NodeState, full: bool) -> list[int]:
        return ns.positions if full else ns.matching(self.match.kinds)


def _drop(bucket: list, entry: tuple, live: set[int], cid: int) -> None:
    del bucket[bisect_left(bucket, entry)]
    if not bucket:
        live.discard(cid)


class CapacityIndex:
    """Every node's intervals and summaries, the buckets over them, and the victims of
    preemption, built from a snapshot; the planner changes it only through `hold` and `evict`."""

    def __init__(self, snapshot: Snapshot, policy: Policy) -> None:
        self.now = snapshot.now
        self.policy = policy
        self.best_fit = not policy.first_fit
        # Scoring weights in effect: first fit drops all scoring.
        self.pack = policy.pack_weight if self.best_fit else 0
        self.topo = policy.topology_weight if self.best_fit else 0
        self.cold_weight = policy.cold_weight if self.best_fit else 0
        self.kind_ids: dict[tuple[str, str, int, float], int] = {}
        self.kind_gpus: list[Gpu] = []
        self.nodes: dict[int, NodeState] = {}
        self.classes: dict[tuple, NodeClass] = {}
        self.class_list: list[NodeClass] = []
        self.tiers: dict[tuple, Tier] = {}
        self.victims: dict[RentalId, Victim] = {}
        # Request constraints repeat, so what they admit is cached at three levels: GPU kinds,
        # classes by location, and classes by both (each match keeps its views by price cap).
        self.kinds_cache: dict[tuple, frozenset[int]] = {}
        self.located: dict[tuple[str | None, str, bool, str, bool], list[NodeClass]] = {}
        self.matches: dict[tuple, Match] = {}
        self.max_level = 0
        # Per GPU count, the ids of the classes with a non-empty (reclaimable) bucket of it.
        self.live: list[set[int]] = []
        self.rlive: list[set[int]] = []
        where = self._index_nodes(snapshot.nodes)
        self._index_busy(snapshot.busy, where)

    # -- building -------------------------------------------------------------------------------

    def _static_score(self, node: Node) -> int:
        if not self.best_fit:
            return 0
        cents = int((node.price_per_gpu_hour * 100).to_integral_value())
        unreliability = round((1.0 - node.reliability) * 1000)
        return self.policy.price_weight * cents + self.policy.reliability_weight * unreliability

    def _index_nodes(self, nodes: Sequence[Node]) -> dict[int, tuple[NodeState, int]]:
        # (state, position) by GPU id; a Slot is made only for the few GPUs a victim holds, as
        # this maps every GPU of the cluster.
        where: dict[int, tuple[NodeState, int]] = {}
        shapes: dict[tuple, Shape] = {}
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
                shape = shapes[shape_key] = Shape([self._kind_id(gpu) for gpu in gpus], gpus)
            static_key = (node.price_per_gpu_hour, node.reliability)
            static = statics.get(static_key)
            if static is None:
                static = statics[static_key] = self._static_score(node)
            ns = NodeState(node, gpus, shape, static)
            class_key = (
                node.pool,
                node.region,
                node.ssh_capable,
                node.internet_capable,
                node.image_allow,
                shape.kinds,
                len(gpus),
                shape.max_group,
            )
            tier = self._tier(class_key, None, node, shape)
            ns.cls, ns.ranks = tier.cls, tier.ranks
            tier.cls.entries.append(ns.entry)
            tier.entries.append(ns.entry)
            if node.cluster is not None:
                tier = self._tier(class_key, node.cluster, node, shape)
                ns.ccls, ns.cranks = tier.cls, tier.ranks
                tier.cls.entries.append(ns.entry)
                tier.entries.append(ns.entry)
            self.nodes[ns.node_id] = ns
            for position, gpu in enumerate(gpus):
                where[gpu.gpu_id] = (ns, position)
        for tier in self.tiers.values():
            tier.entries.sort()
        for cls in self.class_list:
            cls.ladders = (Ladder(cls.tiers, Gate.PRICE), Ladder(cls.tiers, Gate.MIN_BID))
        return where

    def _tier(self, class_key: tuple, cluster: object, node: Node, shape: Shape) -> Tier:
        """The node's tier in its plain class (cluster None) or its cluster class."""
        key = (*class_key, cluster)
        tier_key = (*key, node.price_per_gpu_hour, node.min_bid)
        tier = self.tiers.get(tier_key)
        if tier is None:
            cls = self.classes.get(key)
            if cls is None:
                cls = NodeClass(len(self.class_list), node, shape.kinds, shape.max_group, cluster)
                self.classes[key] = cls
                self.class_list.append(cls)
            tier = self.tiers[tier_key] = Tier(len(self.tiers), cls, node)
            cls.tiers.append(tier)
        return tier

    def _kind_id(self, gpu: Gpu) -> int:
        key = (gpu.model, gpu.family, gpu.memory_gb, gpu.tensor_tflops)
        kind_id = self.kind_ids.get(key)
        if kind_id is None:
            kind_id = self.kind_ids[key] = len(self.kind_gpus)
            self.kind_gpus.append(gpu)
        return kind_id

    def _index_busy(self, busy: Sequence[Busy], where: dict[int, tuple[NodeState, int]]) -> None:
        # Tag values bound once: looking a member up on its class costs more than the append.
        now, spot, fixed = self.now, Tag.SPOT.value, Tag.FIXED.value
        for b in busy:
            located = where.get(b.gpu_id)
            if b.end <= now or located is None:
                continue
            ns, position = located
            tag = spot if b.interruptible else fixed
            ns.ivs[position].append((b.start, b.end, b.rental_id, tag))
            if b.interruptible:
                victim = self.victims.get(b.rental_id)
                if victim is None:
                    victim = Victim(b.price, b.priority, b.start)
                    self.victims[b.rental_id] = victim
                victim.start = min(victim.start, b.start)
                victim.where.append(Slot(ns, position))
        for victim in self.victims.values():
            gpus = len({(ns.node_id, p) for ns, p in victim.where})
            victim.cost = victim.price * gpus
        for ns in self.nodes.values():
            for intervals in ns.ivs:
                if len(intervals) > 1:
                    intervals.sort(key=interval_start)
            ns.level, ns.rlevel = self._summarize(ns)
        self.max_level = max((cls.size for cls in self.class_list), default=0)
        self.live = [set() for _ in range(self.max_level + 1)]
        self.rlive = [set() for _ in range(self.max_level + 1)]
        for cls in self.class_list:
            cls.entries.sort()
            for entry in cls.entries:
                ns = self.nodes[entry.node_id]
                for level in self._bucket_levels(ns.level, ns.level):
                    cls.buckets[level].append(entry)
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

    # -- keeping summaries and buckets current --------------------------------------------------

    def _summarize(self, ns: NodeState) -> tuple[int, int]:
        """Update the node's time and price summaries; returns its idle and reclaimable counts."""
        now, group, spot = self.now, ns.group, Tag.SPOT.value
        level = reclaimable = 0
        first, clear, idle_until = inf, -inf, inf
        spots: list[Victim] = []
        idle_by_group: dict[int, int] = {}
        for p, intervals in enumerate(ns.ivs):
            if intervals:
                # Sorted by start, so the head is the earliest and the only one that can be
                # running now.
                head_start, _, _, head_tag = intervals[0]
                first = min(first, head_start)
                for _, end, rental_id, tag in intervals:
                    clear = max(clear, end)
                    if tag == spot:
                        spots.append(self.victims[rental_id])
                if head_start <= now:
                    reclaimable += head_tag == spot
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

    def refresh(self, ns: NodeState) -> None:
        """Recompute the node's summaries after its intervals changed, and move it between
        buckets accordingly."""
        level, reclaimable = self._summarize(ns)
        entry = ns.entry
        classes = (ns.cls,) if ns.ccls is None else (ns.cls, ns.ccls)
        if level != ns.level:
            for cls in classes:
                if self.best_fit:
                    self._move(cls, cls.buckets, self.live, ns.level, entry, level, entry)
                elif level < ns.level:
                    for stale in self._bucket_levels(level, ns.level):
                        _drop(cls.buckets[stale], entry, self.live[stale], cls.cid)
                else:
                    for fresh in self._bucket_levels(ns.level, level):
                        insort(cls.buckets[fresh], entry)
                        self.live[fresh].add(cls.cid)
            ns.level = level
        cost = ns.min_victim or _ZERO
        old_cost, _ = ns.rentry
        if reclaimable != ns.rlevel or cost != old_cost:
            rentry = (cost, ns.node_id)
            for cls in classes:
                self._move(cls, cls.rbuckets, self.rlive, ns.rlevel, ns.rentry, reclaimable, rentry)
            ns.rlevel, ns.rentry = reclaimable, rentry

    @staticmethod
    def _move(
        cls: NodeClass,
        buckets: list[list],
        live: list[set[int]],
        old_level: int,
        old_entry: tuple,
        new_level: int,
        new_entry: tuple,
    ) -> None:
        """Move a node's entry from one bucket to another (the entry may change too)."""
        _drop(buckets[old_level], old_entry, live[old_level], cls.cid)
        insort(buckets[new_level], new_entry)
        live[new_level].add(cls.cid)

    def hold(
        self, rental_id: RentalId, t0: float, t1: float, chosen: Iterable[Choice], tag: Tag
    ) -> None:
        """Give the chosen GPUs to the rental over [t0, t1)."""
        interval: Interval = (t0, t1, rental_id, tag.value)
        for _, _, ns, positions in chosen:
            for p in positions:
                insort(ns.ivs[p], interval, key=interval_start)
            self.refresh(ns)

    def evict(self, rental_id: RentalId) -> Victim:
        """Free every GPU an interruptible rental holds; returns it."""
        victim = self.victims.pop(rental_id)
        touched: dict[int, NodeState] = {}
        for ns, p in victim.where:
            kept = []
            for interval in ns.ivs[p]:
                _, _, holder, tag = interval
                if holder != rental_id or tag != Tag.SPOT:
                    kept.append(interval)
            ns.ivs[p] = kept
            touched[ns.node_id] = ns
        for ns in touched.values():
            self.refresh(ns)
        return victim

    # -- matching requests ----------------------------------------------------------------------

    def cold(self, ask: Ask, ns: NodeState) -> int:
        """The score a node adds for not holding the request's image (it pulls it first)."""
        image = ask.req.image
        return self.cold_weight if image and image not in ns.node.images else 0

    def match(self, req: Request) -> Match:
        """The classes the request's hardware and location constraints admit (cached): a gang's
        among the cluster classes, anything else's among the plain ones."""
        gang = req.node_count > 1
        kinds_key = (req.gpu_models, req.gpu_families, req.min_memory_gb, req.min_tensor_tflops)
        where = (req.region, req.pool, req.ssh, req.internet, req.image, gang)
        key = (*kinds_key, *where, req.gpus_per_node, req.same_group)
        match = self.matches.get(key)
        if match is None:
            kinds = self.kinds_cache.get(kinds_key)
            if kinds is None:
                kinds = frozenset(i for i, g in enumerate(self.kind_gpus) if gpu_matches(req, g))
                self.kinds_cache[kinds_key] = kinds
            located = self.located.get(where)
            if located is None:
                located = [
                    cls
                    for cls in self.class_list
                    if (cls.cluster is not None) == gang
                    and location_ok(req, cls.example)
                    and runtime_ok(req, cls.example)
                ]
                self.located[where] = located
            k = req.gpus_per_node
            classes = [
                (cls, cls.kinds <= kinds)
                for cls in located
                if cls.kinds & kinds
                and cls.size >= k
                and (not req.same_group or cls.max_group >= k)
            ]
            match = self.matches[key] = Match(kinds, classes)
        return match
