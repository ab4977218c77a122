"""Every read of the marketplace, with its joins already chosen."""

from __future__ import annotations

import hashlib
import pickle
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from decimal import Decimal
from typing import TypeVar

import redis
from django.conf import settings
from django.db.models import (
    Count,
    OuterRef,
    Prefetch,
    QuerySet,
    Subquery,
)
from django.db.models.functions import Coalesce
from django.utils import timezone

from accounts.models import SshKey, Team
from advisor.engine.compute import Card, Topology
from advisor.engine.layouts import Run, fewest_fitting
from advisor.engine.presets import ModelShape, with_run
from agentprotocol.images import image_normalize
from core.errors import NotFound
from core.redis_clients import redis_clients
from marketplace import queries
from marketplace.lifecycle import ACTIVE
from marketplace.models import (
    Allocation,
    Cluster,
    Gpu,
    GpuHealth,
    GpuModel,
    Node,
    Provider,
    Rental,
    RentalEvent,
    RentalStatus,
    RentalTemplate,
    User,
)
from scheduler.engine import types as engine

T = TypeVar("T")

# The most GPUs one node is listed with (the `fits=` filter looks no further).
MAX_GPUS_PER_NODE = 16

# The offers list's orderings, by name (the SQL of each is in marketplace.queries).
OFFER_ORDERINGS = queries.OFFER_ORDERINGS


@dataclass(frozen=True, slots=True)
class OfferFilters:
    """What a customer may ask of the offers list; None means no constraint."""

    gpu_models: tuple[str, ...] = ()
    gpu_families: tuple[str, ...] = ()
    min_memory_gb: int | None = None
    min_tensor_tflops: Decimal | None = None
    min_free_gpus: int | None = None
    nvlink: bool | None = None
    region: str | None = None
    max_price: Decimal | None = None
    min_reliability: Decimal | None = None
    ordering: str = "price"
    # (card slug, GPUs a node needs free to hold the model without NVLink, with NVLink); None:
    # no constraint (the offers' `fits=`).
    fits: tuple[tuple[str, int, int], ...] | None = None


def offer_filters(data: dict) -> OfferFilters:
    """OfferFilters from the validated offers query (API and web page alike)."""
    return OfferFilters(
        gpu_models=data.get("gpu_model", ()),
        gpu_families=data.get("gpu_family", ()),
        min_memory_gb=data.get("min_memory_gb"),
        min_tensor_tflops=data.get("min_tensor_tflops"),
        min_free_gpus=data.get("min_free_gpus"),
        nvlink=data.get("nvlink"),
        region=data.get("region"),
        max_price=data.get("max_price"),
        min_reliability=data.get("min_reliability"),
        ordering=data["ordering"],
        fits=offer_fits(data["fits"]) if data.get("fits") else None,
    )


# A node's measured dense matmul rate is believed between 1% and 150% of its card's dense tensor
# peak (the FP16-accumulate peak where the card has a faster one), whatever precision it was
# measured in: FP32 without tensor cores is 6% or more of the tensor peak on every catalog card,
# and a power-capped or throttled card stays far above 1%. Outside the band the benchmark is
# kept for the record but neither shown nor priced: the agent's number is the provider's claim.
MEASURED_TFLOPS_MIN_SHARE = 0.01
MEASURED_TFLOPS_MAX_SHARE = 1.5
_SHARES = (MEASURED_TFLOPS_MIN_SHARE, MEASURED_TFLOPS_MAX_SHARE)


def measured_tflops_plausible(*, model: GpuModel, tflops: float) -> bool:
    """Whether a benchmark's TFLOPS can be believed for this card (the band above)."""
    peak = max(model.tensor_tflops, model.tensor_tflops_fp16_acc or 0)
    low = float(model.tensor_tflops) * MEASURED_TFLOPS_MIN_SHARE
    return low <= tflops <= float(peak) * MEASURED_TFLOPS_MAX_SHARE


