"""Every read of the marketplace, with its joins already chosen."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from decimal import Decimal
from functools import cache

from django.db import connection
from django.db.models import (
    Count,
    OuterRef,
    Prefetch,
    QuerySet,
    Subquery,
    Sum,
)
from django.db.models.functions import Coalesce
from django.utils import timezone

from core.errors import NotFound
from core.rows import model_from_row
from marketplace.advisor.compute import Card as AdvisorCard
from marketplace.advisor.compute import Topology
from marketplace.advisor.layouts import Run, fewest_fitting
from marketplace.advisor.presets import ModelShape, with_run
from marketplace.lifecycle import ACTIVE
from marketplace.models import (
    AdvisorPrior,
    Allocation,
    ApiToken,
    Artifact,
    Dataset,
    DatasetFile,
    Gpu,
    GpuModel,
    Invitation,
    Membership,
    Node,
    Provider,
    Rental,
    RentalDataset,
    RentalEvent,
    SshKey,
    Team,
    User,
)
from scheduler.engine import types as engine

# The most GPUs one node is listed with (the `fits=` filter looks no further).
MAX_GPUS_PER_NODE = 16

# ordering name -> SQL ORDER BY (whitelisted: never interpolate user text into SQL).
OFFER_ORDERINGS = {
    "price": "n.price_per_gpu_hour, n.id",
    "-price": "n.price_per_gpu_hour DESC, n.id",
    "memory": "m.memory_gb, n.price_per_gpu_hour, n.id",
    "-memory": "m.memory_gb DESC, n.price_per_gpu_hour, n.id",
    "price_per_tflop": "price_per_tflop_hour, n.id",
    "-price_per_tflop": "price_per_tflop_hour DESC, n.id",
    "tflops": "m.tensor_tflops, n.price_per_gpu_hour, n.id",
    "-tflops": "m.tensor_tflops DESC, n.price_per_gpu_hour, n.id",
    "reliability": "n.reliability, n.price_per_gpu_hour, n.id",
    "-reliability": "n.reliability DESC, n.price_per_gpu_hour, n.id",
    "free_gpus": "free_gpus, n.price_per_gpu_hour, n.id",
    "-free_gpus": "free_gpus DESC, n.price_per_gpu_hour, n.id",
}


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
        fits=advisor_fits(data["fits"]) if data.get("fits") else None,
    )


# A node's measured dense matmul rate is believed between 1% and 150% of its card's dense tensor
# peak (the FP16-accumulate peak where the card has a faster one), whatever precision it was
# measured in: FP32 without tensor cores is 6% or more of the tensor peak on every catalog card,
# and a power-capped or throttled card stays far above 1%. Outside the band the benchmark is
# kept for the record but neither shown nor priced: the agent's number is the provider's claim.
MEASURED_TFLOPS_MIN_SHARE = 0.01
MEASURED_TFLOPS_MAX_SHARE = 1.5


def measured_tflops_plausible(*, model: GpuModel, tflops: float) -> bool:
    """Whether a benchmark's TFLOPS can be believed for this card (the band above)."""
    peak = max(model.tensor_tflops, model.tensor_tflops_fp16_acc or 0)
    low = float(model.tensor_tflops) * MEASURED_TFLOPS_MIN_SHARE
    return low <= tflops <= float(peak) * MEASURED_TFLOPS_MAX_SHARE


def advisor_cards() -> list[AdvisorCard]:
    """The catalog as the advisor needs it, each card with its calibrated MFU prior if any."""
    priors = dict(AdvisorPrior.objects.values_list("card_id", "mfu"))
    return [advisor_card(m, priors.get(m.pk)) for m in GpuModel.objects.all()]


def advisor_card_get(slug: str) -> AdvisorCard | None:
    """One catalog card as the advisor needs it (two indexed reads, not the whole catalog)."""
    model = GpuModel.objects.filter(slug=slug).first()
    if model is None:
        return None
    prior = AdvisorPrior.objects.filter(card=model).values_list("mfu", flat=True).first()
    return advisor_card(model, prior)


