"""Every read of the marketplace, with its joins already chosen."""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal

from django.db.models import (
    Count,
    DecimalField,
    Exists,
    ExpressionWrapper,
    F,
    OuterRef,
    Q,
    QuerySet,
)
from django.utils import timezone

from marketplace.models import Allocation, ApiToken, Gpu, GpuModel, Node, NodeStatus, User

OFFER_ORDERINGS = {
    "price": ("price_per_gpu_hour", "node_id"),
    "-price": ("-price_per_gpu_hour", "node_id"),
    "memory": ("memory_gb", "price_per_gpu_hour", "node_id"),
    "-memory": ("-memory_gb", "price_per_gpu_hour", "node_id"),
    "price_per_tflop": ("price_per_tflop_hour", "node_id"),
    "-price_per_tflop": ("-price_per_tflop_hour", "node_id"),
    "tflops": ("tensor_tflops", "price_per_gpu_hour", "node_id"),
    "-tflops": ("-tensor_tflops", "price_per_gpu_hour", "node_id"),
    "reliability": ("reliability", "price_per_gpu_hour", "node_id"),
    "-reliability": ("-reliability", "price_per_gpu_hour", "node_id"),
    "free_gpus": ("free_gpus", "price_per_gpu_hour", "node_id"),
    "-free_gpus": ("-free_gpus", "price_per_gpu_hour", "node_id"),
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


def gpu_model_list() -> QuerySet[GpuModel]:
    return GpuModel.objects.all()


def free_gpus_now() -> QuerySet[Gpu]:
    """GPUs of online nodes that no active allocation holds at this instant."""
    now = timezone.now()
    held = Allocation.objects.filter(
        gpu=OuterRef("pk"), released_at__isnull=True, during__contains=now
    )
    return Gpu.objects.filter(node__status=NodeStatus.ONLINE).filter(~Exists(held))


def region_q(region: str, field: str = "region") -> Q:
    """`eu` matches `eu` and every `eu-*` region."""
    return Q(**{field: region}) | Q(**{f"{field}__startswith": f"{region}-"})


def offer_list(*, filters: OfferFilters) -> QuerySet:
    """Offers: one row per (node, GPU model) with the GPUs free right now, filtered and sorted."""
    gpus = free_gpus_now()
    f = filters
    if f.gpu_models:
        gpus = gpus.filter(model__slug__in=f.gpu_models)
    if f.gpu_families:
        gpus = gpus.filter(model__family__in=f.gpu_families)
    if f.min_memory_gb is not None:
        gpus = gpus.filter(model__memory_gb__gte=f.min_memory_gb)
    if f.min_tensor_tflops is not None:
        gpus = gpus.filter(model__tensor_tflops__gte=f.min_tensor_tflops)
    if f.nvlink is not None:
        gpus = gpus.filter(node__nvlink=f.nvlink)
    if f.region:
        gpus = gpus.filter(region_q(f.region, "node__region"))
    if f.max_price is not None:
        gpus = gpus.filter(node__price_per_gpu_hour__lte=f.max_price)
    if f.min_reliability is not None:
        gpus = gpus.filter(node__reliability__gte=f.min_reliability)
    offers = gpus.values(
        "node_id",
        "model_id",
        hostname=F("node__hostname"),
        provider=F("node__provider__name"),
        region=F("node__region"),
        nvlink=F("node__nvlink"),
        simulated=F("node__simulated"),
        reliability=F("node__reliability"),
        price_per_gpu_hour=F("node__price_per_gpu_hour"),
        min_bid_per_gpu_hour=F("node__min_bid_per_gpu_hour"),
        cpu_cores=F("node__cpu_cores"),
        ram_gb=F("node__ram_gb"),
        disk_gb=F("node__disk_gb"),
        cuda_version=F("node__cuda_version"),
        gpu_model=F("model__slug"),
        gpu_name=F("model__name"),
        memory_gb=F("model__memory_gb"),
        tensor_tflops=F("model__tensor_tflops"),
    ).annotate(
        free_gpus=Count("id"),
        price_per_tflop_hour=ExpressionWrapper(
            F("node__price_per_gpu_hour") / F("model__tensor_tflops"),
            output_field=DecimalField(max_digits=12, decimal_places=6),
        ),
    )
    if f.min_free_gpus is not None:
        offers = offers.filter(free_gpus__gte=f.min_free_gpus)
    return offers.order_by(*OFFER_ORDERINGS[f.ordering])


def node_list() -> QuerySet[Node]:
    return Node.objects.select_related("provider")


def api_token_list(*, user: User) -> QuerySet[ApiToken]:
    return ApiToken.objects.filter(user=user)