# A healthy card's benchmark in a tensor precision reaches this share of its dense tensor peak
# or more (the harness's quick matmul: 60-80 % on datacenter cards). Below it the node has
# drifted (throttled, power-capped, a degraded link): it is flagged and ranked down.
MEASURED_TFLOPS_EXPECTED_SHARE = 0.4
_TENSOR_PRECISIONS = frozenset({"bf16", "fp16"})


def measured_tflops_below_band(*, model: GpuModel, tflops: float, precision: str) -> bool:
    """Whether a benchmark in a tensor precision fell below its card's expected band (a rate
    in another precision, FP32 on a card without BF16, is not compared)."""
    if precision not in _TENSOR_PRECISIONS:
        return False
    return tflops < float(model.tensor_tflops) * MEASURED_TFLOPS_EXPECTED_SHARE


def catalog_card(model: GpuModel, prior: float | None = None) -> Card:
    """A catalog row as the advisor's arithmetic takes it; `prior`: the card's calibrated MFU
    (the advisor's selectors pass it, the offers' `fits=` needs none)."""
    return Card(
        slug=model.slug,
        name=model.name,
        memory_gb=model.memory_gb,
        tensor_tflops=float(model.tensor_tflops),
        fp32_tflops=float(model.fp32_tflops),
        bf16=model.bf16,
        nvlink_gbs=float(model.nvlink_gbs),
        nvlink_bridge=model.nvlink_bridge,
        tier=model.tier,
        mfu_prior=prior,
    )


def offer_fits(shape: ModelShape) -> tuple[tuple[str, int, int], ...]:
    """Per card, the GPUs one node must have free for the model to fit with some layout
    (micro-batch 1, any ZeRO stage and recomputation), without and with NVLink. Whether a model
    fits is memory alone, so the advisor's calibrated priors (speed) are not read."""
    run = Run(shape=with_run(shape, micro_batch=1), tokens=1.0)
    never = 1 << 30
    result = []
    for card in (catalog_card(m) for m in GpuModel.objects.all()):
        needs = []
        for nvlink in (False, True):
            topologies = [
                Topology(gpus_per_node=n, nvlink=nvlink) for n in range(1, MAX_GPUS_PER_NODE + 1)
            ]
            first = fewest_fitting(run, card, topologies)
            needs.append(never if first is None else first + 1)
        if min(needs) < never:
            result.append((card.slug, needs[0], needs[1]))
    return tuple(result)


def gpu_model_list() -> QuerySet[GpuModel]:
    return GpuModel.objects.all()


def offer_list_sql(*, filters: OfferFilters, limit: int, offset: int) -> tuple[str, list]:
    """The offers statement and its parameters (the benchmark runs it raw as its baseline)."""
    return queries.offers_statement(filters=filters, limit=limit, offset=offset, shares=_SHARES)


def offers_by_card_sql(*, filters: OfferFilters, per_card: int) -> tuple[str, list]:
    """offers_by_card's statement and its parameters (the benchmark runs it raw)."""
    return queries.offers_by_card_statement(filters=filters, per_card=per_card, shares=_SHARES)


# Bump when the rows' shape changes without the statement's text changing (a pickled row from
# the previous release must not be served by the next one).
_OFFER_PAGE_KEY_VERSION = 2


# A page whose statement took longer than the TTL is still kept this long, for the requests
# that waited for it (below): without it, a database slow enough to take the TTL answered every
# request with the statement, which made it slower still (offers p95 23 s at 10,000 nodes under
# the whole load of bench/marketplace.py, the statement on 0.96 of PostgreSQL's backends).
OFFER_PAGE_GRACE_S = 1.0
# How long a request waits for another's answer to the same question (at most the TTL), and
# how often it looks for it.
OFFER_PAGE_FILL_WAIT_S = 5.0
_FILL_POLL_S = (0.01, 0.1)  # first, then doubled up to the second


