"""Calibration by real runs: each harness run's measured step time, throughput and peak memory
stored beside the advisor's estimate for the same run, the card's MFU prior moved toward what was
measured, and the advisor's own error on past runs.

The estimate compared is the one for what actually ran (the harness reports its model shape,
batch and GPU count in its start event) on the rental's card with the prior used at booking, so
a customer's own config is compared fairly. A node's report is not trusted blindly: the prior an
observation implies is bounded, and it moves the card's prior by a count-weighted step, never more
than a fifth of the way.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from django.db import transaction

from advisor.engine.compute import observed_prior
from advisor.engine.layouts import Run, default_topology, estimate
from advisor.engine.memory import Checkpointing, Layout, Precision
from advisor.engine.presets import decoder_shape
from advisor.models import AdvisorCheck, AdvisorPrior
from marketplace.models import GpuModel, Rental
from marketplace.selectors import catalog_card

# An observation implies a prior in this range, whatever the node reported.
OBSERVED_LOW, OBSERVED_HIGH = 0.01, 0.9
# The published prior counts as this many runs; after many runs each still moves it by 5 %.
PRIOR_WEIGHT_RUNS = 4
MIN_STEP = 0.05
ACCURACY_WINDOW = 500


@dataclass(frozen=True, slots=True, kw_only=True)
class Measured:
    """What a harness run of a decoder measured, and the shape it trained."""

    params: float
    layers: int
    hidden: int
    heads: int
    seq_len: int
    vocab: int
    kv_heads: int | None
    ffn_hidden: int | None
    micro_batch: int
    global_batch: int
    world_size: int
    layout: Layout
    precision: Precision
    checkpointing: Checkpointing
    step_s: float
    tokens_per_s: float
    peak_gb: float | None


def measured_from_events(events: list[dict]) -> Measured | None:
    """The run's measurements from the harness's JSON-line events (start, step, summary); None
    for a run that is not a decoder or reported too little to measure."""
    start = next((e for e in events if e.get("event") == "start"), None)
    steps = [e for e in events if e.get("event") == "step"]
    if start is None or not steps:
        return None
    try:
        config = start["config"]
        model, data, train = config["model"], config["data"], config["train"]
        if model.get("name") not in ("gpt", "transformer"):
            return None
        transformer = model["name"] == "transformer"
        # The first interval holds the warm-up (allocation, first kernels): left out when
        # there are later ones.
        rates = [float(e["samples_per_s"]) for e in steps[1:] or steps]
        peaks = [float(e["peak_mem_bytes"]) for e in steps if e.get("peak_mem_bytes")]
        samples_per_s = statistics.median(rates)
        global_batch = int(start["global_batch_size"])
        seq_len = int(data.get("seq_len", 128))
        micro_batch = int(data.get("batch_size", 32))
        world_size = int(start["world_size"])
        checkpointing = (
            Checkpointing.FULL if train.get("activation_checkpointing") else Checkpointing.NONE
        )
        # A transformer run reports the layout it used (the harness's layout section).
        ran = (start.get("layout") or {}) if transformer else {}
        if int(ran.get("pp", 1)) > 1:
            # The pipeline cuts each harness micro-batch into the advisor's micro-batches.
            micro_batch //= int(ran.get("pp_microbatches") or ran["pp"])
        if ran.get("recompute"):
            checkpointing = Checkpointing(ran["recompute"])
        layout = Layout(
            dp=int(ran.get("dp", world_size)),
            tp=int(ran.get("tp", 1)),
            pp=int(ran.get("pp", 1)),
            zero_stage={"none": 0, "zero2": 2, "zero3": 3}[ran.get("shard", "none")],
            micro_batch=micro_batch,
            checkpointing=checkpointing,
        )
        measured = Measured(
            params=float(start["params"]),
            layers=int(model.get("layers", 4)),
            hidden=int(model.get("hidden" if transformer else "width", 128)),
            heads=int(model.get("heads", 4)),
            seq_len=seq_len,
            vocab=int(model.get("vocab_size", 256) if transformer else data.get("vocab_size", 256)),
            kv_heads=int(model["kv_heads"]) if transformer else None,
            ffn_hidden=int(model["ffn_hidden"]) if transformer else None,
            micro_batch=micro_batch,
            global_batch=global_batch,
            world_size=world_size,
            layout=layout,
            precision=Precision(start["precision"]),
            checkpointing=checkpointing,
            step_s=global_batch / samples_per_s,
            tokens_per_s=samples_per_s * seq_len,
            peak_gb=max(peaks) / 1e9 if peaks else None,
        )
    except (KeyError, TypeError, ValueError, ZeroDivisionError, statistics.StatisticsError):
        return None
    positive = (measured.params, measured.step_s, measured.world_size, measured.micro_batch)
    return measured if all(x > 0 for x in positive) else None


def advisor_check_record(*, rental: Rental, events: list[dict]) -> AdvisorCheck | None:
    """Store a run's measurements beside the estimate and move the card's prior; once per
    rental (a second call returns the stored check). None when there is nothing to compare."""
    booked = rental.advisor_estimate or {}
    measured = measured_from_events(events)
    model = GpuModel.objects.filter(slug=booked.get("card")).first()
    if measured is None or model is None:
        return None
    prior_then = float(booked.get("mfu_prior") or catalog_card(model).prior)
    card = catalog_card(model, prior_then)
    shape = decoder_shape(
        params=measured.params,
        layers=measured.layers,
        hidden=measured.hidden,
        heads=measured.heads,
        kv_heads=measured.kv_heads,
        ffn_hidden=measured.ffn_hidden,
        seq_len=measured.seq_len,
        vocab=measured.vocab,
        global_batch=measured.global_batch,
        micro_batch=measured.micro_batch,
    )
    run = Run(shape=shape, tokens=1.0, precision=measured.precision)
    found = estimate(run, card, default_topology(card, measured.world_size), fixed=measured.layout)
    if found is None:
        return None
    observed = observed_prior(
        found.step,
        measured_step_s=measured.step_s,
        prior=prior_then,
        low=OBSERVED_LOW,
        high=OBSERVED_HIGH,
    )
    # A simulated host trains on its CPU: its step time says nothing about the card.
    simulated = rental.allocations.filter(node__simulated=True).exists()
    with transaction.atomic():
        existing = AdvisorCheck.objects.filter(rental=rental).first()
        if existing is not None:
            return existing
        prior, _ = AdvisorPrior.objects.select_for_update().get_or_create(
            card=model, defaults={"mfu": catalog_card(model).prior}
        )
        before = prior.mfu
        if not simulated:
            weight = max(1.0 / (prior.runs + 1 + PRIOR_WEIGHT_RUNS), MIN_STEP)
            step = before + weight * (observed - before)
            prior.mfu = min(OBSERVED_HIGH, max(OBSERVED_LOW, step))
            prior.runs += 1
            prior.save(update_fields=["mfu", "runs", "updated_at"])
        return AdvisorCheck.objects.create(
            simulated=simulated,
            rental=rental,
            card=model.slug,
            gpus=measured.world_size,
            estimated_step_s=found.step.total,
            measured_step_s=measured.step_s,
            estimated_tokens_per_s=found.tokens_per_s,
            measured_tokens_per_s=measured.tokens_per_s,
            estimated_peak_gb=found.memory.total / 1e9,
            measured_peak_gb=measured.peak_gb,
            prior_before=before,
            prior_after=prior.mfu,
        )


def accuracy() -> dict:
    """The advisor's error on past runs: median and 90th percentile of measured / estimated step
    time over the latest runs (None until there is one)."""
    ratios = sorted(
        c.measured_step_s / c.estimated_step_s
        for c in AdvisorCheck.objects.filter(simulated=False).only(
            "measured_step_s", "estimated_step_s"
        )[:ACCURACY_WINDOW]
    )
    if not ratios:
        return {"runs": 0, "median": None, "p90": None}
    p90 = (
        statistics.quantiles(ratios, n=10, method="inclusive")[-1] if len(ratios) > 1 else ratios[0]
    )
    return {
        "runs": len(ratios),
        "median": round(statistics.median(ratios), 3),
        "p90": round(p90, 3),
    }
