"""The harness config schema: hand-written dataclasses and a strict, path-aware validator.

A config is a mapping with five optional sections, ``model``, ``data``, ``train``,
``checkpoint`` and ``layout``. ``model`` and ``data`` are variants chosen by their ``name`` key;
each variant
accepts only its own keys, so a typo (``model.layer``) or a key of another variant
(``model.layers`` on ``mnist_cnn``) is an error rather than a silently ignored setting.

Every problem is reported as ``<dotted.key.path>: <what is wrong>``; the CLI prints each one as
``config error: ...`` and exits with status 2. This module must stay free of torch imports: the
CLI validates before loading PyTorch, and the marketplace may validate a customer's config at
booking time.
"""

from __future__ import annotations

import dataclasses
import json
import os
import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from harness.paths import default_checkpoint_dir
from harness.presets import PRESETS, TransformerShape, default_ffn_hidden

CONFIG_ERROR_EXIT_CODE = 2

Precision = Literal["fp32", "fp16", "bf16", "auto"]
Device = Literal["auto", "cpu", "cuda"]
LrSchedule = Literal["constant", "cosine"]
CompileMode = Literal["default", "reduce-overhead", "max-autotune"]
Positions = Literal["rope", "learned"]
Shard = Literal["none", "zero2", "zero3"]
Recompute = Literal["none", "selective", "full"]
PipelineSchedule = Literal["1f1b", "gpipe"]
TokenDtype = Literal["uint16", "uint32"]


class ConfigError(Exception):
    """One or more problems in a harness config, each naming the offending key path."""

    def __init__(self, problems: Iterable[tuple[str, str]]) -> None:
        self.problems = list(problems)
        super().__init__("\n".join(self.lines()))

    def lines(self) -> list[str]:
        return [
            f"config error: {path}: {message}" if path else f"config error: {message}"
            for path, message in self.problems
        ]


def _bounds(
    *, gt: float | None = None, ge: float | None = None, le: float | None = None
) -> dict[str, float | None]:
    return {"gt": gt, "ge": ge, "le": le}


# --- model variants -------------------------------------------------------------------------


@dataclass(frozen=True)
class MnistCnnConfig:
    """The CNN of the classic PyTorch MNIST example, sized to the input images."""

    name: Literal["mnist_cnn"] = "mnist_cnn"
    # The example's two dropout layers (0.25 after the convolutions, 0.5 before the classifier).
    dropout: bool = True


@dataclass(frozen=True)
class ResNetConfig:
    """A small ResNet-style image model (basic blocks, GroupNorm)."""

    name: Literal["resnet"] = "resnet"
    widths: list[int] = field(default_factory=lambda: [32, 64, 128], metadata=_bounds(ge=4))
    blocks_per_stage: int = field(default=2, metadata=_bounds(ge=1))


@dataclass(frozen=True)
class GptConfig:
    """A small GPT-style decoder (pre-norm blocks with causal self-attention, tied embeddings)."""

    name: Literal["gpt"] = "gpt"
    layers: int = field(default=4, metadata=_bounds(ge=1))
    width: int = field(default=128, metadata=_bounds(ge=8))
    heads: int = field(default=4, metadata=_bounds(ge=1))
    dropout: float = field(default=0.0, metadata=_bounds(ge=0.0, le=0.9))


