"""Deterministic synthetic clusters and workloads, for benchmarks and tests.

Everything is drawn from `random.Random(seed)`, so the same arguments always give the same
snapshot. The mix is meant to look like a GPU marketplace: mostly 8-GPU nodes of a few datacenter
models (SXM nodes with one NVLink island, PCIe nodes with two switches, consumer cards with no
topology group), a few price tiers per model, and requests of 1, 2, 4 and 8 GPUs with some
multi-node gangs, future starts, deadlines and interruptible bids. Datacenter nodes sit in
clusters of up to `CLUSTER_SIZE` nodes of one model and region (where gangs go); consumer cards
in none.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from decimal import Decimal

from scheduler.engine.types import Busy, Gpu, Node, Plan, Request, Snapshot

NOW = 1_767_225_600.0
"""2026-01-01T00:00:00Z, the default `now` of synthetic snapshots."""

HOUR = 3600.0

REGIONS = ("us-east", "us-west", "eu-west", "eu-central", "ap-south")
PRICE_TIERS = (Decimal("0.9"), Decimal("1.0"), Decimal("1.1"), Decimal("1.25"))
CENT = Decimal("0.01")
CLUSTER_SIZE = 32


@dataclass(frozen=True, slots=True)
class CatalogModel:
    """A GPU model as the generator uses it: figures, topology of its nodes, base price, share."""

    slug: str
    family: str
    memory_gb: int
    tensor_tflops: float
    nvlink: bool
    group_size: int
    price: Decimal
    share: int


CATALOG = (
    CatalogModel("h100-sxm5-80gb", "h100", 80, 989.0, True, 8, Decimal("2.49"), 25),
    CatalogModel("h200-sxm-141gb", "h200", 141, 989.0, True, 8, Decimal("3.29"), 5),
    CatalogModel("a100-sxm4-80gb", "a100", 80, 312.0, True, 8, Decimal("1.49"), 20),
    CatalogModel("a100-pcie-40gb", "a100", 40, 312.0, False, 4, Decimal("1.09"), 10),
    CatalogModel("l40s-48gb", "l40s", 48, 362.0, False, 4, Decimal("0.89"), 15),
    CatalogModel("v100-sxm2-32gb", "v100", 32, 125.0, True, 8, Decimal("0.49"), 5),
    CatalogModel("a10-24gb", "a10", 24, 125.0, False, 4, Decimal("0.59"), 10),
    CatalogModel("rtx4090-24gb", "rtx4090", 24, 165.2, False, 0, Decimal("0.39"), 10),
)
# Cards that providers do not cluster (a gang never asks for them and waits if it does).
UNCLUSTERED = frozenset({"rtx4090-24gb"})


def synthetic_nodes(*, seed: int, count: int = 10_000, gpus_per_node: int = 8) -> tuple[Node, ...]:
    """`count` nodes (ids from 1) of `gpus_per_node` GPUs each (GPU ids from 1)."""
    rng = random.Random(seed)
    weights = [model.share for model in CATALOG]
    nodes = []
    gpu_id = 0
    # Nodes so far per (model, region): the next one's cluster, without a draw of its own so
    # the other figures stay those of the same seed.
    clustered: dict[tuple[str, str], int] = {}
    for node_id in range(1, count + 1):
        model = rng.choices(CATALOG, weights)[0]
        price = (model.price * rng.choice(PRICE_TIERS)).quantize(CENT)
        gpus = []
        for index in range(gpus_per_node):
            gpu_id += 1
            group = f"g{index // model.group_size}" if model.group_size else ""
            gpus.append(
                Gpu(
                    gpu_id=gpu_id,
                    node_id=node_id,
                    index=index,
                    model=model.slug,
                    family=model.family,
                    memory_gb=model.memory_gb,
                    tensor_tflops=model.tensor_tflops,
                    group=group,
                    nvlink=model.nvlink,
                )
            )
        region = rng.choice(REGIONS)
        cluster = None
        if model.slug not in UNCLUSTERED:
            seen = clustered.get((model.slug, region), 0)
            clustered[model.slug, region] = seen + 1
            cluster = f"{model.slug}/{region}/{seen // CLUSTER_SIZE}"
        nodes.append(
            Node(
                node_id=node_id,
                region=region,
                price_per_gpu_hour=price,
                min_bid=(price * Decimal("0.4")).quantize(CENT),
                reliability=round(rng.uniform(0.9, 0.999), 3),
                gpus=tuple(gpus),
                cluster=cluster,
            )
        )
    return tuple(nodes)


def synthetic_busy(
    *,
    seed: int,
    nodes: tuple[Node, ...],
    now: float = NOW,
    utilization: float = 0.5,
    interruptible_share: float = 0.2,
    first_rental_id: int = 1,
) -> tuple[Busy, ...]:
    """Running rentals of 1, 2, 4 or 8 aligned GPUs, about `utilization` of all GPUs busy.

    They started up to a day ago and end between 15 minutes and two days from now.
    """
    rng = random.Random(seed)
    mean_size = 3.0
    # Chance that a free slot starts a rental, chosen so the busy share is about `utilization`.
    start_chance = utilization / (mean_size * (1 - utilization) + utilization)
    busy = []
    rental_id = first_rental_id
    for node in nodes:
        gpus = sorted(node.gpus, key=lambda gpu: gpu.index)
        i = 0
        while i < len(gpus):
            if rng.random() >= start_chance:
                i += 1
                continue
            size = min(rng.choice((1, 2, 4, 8)), len(gpus) - i)
            interruptible = rng.random() < interruptible_share
            if interruptible:
                cents = rng.randint(int(node.min_bid * 100), int(node.price_per_gpu_hour * 100))
                price = Decimal(cents) / 100
            else:
                price = node.price_per_gpu_hour
            start = now - rng.uniform(0, 24 * HOUR)
            end = now + rng.uniform(0.25 * HOUR, 48 * HOUR)
            for gpu in gpus[i : i + size]:
                busy.append(
                    Busy(
                        gpu_id=gpu.gpu_id,
                        rental_id=rental_id,
                        start=start,
                        end=end,
                        interruptible=interruptible,
                        price=price,
                        priority=0,
                    )
                )
            rental_id += 1
            i += size
    return tuple(busy)


def synthetic_requests(
    *,
    seed: int,
    count: int = 20_000,
    now: float = NOW,
    gang_share: float = 0.01,
    future_share: float = 0.02,
    interruptible_share: float = 0.2,
    first_rental_id: int = 10_000_000,
) -> tuple[Request, ...]:
    """Pending requests: 1/2/4/8 GPUs (55/25/12/7 %, about 2.3 GPUs a request), gangs of 2 or
    4 whole 8-GPU nodes, various model, family, memory, region, price and topology constraints."""
    rng = random.Random(seed)
    weights = [model.share for model in CATALOG]
    requests = []
    for n in range(count):
        if rng.random() < gang_share:
            gpus_per_node, node_count = 8, rng.choice((2, 4))
        else:
            gpus_per_node, node_count = rng.choices((1, 2, 4, 8), (55, 25, 12, 7))[0], 1
        model = rng.choices(CATALOG, weights)[0]
        shape = rng.random()
        models = families = None
        min_memory = 0
        if shape < 0.5:
            models = frozenset({model.slug})
        elif shape < 0.7:
            families = frozenset({model.family})
        else:
            min_memory = rng.choice((0, 24, 40, 80))
        created_at = now - rng.uniform(0, 2 * HOUR)
        start = now + rng.uniform(0.2 * HOUR, 12 * HOUR) if rng.random() < future_share else 0.0
        deadline = None
        if rng.random() < 0.1:
            deadline = max(start, now) + rng.uniform(-0.1 * HOUR, 6 * HOUR)
            deadline = max(deadline, start)
        interruptible = rng.random() < interruptible_share
        bid = max_price = None
        if interruptible:
            bid = (model.price * Decimal(rng.choice(("0.4", "0.5", "0.7", "0.9")))).quantize(CENT)
        elif rng.random() < 0.4:
            max_price = (model.price * rng.choice(PRICE_TIERS)).quantize(CENT)
        requests.append(
            Request(
                rental_id=first_rental_id + n,
                created_at=created_at,
                priority=rng.choice((0, 0, 0, 1, 2)),
                gpu_models=models,
                gpu_families=families,
                min_memory_gb=min_memory,
                gpus_per_node=gpus_per_node,
                node_count=node_count,
                same_group=gpus_per_node > 1 and rng.random() < 0.5,
                region=rng.choice(REGIONS) if rng.random() < 0.3 else None,
                max_price=max_price,
                start=start,
                duration=rng.choice((1, 2, 4, 8, 12, 24)) * HOUR,
                start_deadline=deadline,
                interruptible=interruptible,
                bid=bid,
            )
        )
    return tuple(requests)


def synthetic_snapshot(
    *,
    seed: int = 0,
    nodes: int = 10_000,
    requests: int = 20_000,
    now: float = NOW,
    utilization: float = 0.3,
) -> Snapshot:
    """The benchmark's snapshot: by default 10,000 nodes, 80,000 GPUs (about 30 % busy) and
    20,000 pending requests asking for about 47,000 GPUs, so how they are packed decides how
    many whole nodes stay free."""
    cluster = synthetic_nodes(seed=seed, count=nodes)
    return Snapshot(
        now=now,
        nodes=cluster,
        busy=synthetic_busy(seed=seed + 1, nodes=cluster, now=now, utilization=utilization),
        pending=synthetic_requests(seed=seed + 2, count=requests, now=now),
    )


def whole_free_nodes(
    snapshot: Snapshot, plan: Plan, *, gpus: int = 8, at: float | None = None
) -> int:
    """Nodes with at least `gpus` GPUs of which none is held at `at` (default: the snapshot's now)
    once the plan is applied: preempted rentals gone, placements bound."""
    when = snapshot.now if at is None else at
    stopped = {p.victim_rental_id for p in plan.preemptions}
    held = {
        b.gpu_id for b in snapshot.busy if b.rental_id not in stopped and b.start <= when < b.end
    }
    for placement in plan.placements:
        if placement.start <= when < placement.end:
            for _, gpu_ids in placement.nodes:
                held.update(gpu_ids)
    return sum(
        1
        for node in snapshot.nodes
        if len(node.gpus) >= gpus and not any(gpu.gpu_id in held for gpu in node.gpus)
    )