def offer_page(
    *,
    filters: OfferFilters,
    limit: int,
    offset: int,
    shape: Callable[[list[dict]], list[dict]] | None = None,
) -> list[dict]:
    """Offers as customers browse them (API, web page, CLI): one row per node with the GPUs
    free right now, filtered and sorted, at most `limit` rows from `offset` (callers ask for one
    more row than they show to know whether a next page exists: no count, it would double the
    cost); or `shape(rows)` (the API's serialized rows: a cached page then skips the serializer
    too). Served from Redis for up to GPUMARKET["OFFERS_CACHE_TTL_S"] seconds after the
    statement that made them began.

    At 10,000 nodes the statement costs tens of milliseconds of PostgreSQL per page, and
    browsers ask for the same few pages over and over (bench/offers.py, docs/benchmarks.md).
    The key is a digest of the statement's text and every parameter it runs with, so whatever
    changes the answer changes the key; the statement reads nothing of the caller (no account,
    team or price per customer), so one answer serves everybody who asks the same question.
    One statement runs per question at a time: with no entry, the one request that sets the
    fill flag runs it and the others wait for its answer (up to OFFER_PAGE_FILL_WAIT_S or the
    TTL, then they run it themselves); past half its life an entry is refreshed by the one
    request that sets the refresh flag while the others keep reading it. An answer whose
    statement outlasted the TTL is kept OFFER_PAGE_GRACE_S for those who waited. A GPU booked
    meanwhile stays listed until the entry expires: booking checks capacity again, so a stale
    row costs a refused or re-planned booking, never a double booking. When Redis fails the
    statement runs as if there were no cache."""
    sql, params = offer_list_sql(filters=filters, limit=limit, offset=offset)
    return _offers_cached(sql, params, shape or list)


def offers_by_card(
    *, filters: OfferFilters, per_card: int, shape: Callable[[list[dict]], T], cached: bool
) -> T:
    """Each card's `per_card` cheapest offers (the filters' ordering aside), all cards in one
    statement (marketplace.queries.offers_by_card_statement), as `shape(rows)`: served from the
    offers cache as offer_page serves a page when `cached`, else read at this instant."""
    sql, params = offers_by_card_sql(filters=filters, per_card=per_card)
    if not cached:
        return shape(queries.offers_run(sql, params))
    return _offers_cached(sql, params, shape)


def _offers_cached(sql: str, params: list, shape: Callable[[list[dict]], T]) -> T:
    """shape(the statement's rows), through the offers cache (offer_page says how)."""
    ttl_s = settings.GPUMARKET["OFFERS_CACHE_TTL_S"]
    clients = redis_clients()
    client = clients.hot() if ttl_s > 0 else None
    if client is None:
        return shape(queries.offers_run(sql, params))
    shaped = f"{shape.__module__}.{shape.__qualname__}"
    digest = hashlib.sha256(
        f"{_OFFER_PAGE_KEY_VERSION}\n{shaped}\n{sql}\n{params!r}".encode()
    ).hexdigest()
    key = f"gpumarket:offers:{digest}"
    fill = f"{key}:fill"
    wait_s = min(ttl_s, OFFER_PAGE_FILL_WAIT_S)
    try:
        cached = client.get(key)
        if cached is not None:
            # Our own Redis, written only below (as Django's cache pickles).
            refresh_at, rows = pickle.loads(cached)  # noqa: S301
            if time.time() < refresh_at or not client.set(
                f"{key}:refresh", 1, nx=True, px=max(1, int(ttl_s * 500))
            ):
                return rows
            fill = None  # refreshing: the others read the entry meanwhile
        elif not client.set(fill, 1, nx=True, px=max(1, int(wait_s * 1000))):
            filled = _offer_page_awaited(client, key, wait_s=wait_s)
            if filled is not None:
                return filled
            fill = None  # the filler is gone or too slow: run it here, as it would
    except redis.RedisError as exc:
        clients.hot_failed(exc)
        return shape(queries.offers_run(sql, params))
    try:
        started = time.time()
        rows = shape(queries.offers_run(sql, params))
        # The entry lives TTL seconds from the statement's start: no row older than that is
        # served, but for the grace of an answer others waited for.
        left_ms = int((started + ttl_s - time.time()) * 1000)
        try:
            client.set(
                key,
                pickle.dumps((started + ttl_s / 2, rows)),
                px=max(left_ms, int(OFFER_PAGE_GRACE_S * 1000)),
            )
        except redis.RedisError as exc:
            clients.hot_failed(exc)
        return rows
    finally:
        if fill is not None:
            try:
                client.delete(fill)
            except redis.RedisError as exc:
                clients.hot_failed(exc)