@dataclass(frozen=True)
class TransformerConfig:
    """A Llama-like decoder (harness.transformer) by preset name, by shape, or a preset with
    some of its shape changed. Loading resolves every shape key, so the effective config names
    the whole shape; ``shape()`` returns it."""

    name: Literal["transformer"] = "transformer"
    # A name of harness.presets.PRESETS; null: the shape keys below (layers, hidden, heads).
    preset: str | None = None
    layers: int | None = field(default=None, metadata=_bounds(ge=1))
    hidden: int | None = field(default=None, metadata=_bounds(ge=1))
    heads: int | None = field(default=None, metadata=_bounds(ge=1))
    kv_heads: int | None = field(default=None, metadata=_bounds(ge=1))
    ffn_hidden: int | None = field(default=None, metadata=_bounds(ge=1))
    vocab_size: int | None = field(default=None, metadata=_bounds(ge=2))
    seq_len: int | None = field(default=None, metadata=_bounds(ge=2))
    positions: Positions | None = None
    tie_embeddings: bool | None = None
    dropout: float = field(default=0.0, metadata=_bounds(ge=0.0, le=0.9))

    def shape(self) -> TransformerShape:
        """The shape; only valid on a loaded config (every shape key resolved)."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(TransformerShape)}
        missing = [name for name, value in values.items() if value is None]
        if missing:
            raise ValueError(f"unresolved transformer shape keys: {', '.join(missing)}")
        return TransformerShape(**values)


ModelConfig = MnistCnnConfig | ResNetConfig | GptConfig | TransformerConfig
MODEL_VARIANTS: dict[str, type] = {
    "mnist_cnn": MnistCnnConfig,
    "resnet": ResNetConfig,
    "gpt": GptConfig,
    "transformer": TransformerConfig,
}
LANGUAGE_MODELS = frozenset({"gpt", "transformer"})
IMAGE_MODELS = frozenset({"mnist_cnn", "resnet"})


# --- data variants --------------------------------------------------------------------------


@dataclass(frozen=True)
class DigitsDataConfig:
    """scikit-learn's bundled 8x8 digits (1797 images), split 80/20 with a fixed permutation."""

    name: Literal["digits"] = "digits"
    batch_size: int = field(default=64, metadata=_bounds(ge=1))
    eval_batch_size: int = field(default=512, metadata=_bounds(ge=1))


@dataclass(frozen=True)
class SyntheticDataConfig:
    """Generated tensors: images with a learnable label rule for image models, token
    sequences with a learnable rule for the GPT."""

    name: Literal["synthetic"] = "synthetic"
    batch_size: int = field(default=64, metadata=_bounds(ge=1))
    eval_batch_size: int = field(default=512, metadata=_bounds(ge=1))
    num_samples: int = field(default=8192, metadata=_bounds(ge=1))
    image_size: int = field(default=28, metadata=_bounds(ge=6))
    channels: int = field(default=1, metadata=_bounds(ge=1))
    seq_len: int = field(default=128, metadata=_bounds(ge=2))
    vocab_size: int = field(default=256, metadata=_bounds(ge=2))


@dataclass(frozen=True)
class TextDataConfig:
    """Text as byte-level tokens (vocabulary 256): the public-domain texts shipped with the
    harness, or the rental's own dataset (`path`)."""

    name: Literal["text"] = "text"
    batch_size: int = field(default=32, metadata=_bounds(ge=1))
    eval_batch_size: int = field(default=128, metadata=_bounds(ge=1))
    seq_len: int = field(default=128, metadata=_bounds(ge=2))
    # A UTF-8 file, or a directory whose *.txt files are read in name order; a relative path is
    # under GPUMARKET_DATA_DIR (/data in a rental, where its datasets are mounted). "": the
    # bundled texts.
    path: str = ""


@dataclass(frozen=True)
class TokensDataConfig:
    """Pre-tokenized data: flat arrays of token ids (``dtype``, native byte order, no header),
    read through a memory map, in contiguous windows of ``seq_len + 1`` tokens."""

    name: Literal["tokens"] = "tokens"
    batch_size: int = field(default=8, metadata=_bounds(ge=1))
    eval_batch_size: int = field(default=32, metadata=_bounds(ge=1))
    seq_len: int = field(default=128, metadata=_bounds(ge=2))
    # A token file, or a directory whose *.bin files are read in name order; relative: under
    # GPUMARKET_DATA_DIR. "": the bundled texts as byte tokens (for trying the harness).
    path: str = ""
    dtype: TokenDtype = "uint16"
    # The share of each file's windows (its last ones) kept for eval.
    eval_fraction: float = field(default=0.1, metadata=_bounds(ge=0.0, le=0.5))


DataConfig = DigitsDataConfig | SyntheticDataConfig | TextDataConfig | TokensDataConfig
DATA_VARIANTS: dict[str, type] = {
    "digits": DigitsDataConfig,
    "synthetic": SyntheticDataConfig,
    "text": TextDataConfig,
    "tokens": TokensDataConfig,
}
TOKEN_DATASETS = frozenset({"synthetic", "text", "tokens"})