def advisor_card(model: GpuModel, prior: float | None = None) -> AdvisorCard:
    return AdvisorCard(
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


def advisor_fits(shape: ModelShape) -> tuple[tuple[str, int, int], ...]:
    """Per card, the GPUs one node must have free for the model to fit with some layout
    (micro-batch 1, any ZeRO stage and recomputation), without and with NVLink."""
    run = Run(shape=with_run(shape, micro_batch=1), tokens=1.0)
    never = 1 << 30
    result = []
    for card in advisor_cards():
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


# The hot read of the marketplace. Written in SQL because it joins nodes to an aggregate of the
# allocations that hold GPUs right now, which the ORM can only express as a per-row subquery
# (ten times slower at 10,000 nodes).
_OFFERS_SQL = """
SELECT n.id AS node_id, n.hostname, p.name AS provider, n.region, n.nvlink, n.simulated,
       n.reliability, n.price_per_gpu_hour, n.min_bid_per_gpu_hour, n.cpu_cores, n.ram_gb,
       n.disk_gb, n.cuda_version, n.gpu_count, m.slug AS gpu_model, m.name AS gpu_name,
       m.memory_gb, m.tensor_tflops,
       n.gpu_count - COALESCE(busy.held, 0) AS free_gpus,
       round(n.price_per_gpu_hour / m.tensor_tflops, 6) AS price_per_tflop_hour,
       measured.tflops AS measured_tflops,
       round(n.price_per_gpu_hour / measured.tflops::numeric, 6) AS price_per_measured_tflop_hour
FROM marketplace_node n
JOIN marketplace_gpumodel m ON m.id = n.gpu_model_id
-- A measured rate outside the plausible band is not shown nor divided by (1e-20 TFLOPS would
-- price a TFLOP beyond any number the API can write).
CROSS JOIN LATERAL (
    SELECT CASE WHEN n.measured_tflops
        BETWEEN m.tensor_tflops * {min_share}
        AND GREATEST(m.tensor_tflops, COALESCE(m.tensor_tflops_fp16_acc, 0)) * {max_share}
        THEN n.measured_tflops END AS tflops
) measured
JOIN marketplace_provider p ON p.id = n.provider_id
LEFT JOIN (
    SELECT node_id, count(*) AS held FROM marketplace_allocation
    WHERE released_at IS NULL AND during @> now()
    GROUP BY node_id
) busy ON busy.node_id = n.id
WHERE n.status = 'online' AND n.gpu_count - COALESCE(busy.held, 0) >= %s {where}
ORDER BY {order}
LIMIT %s OFFSET %s
"""


def offer_list_sql(*, filters: OfferFilters, limit: int, offset: int) -> tuple[str, list]:
    """The offers statement and its parameters (the benchmark runs it raw as its baseline)."""
    f = filters
    where: list[str] = []
    params: list = [f.min_free_gpus or 1]
    if f.gpu_models:
        where.append("m.slug = ANY(%s)")
        params.append(list(f.gpu_models))
    if f.gpu_families:
        where.append("m.family = ANY(%s)")
        params.append(list(f.gpu_families))
    if f.min_memory_gb is not None:
        where.append("m.memory_gb >= %s")
        params.append(f.min_memory_gb)
    if f.min_tensor_tflops is not None:
        where.append("m.tensor_tflops >= %s")
        params.append(f.min_tensor_tflops)
    if f.nvlink is not None:
        where.append("n.nvlink = %s")
        params.append(f.nvlink)
    if f.region:
        where.append("(n.region = %s OR n.region LIKE %s)")
        params.extend([f.region, f"{_like_escaped(f.region)}-%"])
    if f.max_price is not None:
        where.append("n.price_per_gpu_hour <= %s")
        params.append(f.max_price)
    if f.min_reliability is not None:
        where.append("n.reliability >= %s")
        params.append(f.min_reliability)
    if f.fits is not None:
        where.append(
            "EXISTS (SELECT 1 FROM unnest(%s::text[], %s::int[], %s::int[]) AS f(slug, pcie, nvl)"
            " WHERE f.slug = m.slug AND n.gpu_count - COALESCE(busy.held, 0)"
            " >= CASE WHEN n.nvlink THEN f.nvl ELSE f.pcie END)"
        )
        params.extend([[row[i] for row in f.fits] for i in range(3)])
    sql = _OFFERS_SQL.format(
        where="".join(f" AND {clause}" for clause in where),
        order=OFFER_ORDERINGS[f.ordering],
        min_share=MEASURED_TFLOPS_MIN_SHARE,
        max_share=MEASURED_TFLOPS_MAX_SHARE,
    )
    params.extend([limit, offset])
    return sql, params


def offer_list(*, filters: OfferFilters, limit: int, offset: int) -> list[dict]:
    """Offers: one row per node with the GPUs free right now, filtered and sorted.

    Returns at most `limit` rows starting at `offset`; callers ask for one more row than they
    show to know whether a next page exists (no count: it would double the cost).
    """
    sql, params = offer_list_sql(filters=filters, limit=limit, offset=offset)
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        columns = [c.name for c in cursor.description]
        return [dict(zip(columns, row, strict=True)) for row in cursor.fetchall()]


def membership_get(*, user: User, team_id) -> Membership | None:
    """The user's membership of one team (with the team); a team they are not in is None."""
    if not isinstance(team_id, int) or isinstance(team_id, bool):
        return None
    return Membership.objects.select_related("team").filter(user=user, team_id=team_id).first()


def membership_current(*, user: User, team_id=None) -> Membership | None:
    """The team a signed-in person acts for: `team_id` when they are in it, else their
    personal team, else the first team they joined."""
    chosen = membership_get(user=user, team_id=team_id) if team_id is not None else None
    if chosen is not None:
        return chosen
    memberships = Membership.objects.select_related("team").filter(user=user)
    return memberships.filter(team__personal_of=user).first() or memberships.order_by("pk").first()


def membership_list(*, user: User) -> QuerySet[Membership]:
    """The teams a person belongs to, with their role in each (the switcher, GET /teams/)."""
    return (
        Membership.objects.select_related("team")
        .filter(user=user)
        .order_by("team__name", "team_id")
    )


def team_members(*, team: Team) -> QuerySet[Membership]:
    return Membership.objects.select_related("user").filter(team=team).order_by("created_at", "pk")


def invitation_pending_list(*, team: Team) -> QuerySet[Invitation]:
    return Invitation.objects.filter(
        team=team,
        accepted_at__isnull=True,
        revoked_at__isnull=True,
        expires_at__gt=timezone.now(),
    ).order_by("-created_at", "-id")


def invitation_by_key(*, raw: str) -> Invitation | None:
    """The invitation a link's secret names, whatever its state (the accept page shows why a
    link no longer works)."""
    from marketplace.services.accounts import token_hash

    return Invitation.objects.select_related("team").filter(key_hash=token_hash(raw)).first()


# Every request with a token reads it, its user and team and the user's membership of that team.
# Django compiling that join cost more CPU than anything else in a create, so the statement is
# built once from the models' own columns and the rows are made into models as the ORM does.
_TOKEN_JOIN = ((ApiToken, "t"), (User, "u"), (Team, "tm"), (Membership, "m"))


@cache
def _token_sql() -> str:
    columns = ", ".join(
        f'{alias}."{field.column}"'
        for model, alias in _TOKEN_JOIN
        for field in model._meta.concrete_fields
    )
    return (
        f"SELECT {columns} FROM {ApiToken._meta.db_table} t"  # noqa: S608 - the models' names
        f" JOIN {User._meta.db_table} u ON u.id = t.user_id"
        f" JOIN {Team._meta.db_table} tm ON tm.id = t.team_id"
        f" LEFT JOIN {Membership._meta.db_table} m"
        f" ON m.team_id = t.team_id AND m.user_id = t.user_id"
        " WHERE t.key_hash = %s"
    )


def api_token_authenticating(*, key_hash: str) -> ApiToken | None:
    """The token with that hash, its user and team, and as `membership` its user's membership
    of its team (None when they are no longer in it): one statement."""
    with connection.cursor() as cursor:
        cursor.execute(_token_sql(), [key_hash])
        row = cursor.fetchone()
    if row is None:
        return None
    loaded = []
    for model, _ in _TOKEN_JOIN:
        fields = model._meta.concrete_fields
        values, row = row[: len(fields)], row[len(fields) :]
        loaded.append(model_from_row(model, fields, values) if values[0] is not None else None)
    token, user, team, membership = loaded
    token.user, token.team = user, team
    if membership is not None:
        membership.user, membership.team = user, team
    token.membership = membership
    return token


def api_token_list(*, team: Team, user: User) -> QuerySet[ApiToken]:
    """The user's own tokens for the team."""
    return ApiToken.objects.filter(team=team, user=user)


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
        Prefetch("dataset_links", queryset=RentalDataset.objects.select_related("dataset")),
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
    return rental


def rental_created_detail(*, rental: Rental) -> Rental:
    """The rental rental_create returned, as rental_get gives it, without reading it again: its
    history is what the create wrote (`created_event`, `created_dataset_links`) and no GPUs.
    For the create's answer only: the relations it fills are what they were at creation."""
    for name, rows in (
        ("events", [rental.created_event]),
        ("allocations", []),
        ("dataset_links", rental.created_dataset_links),
    ):
        _prefetched(rental, name, rows)
    rental.access = []
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
    return nodes.select_related("gpu_model").annotate(rented_gpus=Coalesce(Subquery(rented), 0))


def provider_nodes(*, owner: User, provider_id: int) -> QuerySet[Node] | None:
    """The owner's provider's nodes with the GPUs rented now; another owner's provider: None."""
    if not Provider.objects.filter(pk=provider_id, owner=owner).exists():
        return None
    return _with_rented_gpus(Node.objects.filter(provider_id=provider_id)).order_by("hostname")


def provider_node(*, owner: User, node_id: int) -> Node | None:
    """One of the owner's nodes with the GPUs rented now; another owner's node: None."""
    return _with_rented_gpus(Node.objects.filter(pk=node_id, provider__owner=owner)).first()


_ENGINE_NODE_FIELDS = (
    "id",
    "region",
    "pool",
    "price_per_gpu_hour",
    "min_bid_per_gpu_hour",
    "reliability",
    "nvlink",
    "ssh_capable",
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


@cache
def _cheapest_nodes_sql() -> str:
    node, model, gpu = Node._meta.db_table, GpuModel._meta.db_table, Gpu._meta.db_table
    arrays = ", ".join(
        f"ARRAY(SELECT g.{column} FROM {gpu} g WHERE g.node_id = n.id ORDER BY g.index)"  # noqa: S608
        for column in ("id", "index", "topology_group")
    )
    # Only the models' table and column names go into the text; every value is a parameter.
    return (
        "SELECT n.id, n.region, n.pool, n.price_per_gpu_hour, n.min_bid_per_gpu_hour,"  # noqa: S608
        " n.reliability, n.nvlink, n.ssh_capable, m.slug, m.family, m.memory_gb, m.tensor_tflops,"
        f" {arrays}"
        f" FROM {node} n JOIN {model} m ON m.id = n.gpu_model_id"
        " WHERE n.pool = %(pool)s"
        " AND (%(region)s = '' OR n.region = %(region)s OR n.region LIKE %(zones)s)"
        " AND (cardinality(%(models)s::text[]) = 0 OR m.slug = ANY(%(models)s::text[]))"
        " AND (cardinality(%(families)s::text[]) = 0 OR m.family = ANY(%(families)s::text[]))"
        " AND m.memory_gb >= %(memory)s AND m.tensor_tflops >= %(tflops)s"
        " AND n.gpu_count >= %(gpus)s"
        " AND (%(bid)s::numeric IS NULL OR n.min_bid_per_gpu_hour <= %(bid)s::numeric)"
        " AND (%(price)s::numeric IS NULL OR n.price_per_gpu_hour <= %(price)s::numeric)"
        " AND (NOT %(ssh)s OR n.ssh_capable)"
        " ORDER BY n.price_per_gpu_hour, n.id LIMIT %(limit)s"
    )


def _like_escaped(text: str) -> str:
    return text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")


def engine_nodes_cheapest(nodes: NodeFilter, *, limit: int) -> list[engine.Node]:
    """The `limit` cheapest listed nodes that meet `nodes` (whatever their state), with their
    GPUs, as the engine's values: one statement, written once. On every create (the refusal
    check), where compiling the same query through the ORM cost more than running it."""
    params = {
        "pool": nodes.pool,
        "region": nodes.region,
        "zones": f"{_like_escaped(nodes.region)}-%",
        "models": list(nodes.gpu_models),
        "families": list(nodes.gpu_families),
        "memory": nodes.min_memory_gb,
        "tflops": nodes.min_tensor_tflops,
        "gpus": nodes.min_gpus,
        "bid": nodes.max_min_bid,
        "price": nodes.max_price,
        "ssh": nodes.ssh,
        "limit": limit,
    }
    with connection.cursor() as cursor:
        cursor.execute(_cheapest_nodes_sql(), params)
        rows = cursor.fetchall()
    result = []
    for *fields, gpu_ids, indexes, groups in rows:
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
    )


def engine_nodes(nodes: QuerySet[Node] | Iterable[Node]) -> list[engine.Node]:
    """Map node rows (with their GPUs) to the engine's value types, in two queries."""
    rows = list(nodes.values(*_ENGINE_NODE_FIELDS) if isinstance(nodes, QuerySet) else nodes)
    by_node: dict[int, list[engine.Gpu]] = {r["id"]: [] for r in rows}
    info = {r["id"]: r for r in rows}
    gpus = Gpu.objects.filter(node_id__in=list(by_node)).order_by("node_id", "index")
    for gpu_id, node_id, index, group in gpus.values_list(
        "id", "node_id", "index", "topology_group"
    ):
        by_node[node_id].append(_engine_gpu(info[node_id], gpu_id, index, group))
    return [_engine_node(r, by_node[r["id"]]) for r in rows]


# -- object storage: datasets and artifacts ------------------------------------------------------
# Who owns a dataset is decided here and nowhere else: the team (its `owner` is the member who
# uploaded it).

# The harness names each checkpoint `step_<step>.pt` (harness/checkpoint.py) in its checkpoint
# directory inside the output directory (/workspace/checkpoints in its image).
CHECKPOINT_NAME = re.compile(r"(?:^|/)step_(\d+)\.pt$")
CHECKPOINT_NAME_SQL = r"(^|/)step_[0-9]+\.pt$"


def datasets_owned(team: Team) -> QuerySet[Dataset]:
    """The team's datasets, whichever member uploaded them."""
    return Dataset.objects.filter(team=team)


def dataset_owned(*, team: Team, dataset_id) -> Dataset:
    """One of the team's datasets; another team's (or none) is NotFound."""
    dataset = datasets_owned(team).filter(pk=dataset_id).first()
    if dataset is None:
        raise NotFound("no such dataset")
    return dataset


def datasets_owned_by_name(*, team: Team, names: Iterable[str]) -> dict[str, Dataset]:
    return {d.name: d for d in datasets_owned(team).filter(name__in=list(names))}


def dataset_bytes_used(team: Team) -> int:
    """The bytes counted against the team's dataset quota (declared sizes, uploads included)."""
    return datasets_owned(team).aggregate(total=Coalesce(Sum("total_bytes"), 0))["total"]


def rental_owned(*, team: Team, rental_id) -> Rental:
    """One of the team's rentals (NotFound for another team's)."""
    rental = Rental.objects.filter(pk=rental_id, team=team).first()
    if rental is None:
        raise NotFound("no such rental")
    return rental


def rental_artifacts(*, team: Team, rental_id) -> QuerySet[Artifact]:
    """The synced output files of one of the team's rentals (NotFound for another team's)."""
    rental = rental_owned(team=team, rental_id=rental_id)
    return Artifact.objects.filter(rental=rental).order_by("path")


def latest_checkpoint(artifacts: Iterable[Artifact]) -> Artifact | None:
    """The checkpoint with the highest step among these artifacts, the last synced on a tie."""
    best: tuple[int, float, Artifact] | None = None
    for artifact in artifacts:
        match = CHECKPOINT_NAME.search(artifact.path)
        if match is None:
            continue
        rank = (int(match.group(1)), artifact.synced_at.timestamp(), artifact)
        if best is None or rank[:2] > best[:2]:
            best = rank
    return best[2] if best else None


def rentals_resume_checkpoints(rentals: Iterable[Rental]) -> dict:
    """rental id -> the checkpoint artifact it starts from: its own latest synced checkpoint
    (a requeued rental), else the latest one of the rental it was created to resume from."""
    rentals = list(rentals)
    sources = {r.pk for r in rentals} | {r.resume_from_id for r in rentals if r.resume_from_id}
    by_rental: dict = {}
    # Only checkpoint files are read: a rental's logs and other output can be many rows, and
    # this runs on every heartbeat of a busy node.
    checkpoints = Artifact.objects.filter(
        rental_id__in=sources, path__regex=CHECKPOINT_NAME_SQL
    ).only("rental_id", "path", "size_bytes", "sha256", "synced_at")
    for artifact in checkpoints:
        by_rental.setdefault(artifact.rental_id, []).append(artifact)
    found = {}
    for rental in rentals:
        checkpoint = latest_checkpoint(by_rental.get(rental.pk, ()))
        if checkpoint is None and rental.resume_from_id:
            checkpoint = latest_checkpoint(by_rental.get(rental.resume_from_id, ()))
        if checkpoint is not None:
            found[rental.pk] = checkpoint
    return found


def rentals_dataset_files(rental_ids: Iterable) -> dict:
    """rental id -> [(dataset, [its stored files])] of the datasets each rental reads."""
    links = (
        RentalDataset.objects.filter(rental_id__in=list(rental_ids))
        .select_related("dataset")
        .prefetch_related(
            Prefetch(
                "dataset__files",
                queryset=DatasetFile.objects.filter(stored_at__isnull=False).order_by("path"),
            )
        )
        .order_by("dataset__name")
    )
    found: dict = {}
    for link in links:
        found.setdefault(link.rental_id, []).append((link.dataset, list(link.dataset.files.all())))
    return found


# -- SSH access ----------------------------------------------------------------------------------

# The login name shown in a rental's ssh command: the user of the harness image (uid 1000), the
# user rental containers run as.
SSH_LOGIN = "harness"


def ssh_key_scope(*, team: Team) -> QuerySet[SshKey]:
    """The SSH keys a member of `team` may list, delete and log in with: the one place that says
    who owns a key (the team; any member adds and removes them)."""
    return SshKey.objects.filter(team=team)


def ssh_key_list(*, team: Team) -> QuerySet[SshKey]:
    """The team's keys with who added each."""
    return ssh_key_scope(team=team).select_related("owner").order_by("-created_at", "-id")


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
            entry = {**port, "command": ""}
            if port.get("container_port") == 22 and rental.ssh:
                entry["command"] = f"ssh -p {port['host_port']} {SSH_LOGIN}@{port['host']}"
            access.append(entry)
    return access