def _offer_page_awaited(client, key: str, *, wait_s: float) -> object | None:
    """The entry at `key` once another request has stored it, looked for at growing intervals
    for up to `wait_s`; None when it did not appear."""
    deadline = time.monotonic() + wait_s
    pause = _FILL_POLL_S[0]
    while True:
        time.sleep(max(0.0, min(pause, deadline - time.monotonic())))
        cached = client.get(key)
        if cached is not None:
            return pickle.loads(cached)[1]  # noqa: S301 - our own Redis, as above
        if time.monotonic() >= deadline:
            return None
        pause = min(2 * pause, _FILL_POLL_S[1])


def rental_list(*, team: Team, status: str | None = None) -> QuerySet[Rental]:
    """The team's rentals, whoever of its members created them."""
    rentals = Rental.objects.filter(team=team).select_related("customer")
    if status:
        rentals = rentals.filter(status=status)
    return rentals.order_by("-created_at")


def _rental_detail_prefetches() -> tuple[Prefetch, ...]:
    return (
        Prefetch("events", queryset=RentalEvent.objects.order_by("created_at", "id")),
        Prefetch(
            "allocations",
            queryset=Allocation.objects.select_related("node", "gpu").order_by(
                "node_id", "gpu__index"
            ),
        ),
        # The storage app's links, reached through the relation it declares: the marketplace
        # sits below that app and never imports it.
        Prefetch(
            "dataset_links",
            queryset=Rental.dataset_links.rel.related_model.objects.select_related("dataset"),
        ),
        "credits",
    )


def rental_get(*, team: Team, rental_id) -> Rental | None:
    """One of the team's rentals with its history, its GPUs and how to reach it (`access`, see
    rental_access); another team's id is None."""
    rental = (
        Rental.objects.filter(team=team, pk=rental_id)
        .select_related("customer")
        .prefetch_related(*_rental_detail_prefetches())
        .first()
    )
    if rental is not None:
        rental.access = rental_access(rental)
        rental.members = rental_members(rental)
        rental.pull_progress = rental_pull_progress(rental, rental.members)
    return rental


# The live log lines shown per member of a rental (the whole log: `gpumarket logs`).
MEMBER_LOG_LINES = 20


def rental_members(rental: Rental) -> list[dict]:
    """Each member of the rental's current (else last) placement: its node rank (None on one
    node), its node, its run's state as the agent last reported it, and the tail of its log
    (what it printed last; the exit's tail once it has ended). Read through the reverse
    relations of provisioning's runs and log lines: no import of that app."""
    members = []
    runs = rental.runs.select_related("node").order_by("node_rank", "node_id")
    for run in runs:
        tail = run.log_tail
        if not tail:
            lines = rental.log_lines.filter(run_id=run.run_id).order_by("-line_no")
            tail = "\n".join(reversed(lines.values_list("line", flat=True)[:MEMBER_LOG_LINES]))
        members.append(
            {
                "node_rank": run.node_rank,
                "node": run.node.hostname,
                "state": run.status,
                "exit_code": run.exit_code,
                "started_at": run.started_at,
                "finished_at": run.finished_at,
                "log_tail": tail,
                "pull_progress": run.pull_progress if run.status == "requested" else None,
            }
        )
    return members


def rental_pull_progress(rental: Rental, members: list[dict]) -> dict | None:
    """While the rental is provisioning and its image is pulled: bytes pulled and in all over
    its members that have not started, and the line shown for it ("pulling 3.2 of 8.1 GB")."""
    if rental.status not in (RentalStatus.SCHEDULED, RentalStatus.PROVISIONING):
        return None
    pulls = [m["pull_progress"] for m in members if m.get("pull_progress")]
    if not pulls:
        return None
    done = sum(int(p.get("done_bytes", 0)) for p in pulls)
    total = max(done, sum(int(p.get("total_bytes", 0)) for p in pulls))
    return {"done_bytes": done, "total_bytes": total, "text": pull_text(done, total)}