# --- train and checkpoint -------------------------------------------------------------------


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation, precision and logging settings."""

    steps: int = field(default=1000, metadata=_bounds(ge=1))
    lr: float = field(default=1e-3, metadata=_bounds(gt=0.0))
    weight_decay: float = field(default=0.01, metadata=_bounds(ge=0.0))
    warmup_steps: int = field(default=0, metadata=_bounds(ge=0))
    lr_schedule: LrSchedule = "cosine"
    min_lr_ratio: float = field(default=0.1, metadata=_bounds(ge=0.0, le=1.0))
    grad_accum: int = field(default=1, metadata=_bounds(ge=1))
    grad_clip: float = field(default=1.0, metadata=_bounds(ge=0.0))
    precision: Precision = "auto"
    device: Device = "auto"
    seed: int = field(default=0, metadata=_bounds(ge=0))
    activation_checkpointing: bool = False
    compile: bool = False
    compile_mode: CompileMode = "default"
    # TF32 tensor-core matmuls for fp32 work on CUDA (Ampere and newer); ignored elsewhere.
    tf32: bool = True
    deterministic: bool = False
    eval_every: int = field(default=0, metadata=_bounds(ge=0))
    log_every: int = field(default=10, metadata=_bounds(ge=1))


@dataclass(frozen=True)
class CheckpointConfig:
    """Where and how often to checkpoint; resuming from the latest one is automatic."""

    enabled: bool = True
    dir: str = field(default_factory=default_checkpoint_dir)
    every_steps: int = field(default=0, metadata=_bounds(ge=0))
    every_seconds: float = field(default=600.0, metadata=_bounds(ge=0.0))
    keep: int = field(default=3, metadata=_bounds(ge=1))
    resume: bool = True


@dataclass(frozen=True)
class LayoutConfig:
    """How the job's processes split the work: data parallel (``dp``, sharded by ``shard``),
    tensor parallel (``tp``, inside a node) and pipeline parallel (``pp``) over a
    ``pp x dp x tp`` device mesh, activation recomputation, and the batch geometry. Loading
    fills ``micro_batch`` and ``grad_accum`` from ``data.batch_size`` and ``train.grad_accum``
    (or sets those from them); ``dp`` left out is the world size / (tp x pp) at start."""

    dp: int | None = field(default=None, metadata=_bounds(ge=1))
    tp: int = field(default=1, metadata=_bounds(ge=1))
    pp: int = field(default=1, metadata=_bounds(ge=1))
    shard: Shard = "none"
    recompute: Recompute = "none"
    micro_batch: int | None = field(default=None, metadata=_bounds(ge=1))
    grad_accum: int | None = field(default=None, metadata=_bounds(ge=1))
    pp_schedule: PipelineSchedule = "1f1b"
    # Pipeline micro-batches each micro-batch is cut into; null: pp.
    pp_microbatches: int | None = field(default=None, metadata=_bounds(ge=1))
    # Layers per pipeline stage, first to last; null: layers / pp each.
    pp_split: list[int] | None = field(default=None, metadata=_bounds(ge=1))

    @property
    def parallel(self) -> bool:
        """Whether anything beyond plain data parallelism (DDP) is asked for."""
        return self.tp > 1 or self.pp > 1 or self.shard != "none" or self.recompute != "none"


@dataclass(frozen=True)
class HarnessConfig:
    """A complete, validated harness config."""

    model: ModelConfig = field(default_factory=MnistCnnConfig)
    data: DataConfig = field(default_factory=DigitsDataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    layout: LayoutConfig = field(default_factory=LayoutConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# --- validation -----------------------------------------------------------------------------

_INVALID = object()


def _describe(value: Any) -> str:
    if isinstance(value, str):
        return f"string {value!r}"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, Mapping):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    return repr(value)


def _bound_message(kind: str, meta: Mapping[str, Any]) -> str:
    gt, ge, le = meta.get("gt"), meta.get("ge"), meta.get("le")
    article = "an" if kind == "integer" else "a"
    if le is None and (gt == 0 or (kind == "integer" and ge == 1)):
        return f"must be a positive {kind}"
    if le is None and ge == 0:
        return f"must be a non-negative {kind}"
    if ge is not None and le is not None:
        return f"must be {article} {kind} between {ge} and {le}"
    if ge is not None:
        return f"must be {article} {kind} >= {ge}"
    if gt is not None:
        return f"must be {article} {kind} > {gt}"
    return f"must be {article} {kind} <= {le}"


def _in_bounds(value: float, meta: Mapping[str, Any]) -> bool:
    gt, ge, le = meta.get("gt"), meta.get("ge"), meta.get("le")
    return (
        (gt is None or value > gt) and (ge is None or value >= ge) and (le is None or value <= le)
    )


def _convert(value: Any, tp: Any, meta: Mapping[str, Any], path: str, problems: list) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        (inner,) = (arg for arg in typing.get_args(tp) if arg is not type(None))
        return None if value is None else _convert(value, inner, meta, path, problems)
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices or isinstance(value, bool):
            allowed = ", ".join(repr(c) for c in choices)
            problems.append((path, f"must be one of {allowed} (got {_describe(value)})"))
            return _INVALID
        return value
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if not isinstance(value, list) or not value:
            problems.append((path, f"must be a non-empty list (got {_describe(value)})"))
            return _INVALID
        items = [
            _convert(item, item_tp, meta, f"{path}[{i}]", problems) for i, item in enumerate(value)
        ]
        return _INVALID if any(item is _INVALID for item in items) else items
    if tp is bool:
        if not isinstance(value, bool):
            problems.append((path, f"must be true or false (got {_describe(value)})"))
            return _INVALID
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            message = _bound_message("integer", meta) if meta else "must be an integer"
            problems.append((path, f"{message} (got {_describe(value)})"))
            return _INVALID
        if not _in_bounds(value, meta):
            problems.append((path, f"{_bound_message('integer', meta)} (got {value})"))
            return _INVALID
        return value
    if tp is float:
        number = value
        # PyYAML follows YAML 1.1, which reads `lr: 3e-4` (no dot) as a string; accept it.
        if isinstance(value, str):
            try:
                number = float(value)
            except ValueError:
                number = value
        if isinstance(number, bool) or not isinstance(number, int | float):
            message = _bound_message("number", meta) if meta else "must be a number"
            problems.append((path, f"{message} (got {_describe(value)})"))
            return _INVALID
        number = float(number)
        if number != number or number in (float("inf"), float("-inf")):
            problems.append((path, f"must be a finite number (got {value!r})"))
            return _INVALID
        if not _in_bounds(number, meta):
            problems.append((path, f"{_bound_message('number', meta)} (got {value})"))
            return _INVALID
        return number
    if tp is str:
        if not isinstance(value, str) or not value:
            problems.append((path, f"must be a non-empty string (got {_describe(value)})"))
            return _INVALID
        return value
    raise TypeError(f"unsupported config field type {tp!r} at {path}")


def _build_section(cls: type, raw: Any, path: str, problems: list, *, label: str = "") -> Any:
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        problems.append((path, f"must be a mapping (got {_describe(raw)})"))
        return _INVALID
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    for key in raw:
        if key not in fields:
            allowed = ", ".join(sorted(fields))
            where = f" for {label}" if label else ""
            problems.append((f"{path}.{key}", f"unknown key{where} (allowed: {allowed})"))
    values = {}
    for name, f in fields.items():
        if name in raw:
            converted = _convert(raw[name], hints[name], f.metadata, f"{path}.{name}", problems)
            if converted is not _INVALID:
                values[name] = converted
    return cls(**values)


def _build_variant(
    variants: Mapping[str, type], default: str, raw: Any, path: str, problems: list
) -> Any:
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        problems.append((path, f"must be a mapping (got {_describe(raw)})"))
        return _INVALID
    name = raw.get("name", default)
    if name not in variants or not isinstance(name, str):
        allowed = ", ".join(repr(v) for v in variants)
        problems.append((f"{path}.name", f"must be one of {allowed} (got {_describe(name)})"))
        return _INVALID
    return _build_section(variants[name], raw, path, problems, label=f"{path} {name!r}")


def _check_combination(config: HarnessConfig, problems: list) -> None:
    model, data = config.model, config.data
    if model.name in IMAGE_MODELS and data.name in TOKEN_DATASETS - {"synthetic"}:
        problems.append(
            ("data.name", f"{data.name!r} is a token dataset; model {model.name!r} needs images")
        )
    if model.name in LANGUAGE_MODELS and data.name == "digits":
        problems.append(
            (
                "data.name",
                f"'digits' is an image dataset; model {model.name!r} needs 'text', 'tokens' or "
                "'synthetic'",
            )
        )
    if model.name == "gpt" and data.name == "tokens":
        problems.append(("data.name", "'tokens' needs model 'transformer'"))
    if isinstance(model, GptConfig) and model.width % model.heads:
        problems.append(
            ("model.width", f"must be divisible by model.heads ({model.width} % {model.heads})")
        )
    if isinstance(model, TransformerConfig):
        _check_transformer(model, data, problems)
    if config.train.warmup_steps >= config.train.steps > 1:
        problems.append(("train.warmup_steps", "must be smaller than train.steps"))
    _check_layout(config, problems)


def _check_transformer(model: TransformerConfig, data: Any, problems: list) -> None:
    shape = model.shape()
    for key, message in shape.problems():
        problems.append((f"model.{key}", message))
    seq_len = getattr(data, "seq_len", None)
    if seq_len is not None and seq_len > shape.seq_len:
        problems.append(
            ("data.seq_len", f"must be at most model.seq_len ({seq_len} > {shape.seq_len})")
        )
    vocab = 256 if data.name == "text" else getattr(data, "vocab_size", None)
    if data.name == "tokens" and not data.path:
        vocab = 256
    if vocab is not None and vocab > shape.vocab_size:
        problems.append(
            (
                "model.vocab_size",
                f"must cover the data's vocabulary ({shape.vocab_size} < {vocab} of {data.name!r})",
            )
        )


def _check_layout(config: HarnessConfig, problems: list) -> None:
    layout, model, train = config.layout, config.model, config.train
    if layout.parallel and not isinstance(model, TransformerConfig):
        field_name = next(
            key
            for key, plain in (("tp", 1), ("pp", 1), ("shard", "none"), ("recompute", "none"))
            if getattr(layout, key) != plain
        )
        problems.append(
            (f"layout.{field_name}", "needs model 'transformer' (other models run DDP only)")
        )
        return
    if not isinstance(model, TransformerConfig):
        return
    shape = model.shape()
    if layout.tp > 1:
        for key, value in (
            ("heads", shape.heads),
            ("kv_heads", shape.kv_heads),
            ("ffn_hidden", shape.ffn_hidden),
        ):
            if value % layout.tp:
                problems.append(
                    ("layout.tp", f"must divide model.{key} ({value} % {layout.tp} != 0)")
                )
    if layout.pp > 1:
        if shape.tie_embeddings:
            problems.append(
                (
                    "layout.pp",
                    "pipeline stages cannot share the tied input/output embedding; set "
                    "model.tie_embeddings to false",
                )
            )
        if layout.pp > shape.layers:
            problems.append(
                ("layout.pp", f"must be at most model.layers ({layout.pp} > {shape.layers})")
            )
        elif layout.pp_split is None and shape.layers % layout.pp:
            problems.append(
                (
                    "layout.pp",
                    f"must divide model.layers ({shape.layers} % {layout.pp} != 0), or give "
                    "layout.pp_split",
                )
            )
    if layout.pp_split is not None and (
        len(layout.pp_split) != layout.pp or sum(layout.pp_split) != shape.layers
    ):
        problems.append(
            (
                "layout.pp_split",
                f"must list layout.pp ({layout.pp}) stage sizes summing to model.layers "
                f"({shape.layers}) (got {layout.pp_split})",
            )
        )
    microbatches = layout.pp_microbatches or layout.pp
    if layout.pp > 1 and config.data.batch_size % microbatches:
        problems.append(
            (
                "layout.pp_microbatches",
                f"must divide the micro-batch ({config.data.batch_size} % {microbatches} != 0)",
            )
        )
    if layout.pp == 1 and layout.pp_microbatches not in (None, 1):
        problems.append(("layout.pp_microbatches", "needs layout.pp > 1"))
    distributed_layout = layout.tp > 1 or layout.pp > 1 or layout.shard != "none"
    if distributed_layout and train.precision == "fp16":
        problems.append(
            (
                "train.precision",
                "fp16 (loss scaling) runs with plain data parallelism only; use bf16 with "
                "layout tp, pp or shard",
            )
        )
    if layout.pp > 1 and train.eval_every:
        problems.append(("train.eval_every", "evaluation does not run with layout.pp > 1 yet"))
    if distributed_layout and train.compile:
        problems.append(("train.compile", "runs with plain data parallelism only"))


def _unify(
    raw_other: Mapping[str, Any],
    key: str,
    other_key: str,
    layout_value: int | None,
    other_value: int,
    problems: list,
) -> int:
    """One value for a setting both the layout and another section can name."""
    if layout_value is None:
        return other_value
    if other_key.split(".")[1] in raw_other and other_value != layout_value:
        problems.append(
            (f"layout.{key}", f"contradicts {other_key} ({layout_value} != {other_value})")
        )
    return layout_value


def _resolve_transformer(model: TransformerConfig, data: Any, problems: list) -> Any:
    """The model config with every shape key filled: from the preset, else from defaults."""
    if model.preset is not None:
        if model.preset not in PRESETS:
            known = ", ".join(repr(name) for name in PRESETS)
            problems.append(("model.preset", f"must be one of {known} (got {model.preset!r})"))
            return _INVALID
        base = PRESETS[model.preset].to_dict()
    else:
        missing = [key for key in ("layers", "hidden", "heads") if getattr(model, key) is None]
        for key in missing:
            problems.append((f"model.{key}", "is required without model.preset"))
        if missing:
            return _INVALID
        hidden, heads = model.hidden, model.heads
        base = {
            "kv_heads": heads,
            "ffn_hidden": default_ffn_hidden(hidden, 16 if hidden < 256 else 64),
            "vocab_size": 256,
            "seq_len": getattr(data, "seq_len", 1024),
            "positions": "rope",
            "tie_embeddings": False,
        }
    given = {key: getattr(model, key) for key in base if getattr(model, key, None) is not None}
    if model.preset is not None and "kv_heads" not in given and "heads" in given:
        given["kv_heads"] = given["heads"]
    return dataclasses.replace(model, **{**base, **given})


def load_config_dict(raw: Any) -> HarnessConfig:
    """Validate a parsed config mapping; raise ConfigError listing every problem found.

    The result is the effective config: a transformer's shape fully resolved, and the batch
    geometry the same in ``layout`` and in ``data``/``train``."""
    problems: list[tuple[str, str]] = []
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise ConfigError([("", f"the top level must be a mapping (got {_describe(raw)})")])
    sections = {"model", "data", "train", "checkpoint", "layout"}
    for key in raw:
        if key not in sections:
            problems.append((str(key), f"unknown key (allowed: {', '.join(sorted(sections))})"))
    model = _build_variant(MODEL_VARIANTS, "mnist_cnn", raw.get("model"), "model", problems)
    data = _build_variant(DATA_VARIANTS, "digits", raw.get("data"), "data", problems)
    train = _build_section(TrainConfig, raw.get("train"), "train", problems)
    checkpoint = _build_section(CheckpointConfig, raw.get("checkpoint"), "checkpoint", problems)
    layout = _build_section(LayoutConfig, raw.get("layout"), "layout", problems)
    if problems:
        raise ConfigError(problems)
    if isinstance(model, TransformerConfig):
        model = _resolve_transformer(model, data, problems)
    raw_layout = raw.get("layout") or {}
    micro_batch = _unify(
        raw.get("data") or {},
        "micro_batch",
        "data.batch_size",
        layout.micro_batch,
        data.batch_size,
        problems,
    )
    grad_accum = _unify(
        raw.get("train") or {},
        "grad_accum",
        "train.grad_accum",
        layout.grad_accum,
        train.grad_accum,
        problems,
    )
    if problems:
        raise ConfigError(problems)
    recompute = layout.recompute
    if isinstance(model, TransformerConfig) and train.activation_checkpointing:
        if "recompute" in raw_layout and recompute != "full":
            problems.append(
                ("layout.recompute", f"contradicts train.activation_checkpointing ({recompute!r})")
            )
        recompute = "full"
    config = HarnessConfig(
        model=model,
        data=dataclasses.replace(data, batch_size=micro_batch),
        train=dataclasses.replace(train, grad_accum=grad_accum),
        checkpoint=checkpoint,
        layout=dataclasses.replace(
            layout,
            micro_batch=micro_batch,
            grad_accum=grad_accum,
            recompute=recompute,
            pp_microbatches=layout.pp_microbatches or layout.pp,
        ),
    )
    _check_combination(config, problems)
    if problems:
        raise ConfigError(problems)
    return config


@dataclass(frozen=True)
class ResolvedLayout:
    """The layout of one job: every degree known."""

    dp: int
    tp: int
    pp: int

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp


def resolve_layout(
    layout: LayoutConfig, world_size: int, local_world_size: int | None = None
) -> ResolvedLayout:
    """The degrees for ``world_size`` processes (``local_world_size`` of them per node);
    ConfigError naming the field when the layout does not fit the job that was started."""
    problems: list[tuple[str, str]] = []
    model_parallel = layout.tp * layout.pp
    if layout.dp is None:
        if world_size % model_parallel:
            problems.append(
                (
                    "layout.tp" if layout.tp > 1 else "layout.pp",
                    f"tp x pp = {model_parallel} does not divide the {world_size} processes "
                    "started",
                )
            )
        dp = max(world_size // model_parallel, 1)
    else:
        dp = layout.dp
        if dp * model_parallel != world_size:
            problems.append(
                (
                    "layout.dp",
                    f"dp x tp x pp = {dp} x {layout.tp} x {layout.pp} = {dp * model_parallel} "
                    f"does not match the {world_size} processes started",
                )
            )
    if local_world_size and layout.tp > 1 and local_world_size % layout.tp:
        problems.append(
            (
                "layout.tp",
                f"tensor parallelism stays inside a node: must divide the {local_world_size} "
                "processes per node",
            )
        )
    if problems:
        raise ConfigError(problems)
    return ResolvedLayout(dp=dp, tp=layout.tp, pp=layout.pp)


def read_config_file(path: str | os.PathLike[str]) -> Any:
    """Parse a JSON (``.json``) or YAML file into plain Python data; ConfigError if unreadable."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError([("", f"cannot read {path}: {exc.strerror or exc}")]) from exc
    try:
        if path.suffix.lower() == ".json":
            return json.loads(text)
        return yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        kind = "JSON" if path.suffix.lower() == ".json" else "YAML"
        detail = " ".join(str(exc).split())
        raise ConfigError([("", f"{path} is not valid {kind}: {detail}")]) from exc


