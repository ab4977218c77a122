"""A plan as the harness runs it: which layouts the harness can run at all, and the harness
config (``harness.config``) of a planned run, so that booking a plan trains the planned model
with the planned layout.

The harness's layout section (docs/harness-layouts.md) has no ZeRO-1: it shards the gradients with
the optimizer states (``zero2``, PyTorch's fully sharded data parallelism without resharding after
the forward pass) or the weights too (``zero3``). Its pipeline cuts each micro-batch into
``pp_microbatches`` and runs them through a 1F1B schedule: the advisor's m micro-batches of a step
on a pipeline are one harness micro-batch of m x micro_batch sequences cut into m.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from advisor.engine.memory import Layout, Precision
from advisor.engine.presets import ModelShape
from harness.config import ConfigError, load_config_dict, resolve_layout

SHARDS: dict[int, str] = {0: "none", 2: "zero2", 3: "zero3"}
ZERO_STAGES = tuple(SHARDS)
# The largest token id a uint16 token file holds.
UINT16_VOCAB = 1 << 16


@dataclass(frozen=True, slots=True, kw_only=True)
class Unrunnable:
    """Why the harness cannot run a layout, and the request field at fault."""

    field: str
    reason: str


def unrunnable(shape: ModelShape, layout: Layout, precision: Precision) -> Unrunnable | None:
    """Why the harness would refuse this layout of this model, or None when it runs it."""
    model = shape.transformer
    if model is None:
        return Unrunnable(field="model", reason="the harness trains decoder transformers only")
    if layout.zero_stage not in SHARDS:
        return Unrunnable(
            field="zero_stage",
            reason="the harness shards as ZeRO-2 or ZeRO-3 (zero_stage 2 or 3) or not at all (0)",
        )
    if layout.tp > 1:
        for key in ("heads", "kv_heads", "ffn_hidden"):
            value = getattr(model, key)
            if value % layout.tp:
                return Unrunnable(field="tp", reason=f"must divide the model's {key} ({value})")
    if layout.pp > 1:
        if model.tie_embeddings:
            return Unrunnable(
                field="pp",
                reason="pipeline stages cannot share the model's tied input/output embedding",
            )
        if model.layers % layout.pp:
            return Unrunnable(field="pp", reason=f"must divide the model's layers ({model.layers})")
    sharded = layout.tp > 1 or layout.pp > 1 or layout.zero_stage > 0
    if sharded and precision == Precision.FP16:
        return Unrunnable(
            field="precision",
            reason="fp16 (loss scaling) runs with plain data parallelism only: on this card, "
            "no tp, pp or zero_stage",
        )
    return None


@dataclass(frozen=True, slots=True, kw_only=True)
class Batching:
    """A step's batch as the harness runs it."""

    micro_batch: int  # sequences per data-parallel rank per micro-step
    grad_accum: int
    pp_microbatches: int | None
    global_batch: int  # sequences per optimizer step


def batching(layout: Layout, micro_batches: int) -> Batching:
    """The harness's batch settings for ``micro_batches`` micro-batches per step and rank."""
    if layout.pp > 1:
        micro, accum, cut = layout.micro_batch * micro_batches, 1, micro_batches
    else:
        micro, accum, cut = layout.micro_batch, micro_batches, None
    return Batching(
        micro_batch=micro,
        grad_accum=accum,
        pp_microbatches=cut,
        global_batch=layout.dp * micro * accum,
    )


def layout_section(layout: Layout, micro_batches: int) -> dict:
    """The harness config's ``layout`` section for this layout."""
    batch = batching(layout, micro_batches)
    section = {
        "dp": layout.dp,
        "tp": layout.tp,
        "pp": layout.pp,
        "shard": SHARDS[layout.zero_stage],
        "recompute": str(layout.checkpointing),
        "micro_batch": batch.micro_batch,
        "grad_accum": batch.grad_accum,
    }
    if layout.pp > 1:
        section |= {"pp_schedule": "1f1b", "pp_microbatches": batch.pp_microbatches}
    return section


def harness_config(
    *,
    shape: ModelShape,
    layout: Layout,
    precision: Precision,
    micro_batches: int,
    tokens: float,
    dataset: str | None = None,
) -> dict:
    """The harness config that trains ``tokens`` tokens of this model with this layout: the
    preset by name (else the whole shape), steps = tokens / (global batch x sequence length)
    rounded up, the customer's dataset of token files (else the built-in tokens)."""
    model = shape.transformer
    if model is None:
        raise ValueError("the harness trains decoder transformers only")
    batch = batching(layout, micro_batches)
    steps = max(1, math.ceil(tokens / (batch.global_batch * shape.seq_len)))
    data: dict = {"name": "tokens", "seq_len": shape.seq_len, "batch_size": batch.micro_batch}
    if dataset:
        data["path"] = dataset
        data["dtype"] = "uint16" if model.vocab_size <= UINT16_VOCAB else "uint32"
    section = layout_section(layout, micro_batches)
    return {
        "model": {"name": "transformer", "preset": shape.preset}
        if shape.preset
        else {"name": "transformer", **model.to_dict()},
        "data": data,
        "train": {"steps": steps, "precision": str(precision), "grad_accum": batch.grad_accum},
        "layout": section,
    }


def harness_problems(
    config: dict, *, world_size: int, local_world_size: int
) -> list[tuple[str, str]]:
    """What the harness would refuse at start in this config on this many GPUs (and per node):
    (config key, reason) pairs, empty when it runs."""
    try:
        loaded = load_config_dict(config)
        resolve_layout(loaded.layout, world_size, local_world_size)
    except ConfigError as exc:
        return list(exc.problems)
    return []
