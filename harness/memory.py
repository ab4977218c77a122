"""Memory per GPU of a decoder transformer's training step, by component: defined once for the
advisor (which plans with it) and the harness (which refuses at start a config that cannot fit
the GPUs it got). Standard library only, like ``harness.presets``.

Model states follow the ZeRO paper (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward
Training Trillion Parameter Models", Section 3.1 and Figure 1): mixed-precision Adam keeps 2 bytes
of 16-bit weights, 2 of 16-bit gradients and K = 12 of optimizer states (fp32 master weights and
two moments) per parameter; stage 1 shards the optimizer states over the data-parallel ranks,
stage 2 the gradients as well, stage 3 the weights too. Tensor and pipeline parallelism split the
parameters each GPU holds before ZeRO shards them.

Activations follow Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models" (Section 4, Table 2): per transformer layer and micro-batch, with sequence s,
micro-batch b, width h and a heads, sbh(34 + 5as/h) bytes in 16-bit without recomputation (the
5as/h of the attention scores is not kept by fused attention, which the harness runs); with
tensor parallelism t and sequence parallelism everything divides by t; selective recomputation
(the attention core) keeps sbh x 34 / t; full recomputation keeps the 2sbh/t layer inputs, plus
one layer's full set while it is recomputed. With the 1F1B pipeline schedule the first stage
holds p micro-batches of L/p layers: L layers' worth whatever p (Section 4.2.3). The logits for
the loss add 4sbv/t bytes (fp32). 32-bit training doubles every activation.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the harness's config module needs PyYAML; this one stays importable alone
    from harness.config import HarnessConfig

GB = 1e9
# The share of a card's memory a run can use: the CUDA context, the allocator's fragmentation
# and the communication buffers take the rest (approximate).
USABLE_SHARE = 0.9
# The stage each harness shard setting stands for.
ZERO_STAGE = {"none": 0, "zero2": 2, "zero3": 3}


def state_bytes_per_param(
    *, mixed: bool, optimizer: str, hidden: int
) -> tuple[float, float, float]:
    """(weights, gradients, optimizer states) in bytes per parameter; ``optimizer`` is
    ``adamw`` (or ``adam``), ``sgd`` (with momentum) or ``adafactor``."""
    weights = grads = 2.0 if mixed else 4.0
    master = 4.0 if mixed else 0.0
    if optimizer in ("adamw", "adam"):
        states = 8.0  # two fp32 moments
    elif optimizer == "sgd":
        states = 4.0  # one fp32 momentum
    else:
        # Adafactor (Shazeer and Stern 2018) keeps a row and a column factor of the second
        # moment, fp32, per weight matrix: about 2 / width values per parameter, no momentum.
        states = 4.0 * 2.0 / max(hidden, 1)
    return weights, grads, master + states


def model_state_bytes(
    *,
    params: float,
    mixed: bool,
    optimizer: str,
    hidden: int,
    dp: int,
    tp: int,
    pp: int,
    zero_stage: int,
) -> tuple[float, float, float]:
    """Bytes per GPU of weights, gradients and optimizer states (ZeRO paper, Section 3.1)."""
    local = params / (tp * pp)
    w, g, o = state_bytes_per_param(mixed=mixed, optimizer=optimizer, hidden=hidden)
    return (
        local * w / (dp if zero_stage >= 3 else 1),
        local * g / (dp if zero_stage >= 2 else 1),
        local * o / (dp if zero_stage >= 1 else 1),
    )


def decoder_activation_bytes(
    *,
    seq_len: int,
    micro_batch: int,
    hidden: int,
    heads: int,
    layers: int,
    vocab: int,
    tp: int,
    recompute: str,
    fp32: bool,
    fused_attention: bool = True,
) -> float:
    """Activation bytes per GPU at the peak (the first pipeline stage) for one micro-batch of
    ``micro_batch`` sequences; ``recompute`` is none, selective or full. ``fused_attention``
    (the harness's ``scaled_dot_product_attention``: flash or memory-efficient kernels on CUDA)
    keeps no s x s attention scores, so a layer keeps what selective recomputation keeps."""
    s, b, h, a, t, n = seq_len, micro_batch, hidden, heads, tp, layers
    sbh = s * b * h
    scores = 0.0 if fused_attention else 5 * a * s / (h * t)
    full_layer = sbh * (34 / t + scores)
    if recompute == "none":
        kept = n * full_layer
    elif recompute == "selective":
        kept = n * sbh * 34 / t
    else:
        kept = n * 2 * sbh / t + full_layer
    logits = 4 * s * b * vocab / t
    return (kept + logits) * (2.0 if fp32 else 1.0)


def harness_memory_gb(config: HarnessConfig, *, dp: int, device: str) -> dict[str, float] | None:
    """The memory per GPU a loaded harness config needs with ``dp`` data-parallel ranks, by
    component in GB (what the advisor would estimate); None for a model this does not cover."""
    model = config.model
    if model.name != "transformer":
        return None
    shape, layout = model.shape(), config.layout
    precision = config.train.precision
    mixed = precision in ("bf16", "fp16") or (precision == "auto" and device != "cpu")
    weights, grads, states = model_state_bytes(
        params=shape.param_count(),
        mixed=mixed,
        optimizer="adamw",
        hidden=shape.hidden,
        dp=dp,
        tp=layout.tp,
        pp=layout.pp,
        zero_stage=ZERO_STAGE[layout.shard],
    )
    micro_batch = layout.micro_batch or getattr(config.data, "batch_size", 1)
    if layout.pp > 1:
        # The pipeline cuts each micro-batch into pp_microbatches; one of those is in flight
        # per stage at the 1F1B peak.
        micro_batch = max(1, micro_batch // (layout.pp_microbatches or layout.pp))
    activations = decoder_activation_bytes(
        seq_len=getattr(config.data, "seq_len", None) or shape.seq_len,
        micro_batch=micro_batch,
        hidden=shape.hidden,
        heads=shape.heads,
        layers=shape.layers,
        vocab=shape.vocab_size,
        tp=layout.tp,
        recompute=layout.recompute,
        fp32=not mixed,
    )
    parts = {
        "weights": weights,
        "gradients": grads,
        "optimizer": states,
        "activations": activations,
    }
    parts["total"] = sum(parts.values())
    return {name: value / GB for name, value in parts.items()}


def fit_problem(
    config: HarnessConfig, *, dp: int, device: str, gpu_memory_gb: float
) -> tuple[str, str] | None:
    """(config key, reason) when the config cannot fit GPUs of ``gpu_memory_gb``; None when it
    fits or this model is not covered."""
    need = harness_memory_gb(config, dp=dp, device=device)
    usable = gpu_memory_gb * USABLE_SHARE
    if need is None or need["total"] <= usable:
        return None
    parts = ", ".join(f"{name} {need[name]:.1f}" for name in need if name != "total")
    return (
        "layout",
        f"needs about {need['total']:.1f} GB per GPU ({parts}) and the GPUs have "
        f"{gpu_memory_gb:g} GB ({usable:.1f} usable): shard the states (layout.shard=zero3), "
        "recompute activations, use a smaller micro-batch or more GPUs",
    )
