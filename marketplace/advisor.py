"""The advisor: "which card should I rent to train my model, and what will it cost?"

Pure arithmetic over the catalog and the live offers, using the well-known estimates
(approximations, stated as such in every answer):
- training compute is about 6 x parameters x tokens FLOPs (forward + backward), 8x with full
  activation recomputation;
- mixed-precision Adam keeps about 16 bytes per parameter (bf16/fp16 weights and gradients, fp32
  master weights and two moments) before activations; fp32 training keeps 16 too (weights,
  gradients, two moments, all fp32); ZeRO-3 shards all of it across the data-parallel GPUs;
- good training reaches 30-55 % model FLOPs utilisation of the dense tensor peak: 40 % is used on
  NVLink islands, 30 % across PCIe or several nodes, where communication costs more.
A card is proposed only if the model's states fit in 80 % of its memory (the rest for
activations and fragmentation), on as few GPUs as possible.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from decimal import ROUND_CEILING, Decimal

BYTES_PER_PARAM = 16
MEMORY_HEADROOM = 0.8
MFU_NVLINK = 0.40
MFU_PCIE = 0.30
SECONDS_PER_HOUR = 3600
MAX_GPUS = 64

# Well-known model sizes, so a customer can name one instead of counting parameters.
PRESETS: dict[str, float] = {
    "gpt2-small": 0.124e9,
    "gpt2-xl": 1.5e9,
    "llama-1b": 1.2e9,
    "llama-7b": 6.7e9,
    "llama-13b": 13e9,
    "llama-70b": 70e9,
}


@dataclass(frozen=True, slots=True, kw_only=True)
class Workload:
    """What the customer wants to train."""

    params: float
    tokens: float
    precision: str = "bf16"  # bf16 | fp16 | fp32
    activation_recompute: bool = False
    interruptible: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class Card:
    """A catalog card as the advisor needs it."""

    slug: str
    name: str
    memory_gb: int
    tensor_tflops: float
    fp32_tflops: float
    bf16: bool
    nvlink: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class Offer:
    """Free GPUs of one card on one node, right now."""

    node_id: int
    card: str
    free_gpus: int
    nvlink: bool
    price_per_gpu_hour: Decimal
    min_bid_per_gpu_hour: Decimal
    measured_tflops: float | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Option:
    """One way to run the workload, priced from live offers."""

    card: str
    card_name: str
    gpus: int
    gpus_per_node: int
    node_count: int
    strategy: str  # ddp | zero3
    precision: str
    memory_per_gpu_gb: float
    effective_tflops: float
    hours: float
    price_per_gpu_hour: Decimal
    cost: Decimal
    node_ids: tuple[int, ...]
    notes: tuple[str, ...]


def _gpus_needed(workload: Workload, card: Card) -> tuple[int, str, float] | None:
    """The fewest GPUs whose memory holds the training states, and how they are split."""
    states_gb = workload.params * BYTES_PER_PARAM / 1e9
    usable = card.memory_gb * MEMORY_HEADROOM
    if states_gb <= usable:
        return 1, "ddp", states_gb
    n = math.ceil(states_gb / usable)
    if n > MAX_GPUS:
        return None
    return n, "zero3", states_gb / n


def _peak_tflops(workload: Workload, card: Card) -> tuple[float, str, list[str]]:
    notes = []
    if workload.precision == "fp32":
        return card.fp32_tflops, "fp32", notes
    precision = workload.precision
    if precision == "bf16" and not card.bf16:
        precision = "fp16"
        notes.append(f"{card.name} has no bf16: fp16 with loss scaling instead")
    return card.tensor_tflops, precision, notes


def options(*, workload: Workload, cards: list[Card], offers: list[Offer]) -> list[Option]:
    """Every card that can run the workload on GPUs free now, cheapest total cost first."""
    flops = (8 if workload.activation_recompute else 6) * workload.params * workload.tokens
    by_card: dict[str, list[Offer]] = {}
    for offer in offers:
        by_card.setdefault(offer.card, []).append(offer)
    result = []
    for card in cards:
        need = _gpus_needed(workload, card)
        card_offers = by_card.get(card.slug, [])
        if need is None or not card_offers:
            continue
        n, strategy, per_gpu_gb = need
        peak, precision, notes = _peak_tflops(workload, card)
        placed = _place(n, card_offers, workload.interruptible)
        if placed is None:
            continue
        chosen, per_node, price = placed
        nvlink = len(chosen) == 1 and all(o.nvlink for o in chosen)
        mfu = MFU_NVLINK if n == 1 or nvlink else MFU_PCIE
        measured = [o.measured_tflops for o in chosen if o.measured_tflops]
        if measured and precision != "fp32":
            # A measured matmul rate beats the datasheet: the node may be power-capped or slower.
            peak = min(peak, min(measured))
            notes.append(f"uses the measured {peak:.0f} TFLOPS of the benchmark")
        effective = peak * mfu * n
        hours = flops / (effective * 1e12) / SECONDS_PER_HOUR
        cost = (price * n * Decimal(str(hours))).quantize(Decimal("0.01"), ROUND_CEILING)
        result.append(
            Option(
                card=card.slug,
                card_name=card.name,
                gpus=n,
                gpus_per_node=per_node,
                node_count=len(chosen),
                strategy=strategy,
                precision=precision,
                memory_per_gpu_gb=round(per_gpu_gb, 1),
                effective_tflops=round(effective, 1),
                hours=round(hours, 2),
                price_per_gpu_hour=price,
                cost=cost,
                node_ids=tuple(o.node_id for o in chosen),
                notes=(f"assumes {mfu:.0%} MFU of the dense peak", *notes),
            )
        )
    return sorted(result, key=lambda o: (o.cost, o.hours, o.card))


def _place(
    n: int, offers: list[Offer], interruptible: bool
) -> tuple[list[Offer], int, Decimal] | None:
    """The cheapest single node with n free GPUs, else a gang of equal shares on the cheapest
    nodes; the locked price is the dearest node's (every node of a gang is paid the same)."""

    def price(o: Offer) -> Decimal:
        return o.min_bid_per_gpu_hour if interruptible else o.price_per_gpu_hour

    ranked = sorted(offers, key=lambda o: (price(o), o.node_id))
    for offer in ranked:
        if offer.free_gpus >= n:
            return [offer], n, price(offer)
    for per_node in (8, 4, 2):
        if n % per_node:
            continue
        nodes = [o for o in ranked if o.free_gpus >= per_node][: n // per_node]
        if len(nodes) == n // per_node:
            return nodes, per_node, max(price(o) for o in nodes)
    return None