def pull_text(done: int, total: int) -> str:
    """`pulling 3.2 of 8.1 GB` (MB below a gigabyte; decimal units, as registries count)."""
    if total >= 10**9:
        return f"pulling {done / 1e9:.1f} of {total / 1e9:.1f} GB"
    return f"pulling {done / 1e6:.0f} of {total / 1e6:.0f} MB"


def rental_created_detail(*, rental: Rental) -> Rental:
    """The rental rental_create returned, as rental_get gives it, without reading it again: its
    history is what the create wrote (`created_event`, `created_dataset_links`) and no GPUs.
    For the create's answer only: the relations it fills are what they were at creation."""
    for name, rows in (
        ("events", [rental.created_event]),
        ("allocations", []),
        ("dataset_links", rental.created_dataset_links),
        ("credits", []),
    ):
        _prefetched(rental, name, rows)
    rental.access = []
    rental.members = []
    rental.pull_progress = None
    return rental


def _prefetched(instance, name: str, rows: list) -> None:
    """Fill a reverse relation's prefetch cache with rows in hand, as prefetch_related does: its
    `.all()` gives them, a `.filter()` still queries."""
    rows_qs = getattr(instance, name).get_queryset()
    rows_qs._result_cache = list(rows)
    rows_qs._prefetch_done = True
    if not hasattr(instance, "_prefetched_objects_cache"):
        instance._prefetched_objects_cache = {}
    instance._prefetched_objects_cache[name] = rows_qs


def provider_list(*, owner: User) -> QuerySet[Provider]:
    return Provider.objects.filter(owner=owner).order_by("name")


def _with_rented_gpus(nodes: QuerySet[Node]) -> QuerySet[Node]:
    rented = (
        Allocation.objects.filter(
            node=OuterRef("pk"), released_at__isnull=True, during__contains=timezone.now()
        )
        .order_by()
        .values("node")
        .annotate(n=Count("gpu", distinct=True))
        .values("n")
    )
    # The GPUs with a health warning or fault, for the provider to see (OK ones say nothing).
    unhealthy = Prefetch(
        "gpus",
        queryset=Gpu.objects.exclude(health=GpuHealth.OK).order_by("index"),
        to_attr="unhealthy_gpus",
    )
    return (
        nodes.select_related("gpu_model", "cluster")
        .prefetch_related(unhealthy)
        .annotate(rented_gpus=Coalesce(Subquery(rented), 0))
    )


def provider_nodes(*, owner: User, provider_id: int) -> QuerySet[Node] | None:
    """The owner's provider's nodes with the GPUs rented now; another owner's provider: None."""
    if not Provider.objects.filter(pk=provider_id, owner=owner).exists():
        return None
    return _with_rented_gpus(Node.objects.filter(provider_id=provider_id)).order_by("hostname")


def provider_node(*, owner: User, node_id: int) -> Node | None:
    """One of the owner's nodes with the GPUs rented now; another owner's node: None."""
    return _with_rented_gpus(Node.objects.filter(pk=node_id, provider__owner=owner)).first()


def _with_nodes(clusters: QuerySet[Cluster]) -> QuerySet[Cluster]:
    nodes = Node.objects.select_related("gpu_model").order_by("hostname")
    return clusters.prefetch_related(Prefetch("nodes", queryset=nodes)).order_by("name")


def provider_clusters(*, owner: User, provider_id: int) -> QuerySet[Cluster] | None:
    """The owner's provider's clusters with their nodes; another owner's provider: None."""
    if not Provider.objects.filter(pk=provider_id, owner=owner).exists():
        return None
    return _with_nodes(Cluster.objects.filter(provider_id=provider_id))


def provider_cluster(*, owner: User, cluster_id: int) -> Cluster | None:
    """One of the owner's clusters with its nodes; another owner's cluster: None."""
    return _with_nodes(Cluster.objects.filter(pk=cluster_id, provider__owner=owner)).first()


