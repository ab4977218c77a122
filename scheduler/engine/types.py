"""Value types of the placement engine: the capacity snapshot it reads and the plan it returns.

Every type is a frozen, slotted, keyword-only dataclass so the caller builds them explicitly from
database rows and the engine can never mutate what it was given.
"""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal
from typing import TypeAlias
from uuid import UUID

RentalId: TypeAlias = int | str | UUID
"""Rental primary key; only hashed and compared (as the last tie-break), never interpreted."""

NodeGpus: TypeAlias = tuple[tuple[int, tuple[int, ...]], ...]
"""((node_id, (gpu_id, ...)), ...): per node, the GPUs chosen, nodes by id, GPUs by index."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Gpu:
    """One allocatable GPU as the engine sees it.

    `group` is its topology group on the node ("" for none: a group of its own). Placement uses
    only the group; `nvlink` (whether the group is an NVLink island) is carried for callers.
    """

    gpu_id: int
    node_id: int
    index: int
    model: str
    family: str
    memory_gb: int
    tensor_tflops: float
    group: str = ""
    nvlink: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class Node:
    """A schedulable GPU server with its prices; `gpus` lists every GPU the engine may use.

    `ssh_capable`: its agent can run an sshd in a rental and publish its port (a container
    runtime with published ports); a rental that asks for SSH is never placed where it is not.

    `internet_capable`: a rental with the internet may run there (its agent filters that
    traffic to public addresses, or it is a simulated development node); a rental asking for
    the internet is never placed where it is not.

    `cluster`: the fabric it shares with other nodes (any hashable key, the same for every node
    of one cluster), or None for a node on its own. The members of a gang (`node_count > 1`)
    are all placed in one cluster; a node without one hosts single-node rentals only.
    `interconnect_gbps`: its cluster's bandwidth per node (0 without a cluster).

    `image_allow`: the image patterns its agent accepts (agentprotocol.images), None when it
    never said (any image: the agent judges); a rental is never placed on a node that refuses
    its image. `images`: the normalized references of the images it holds; among otherwise
    equal nodes one holding the rental's image is preferred (no pull before the start)."""

    node_id: int
    region: str
    price_per_gpu_hour: Decimal
    min_bid: Decimal
    reliability: float
    gpus: tuple[Gpu, ...]
    pool: str = "default"
    ssh_capable: bool = True
    internet_capable: bool = True
    cluster: int | str | None = None
    interconnect_gbps: int = 0
    image_allow: tuple[str, ...] | None = None
    images: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True, kw_only=True)
class Busy:
    """An existing allocation of one GPU to a rental over [start, end)."""

    gpu_id: int
    rental_id: RentalId
    start: float
    end: float
    interruptible: bool = False
    price: Decimal = Decimal(0)
    priority: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class Request:
    """A pending rental: what it needs, when, and what it pays."""

    rental_id: RentalId
    created_at: float
    gpus_per_node: int = 1
    node_count: int = 1
    duration: float = 3600.0
    start: float = 0.0
    start_deadline: float | None = None
    priority: int = 0
    gpu_models: frozenset[str] | None = None
    gpu_families: frozenset[str] | None = None
    min_memory_gb: int = 0
    min_tensor_tflops: float = 0.0
    same_group: bool = False
    region: str | None = None
    pool: str = "default"
    max_price: Decimal | None = None
    interruptible: bool = False
    bid: Decimal | None = None
    ssh: bool = False  # an sshd in the container: only an ssh_capable node can host it
    internet: bool = False  # the public internet: only an internet_capable node can host it
    # A gang: only a cluster whose interconnect is at least this fast, in Gb/s per node (a
    # single-node rental crosses none, so it is not checked there).
    min_interconnect_gbps: int = 0
    # The container image, normalized (agentprotocol.images.image_normalize); "" for none
    # (any node's allow-list admits it: callers that do not place containers).
    image: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class Snapshot:
    """Everything one scheduling cycle looks at, taken at `now`."""

    now: float
    nodes: tuple[Node, ...]
    busy: tuple[Busy, ...] = ()
    pending: tuple[Request, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class Policy:
    """Knobs of one cycle; the defaults are what production runs.

    Scores are integer points, lower is better, so ties are exact and broken by node id:
    `pack_weight` per GPU of the node left free (idle now, for a request starting now; free over
    the whole window, for a later one), `topology_weight` per extra topology group
    spanned, `price_weight` per cent of the on-demand price, `reliability_weight` per 0.1 % of
    unreliability, `cold_weight` on a node that does not hold the request's image (it pulls it
    before the start). The defaults make packing dominate, then topology, then price and
    reliability; a held image then breaks ties.

    `horizon` bounds how far ahead future windows and backfill reservations are searched;
    `reserve_depth` is how many blocked requests per cycle get a backfill reservation;
    `future_candidates` is how many fitting nodes a future window compares before taking the
    best of them (a request starting now always gets the best node).
    """

    aging_per_second: float = 1 / 3600
    pack_weight: int = 1000
    topology_weight: int = 1500
    price_weight: int = 1
    reliability_weight: int = 2
    cold_weight: int = 1
    first_fit: bool = False
    preemption: bool = True
    horizon: float = 48 * 3600.0
    reserve_depth: int = 1
    future_candidates: int = 32


@dataclass(frozen=True, slots=True, kw_only=True)
class Placement:
    """A decision to bind: GPUs on `nodes` for [start, end) at a locked price."""

    rental_id: RentalId
    start: float
    end: float
    price_per_gpu_hour: Decimal
    nodes: NodeGpus


@dataclass(frozen=True, slots=True, kw_only=True)
class Preemption:
    """An interruptible rental to stop; the caller frees all of its remaining allocations."""

    victim_rental_id: RentalId
    for_rental_id: RentalId
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Waiting:
    """A request left pending this cycle, with the reason shown to its customer."""

    rental_id: RentalId
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Expired:
    """A request whose start deadline passed without a placement."""

    rental_id: RentalId
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Reservation:
    """Where and when a blocked request is expected to start; held only within this plan."""

    rental_id: RentalId
    start: float
    end: float
    nodes: NodeGpus


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    """The decisions of one cycle, in the order they were made."""

    placements: tuple[Placement, ...] = ()
    preemptions: tuple[Preemption, ...] = ()
    waiting: tuple[Waiting, ...] = ()
    expired: tuple[Expired, ...] = ()
    reservations: tuple[Reservation, ...] = ()