def apply_overrides(raw: Any, overrides: Iterable[str]) -> Any:
    """Apply ``section.key=value`` overrides (value parsed as a YAML scalar) to a raw config."""
    result: dict[str, Any] = _deep_copy_mapping(raw) if isinstance(raw, Mapping) else {}
    if raw is not None and not isinstance(raw, Mapping):
        raise ConfigError([("", f"the top level must be a mapping (got {_describe(raw)})")])
    for override in overrides:
        key, sep, text = override.partition("=")
        if not sep or not key:
            raise ConfigError([("", f"--set expects KEY=VALUE (got {override!r})")])
        try:
            value = yaml.safe_load(text) if text else ""
        except yaml.YAMLError as exc:
            raise ConfigError([(key, f"cannot parse override value {text!r}")]) from exc
        parts = key.split(".")
        node = result
        for depth, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError([(".".join(parts[: depth + 1]), "is not a mapping")])
            node = child
        node[parts[-1]] = value
    return result


def _deep_copy_mapping(raw: Mapping[str, Any]) -> dict[str, Any]:
    return {
        key: _deep_copy_mapping(value) if isinstance(value, Mapping) else value
        for key, value in raw.items()
    }


def load_config(path: str | os.PathLike[str], overrides: Iterable[str] = ()) -> HarnessConfig:
    """Read, override and validate a config file."""
    return load_config_dict(apply_overrides(read_config_file(path), overrides))