_ENGINE_NODE_FIELDS = (
    "id",
    "region",
    "pool",
    "price_per_gpu_hour",
    "min_bid_per_gpu_hour",
    "reliability",
    "nvlink",
    "ssh_capable",
    "internet_capable",
    "image_allow",
    "cluster_id",
    "cluster__bandwidth_gbps",
    "gpu_model__slug",
    "gpu_model__family",
    "gpu_model__memory_gb",
    "gpu_model__tensor_tflops",
)


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeFilter:
    """What a request asks of a node's listing (not of its free GPUs), for engine_nodes_cheapest.
    An empty or None field does not filter."""

    pool: str
    region: str = ""  # the region or any of its zones (eu matches eu and eu-west)
    gpu_models: tuple[str, ...] = ()
    gpu_families: tuple[str, ...] = ()
    min_memory_gb: int = 0
    min_tensor_tflops: Decimal = Decimal(0)
    min_gpus: int = 0
    max_min_bid: Decimal | None = None  # nodes whose minimum bid is at most this
    max_price: Decimal | None = None  # nodes whose price is at most this
    ssh: bool = False  # only nodes whose agent can give a rental SSH (Node.ssh_capable)
    internet: bool = False  # only nodes where a rental may have the internet (internet_capable)
    clustered: bool = False  # only nodes in a cluster (what a gang's members need)
    min_interconnect_gbps: int = 0  # with clustered: only clusters at least this fast


def engine_nodes_cheapest(nodes: NodeFilter, *, limit: int) -> list[engine.Node]:
    """The `limit` cheapest listed nodes that meet `nodes` (whatever their state), with their
    GPUs, as the engine's values: one statement, written once. On every create (the refusal
    check), where compiling the same query through the ORM cost more than running it."""
    params = {
        "pool": nodes.pool,
        "region": nodes.region,
        "zones": f"{queries.like_escaped(nodes.region)}-%",
        "models": list(nodes.gpu_models),
        "families": list(nodes.gpu_families),
        "memory": nodes.min_memory_gb,
        "tflops": nodes.min_tensor_tflops,
        "gpus": nodes.min_gpus,
        "bid": nodes.max_min_bid,
        "price": nodes.max_price,
        "ssh": nodes.ssh,
        "internet": nodes.internet,
        "clustered": nodes.clustered,
        "gbps": nodes.min_interconnect_gbps,
        "limit": limit,
    }
    result = []
    for *fields, gpu_ids, indexes, groups in queries.nodes_cheapest(params=params):
        r = dict(zip(_ENGINE_NODE_FIELDS, fields, strict=True))
        gpus = [
            _engine_gpu(r, gpu_id, index, group)
            for gpu_id, index, group in zip(gpu_ids, indexes, groups, strict=True)
        ]
        result.append(_engine_node(r, gpus))
    return result


def _engine_gpu(r: dict, gpu_id: int, index: int, group: str) -> engine.Gpu:
    return engine.Gpu(
        gpu_id=gpu_id,
        node_id=r["id"],
        index=index,
        model=r["gpu_model__slug"],
        family=r["gpu_model__family"],
        memory_gb=r["gpu_model__memory_gb"],
        tensor_tflops=float(r["gpu_model__tensor_tflops"]),
        group=group,
        nvlink=r["nvlink"],
    )


def _engine_node(r: dict, gpus: list[engine.Gpu]) -> engine.Node:
    return engine.Node(
        node_id=r["id"],
        region=r["region"],
        price_per_gpu_hour=r["price_per_gpu_hour"],
        min_bid=r["min_bid_per_gpu_hour"],
        reliability=float(r["reliability"]),
        gpus=tuple(gpus),
        pool=r["pool"],
        ssh_capable=r["ssh_capable"],
        internet_capable=r["internet_capable"],
        cluster=r["cluster_id"],
        interconnect_gbps=r["cluster__bandwidth_gbps"] or 0,
        image_allow=None if r["image_allow"] is None else tuple(r["image_allow"]),
        images=node_image_refs(r.get("images")),
    )


def node_image_refs(images: object) -> frozenset[str]:
    """The normalized references of a node's reported images (Node.images)."""
    if not isinstance(images, list):
        return frozenset()
    return frozenset(
        image_normalize(item["ref"])
        for item in images
        if isinstance(item, dict) and isinstance(item.get("ref"), str)
    )


def engine_nodes(nodes: QuerySet[Node] | Iterable[Node]) -> list[engine.Node]:
    """Map node rows (with their GPUs) to the engine's value types, in two queries."""
    # With the images they hold: what the scheduler ranks by (the create-time check needs not).
    rows = list(
        nodes.values(*_ENGINE_NODE_FIELDS, "images") if isinstance(nodes, QuerySet) else nodes
    )
    by_node: dict[int, list[engine.Gpu]] = {r["id"]: [] for r in rows}
    info = {r["id"]: r for r in rows}
    # A FAILED GPU is out of placement until a check passes (provisioning's health).
    gpus = (
        Gpu.objects.filter(node_id__in=list(by_node))
        .exclude(health=GpuHealth.FAILED)
        .order_by("node_id", "index")
    )
    for gpu_id, node_id, index, group in gpus.values_list(
        "id", "node_id", "index", "topology_group"
    ):
        by_node[node_id].append(_engine_gpu(info[node_id], gpu_id, index, group))
    return [_engine_node(r, by_node[r["id"]]) for r in rows]


def nodes_internet_capable(node_ids: Iterable[int]) -> bool:
    """Whether every one of these nodes may host a rental with the internet."""
    wanted = set(node_ids)
    return Node.objects.filter(pk__in=wanted, internet_capable=True).count() == len(wanted)


def rental_owned(*, team: Team, rental_id) -> Rental:
    """One of the team's rentals (NotFound for another team's)."""
    rental = Rental.objects.filter(pk=rental_id, team=team).first()
    if rental is None:
        raise NotFound("no such rental")
    return rental


# -- SSH access ----------------------------------------------------------------------------------

# The login name shown in a rental's ssh command: the user of the harness image (uid 1000), the
# user rental containers run as.
SSH_LOGIN = "harness"
# Where a rental's JupyterLab listens in its container: agentprotocol.JUPYTER_PORT, where the
# agent starts it (a test checks the two agree).
JUPYTER_PORT = 8888


def rental_ssh_keys(rentals: Iterable[Rental]) -> dict:
    """rental pk -> the public key lines allowed into its sshd: the keys of the rental's team,
    for the rentals that asked for SSH (one query for all of them)."""
    wanted = [rental for rental in rentals if rental.ssh]
    if not wanted:
        return {}
    lines: dict[int, list[str]] = {}
    keys = SshKey.objects.filter(team_id__in={rental.team_id for rental in wanted})
    for team_id, line in keys.order_by("id").values_list("team_id", "public_key"):
        lines.setdefault(team_id, []).append(line)
    return {rental.pk: tuple(lines.get(rental.team_id, ())) for rental in wanted}


def rental_access(rental: Rental) -> list[dict]:
    """How to reach the rental's running container: each published port with where it is
    published and, for SSH, the command. Read from its runs' last reports (provisioning's
    ContainerRun, through the reverse relation: no import of that app)."""
    if rental.status not in ACTIVE:
        return []
    access = []
    for run in rental.runs.filter(status="running").order_by("id"):
        for port in run.published or []:
            entry = {**port, "command": "", "url": ""}
            where = f"{port['host']}:{port['host_port']}"
            if port.get("container_port") == 22 and rental.ssh:
                entry["command"] = f"ssh -p {port['host_port']} {SSH_LOGIN}@{port['host']}"
            elif port.get("container_port") == JUPYTER_PORT and rental.jupyter:
                entry["url"] = f"http://{where}/lab?token={rental.jupyter_token}"
            else:
                entry["url"] = f"http://{where}/"
            access.append(entry)
    return access


def template_list(*, team: Team) -> QuerySet[RentalTemplate]:
    return RentalTemplate.objects.filter(team=team).select_related("created_by").order_by("name")


def template_get(*, team: Team, name: str) -> RentalTemplate | None:
    return template_list(team=team).filter(name=name).first()
