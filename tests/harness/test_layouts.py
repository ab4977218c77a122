"""Every layout trains the transformer to the same losses as one process; presets and the
layout config section."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from harness.config import ConfigError, load_config_dict, resolve_layout
from harness.presets import PRESETS, TransformerShape, param_count, preset
from tests.harness.helpers import REPO_ROOT, HarnessProcess, losses, of_kind

pytestmark = pytest.mark.timeout(300)

STEPS = 5
GLOBAL_BATCH = 8

# The tiny preset, dropout off, fp32, clipping that engages (grad norms are ~1 here), so that
# the global gradient norm over shards and stages is checked too.
BASE_CONFIG: dict[str, Any] = {
    "model": {"name": "transformer", "preset": "tiny"},
    "data": {"name": "text", "seq_len": 16},
    "train": {
        "steps": STEPS,
        "lr": 3e-3,
        "grad_clip": 0.5,
        "log_every": 1,
        "device": "cpu",
        "precision": "fp32",
        "seed": 3,
    },
    "checkpoint": {"enabled": False},
}

# name: (processes, layout); micro_batch x grad_accum x dp is GLOBAL_BATCH in every case.
LAYOUTS: dict[str, tuple[int, dict[str, Any]]] = {
    "ddp2-accum2": (2, {"micro_batch": 2, "grad_accum": 2}),
    "zero2-accum2": (2, {"shard": "zero2", "micro_batch": 2, "grad_accum": 2}),
    "zero3": (2, {"shard": "zero3", "micro_batch": 4, "grad_accum": 1}),
    "tp2-accum2-selective": (
        2,
        {"tp": 2, "micro_batch": 4, "grad_accum": 2, "recompute": "selective"},
    ),
    "pp2-1f1b": (2, {"pp": 2, "micro_batch": 8, "grad_accum": 1, "pp_microbatches": 4}),
    "pp2-gpipe-accum2": (
        2,
        {"pp": 2, "micro_batch": 4, "grad_accum": 2, "pp_schedule": "gpipe"},
    ),
    "dp2xtp2-zero3": (4, {"tp": 2, "shard": "zero3", "micro_batch": 2, "grad_accum": 2}),
    "pp2xdp2-accum2": (4, {"pp": 2, "micro_batch": 2, "grad_accum": 2, "recompute": "full"}),
}


def _run(tmp: Path, nproc: int, layout: dict[str, Any]) -> list[dict[str, Any]]:
    config = {**BASE_CONFIG, "layout": layout}
    path = tmp / f"config-{nproc}-{abs(hash(json.dumps(layout, sort_keys=True)))}.json"
    path.write_text(json.dumps(config))
    process = HarnessProcess(["--config", str(path), "--nproc", str(nproc)], tmp)
    try:
        code = process.finish(timeout=240)
    finally:
        process.kill()
    assert code == 0, process.stderr()
    return process.events


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> list[dict[str, Any]]:
    """The reference: one process, the whole global batch in one micro-batch."""
    return _run(tmp_path_factory.mktemp("single"), 1, {"micro_batch": GLOBAL_BATCH})


@pytest.mark.parametrize(("nproc", "layout"), LAYOUTS.values(), ids=LAYOUTS)
def test_every_layout_follows_the_single_process_loss_curve(tmp_path, single, nproc, layout):
    # given the tiny transformer trained by one process, and by `nproc` ranks in a layout
    events = _run(tmp_path, nproc, layout)
    start = events[0]
    # then the run used the layout asked for, with the same global batch
    used = start["layout"]
    assert {key: used[key] for key in layout} == layout
    assert used["dp"] * used["tp"] * used["pp"] == nproc == start["world_size"]
    assert start["global_batch_size"] == single[0]["global_batch_size"] == GLOBAL_BATCH
    assert start["params"] == PRESETS["tiny"].param_count()
    # and the per-step losses and gradient norms match. They are not bit-identical: a sharded
    # or split computation sums the same fp32 products in another order (a row-wise
    # all-reduce, a reduce-scatter, per-shard norms, per-micro-batch gradients). Such
    # rounding differences (~1e-7 relative) grow through Adam over the steps; the largest loss
    # difference measured over these layouts was 9.5e-7 (absolute, on losses of ~5; 2 ulps). A real
    # fault (a missing reduction, a wrong divisor, a misplaced shard) shows at 1e-2 and above
    # from the first or second step.
    step_events = of_kind(events, "step")
    assert [e["step"] for e in step_events] == list(range(1, STEPS + 1))
    assert losses(events) == pytest.approx(losses(single), rel=1e-4, abs=1e-5)
    norms = [e["grad_norm"] for e in step_events]
    assert norms == pytest.approx([e["grad_norm"] for e in of_kind(single, "step")], rel=1e-4)
    # and the transformer's throughput figures are reported
    assert all(e["tokens_per_s"] > 0 and e["peak_mem_bytes"] > 0 for e in step_events)
    assert start["flops_per_sample"] == PRESETS["tiny"].train_flops_per_token(16) * 16


def test_recompute_modes_give_the_same_losses(run_trainer):
    # given the same run without recomputation, recomputing attention, recomputing each block
    curves = {
        mode: losses(run_trainer({**BASE_CONFIG, "layout": {"recompute": mode, "micro_batch": 4}}))
        for mode in ("none", "selective", "full")
    }
    # then recomputation replays the same fp32 operations: the losses are identical
    assert curves["selective"] == curves["none"]
    assert curves["full"] == curves["none"]


# --- presets ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["tiny", "gpt2-124m", "gpt2-350m", "llama2-7b"])
def test_preset_parameter_count_is_the_built_models(name):
    import torch

    from harness.transformer import build_transformer

    model = build_transformer(preset(name))
    assert next(model.parameters()).device == torch.device("meta")
    assert sum(p.numel() for p in model.parameters()) == param_count(name)


def test_llama_presets_have_the_published_sizes():
    assert param_count("llama2-7b") == 6_738_415_616
    assert param_count("llama2-13b") == 13_015_864_320
    assert param_count("llama2-70b") == 68_976_648_192
    assert round(param_count("gpt2-124m") / 1e6) == 124


def test_presets_module_imports_only_the_standard_library():
    code = (
        "import sys; import harness.presets; "
        "print(sorted(m for m in ('torch', 'numpy', 'yaml', 'django') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"


def test_preset_shapes_are_consistent():
    for name, shape in PRESETS.items():
        assert shape.problems() == [], name
    broken = TransformerShape(
        layers=2, hidden=30, heads=4, kv_heads=3, ffn_hidden=8, vocab_size=8, seq_len=8
    )
    assert [key for key, _ in broken.problems()] == ["hidden", "kv_heads"]


# --- the layout config section --------------------------------------------------------------


def transformer(layout: dict[str, Any], **model: Any) -> dict[str, Any]:
    return {
        "model": {"name": "transformer", "preset": "tiny", **model},
        "data": {"name": "text", "seq_len": 16, "batch_size": 8},
        "layout": layout,
    }


def problems_of(raw: dict[str, Any]) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config_dict(raw)
    return info.value.lines()


def test_a_preset_resolves_to_its_whole_shape_and_keys_override_it():
    config = load_config_dict(transformer({}, layers=2))
    assert config.model.shape() == PRESETS["tiny"].replace(layers=2)
    assert config.to_dict()["model"]["hidden"] == 32  # the effective config names every key


def test_the_layout_fills_the_batch_geometry_both_ways():
    config = load_config_dict(
        {**transformer({"micro_batch": 2, "grad_accum": 4}), "data": {"name": "text"}}
    )
    assert (config.data.batch_size, config.train.grad_accum) == (2, 4)
    config = load_config_dict(transformer({}))
    assert (config.layout.micro_batch, config.layout.grad_accum) == (8, 1)


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (
            transformer({"tp": 3}),
            "config error: layout.tp: must divide model.heads (4 % 3 != 0)",
        ),
        (
            transformer({"pp": 3}),
            "config error: layout.pp: must divide model.layers (4 % 3 != 0), or give "
            "layout.pp_split",
        ),
        (
            transformer({"pp": 2, "pp_split": [1, 2]}),
            "config error: layout.pp_split: must list layout.pp (2) stage sizes summing to "
            "model.layers (4) (got [1, 2])",
        ),
        (
            transformer({"shard": "zero1"}),
            "config error: layout.shard: must be one of 'none', 'zero2', 'zero3' "
            "(got string 'zero1')",
        ),
        (
            transformer({"recompute": "some"}),
            "config error: layout.recompute: must be one of 'none', 'selective', 'full' "
            "(got string 'some')",
        ),
        (
            transformer({"micro_batch": 4}),
            "config error: layout.micro_batch: contradicts data.batch_size (4 != 8)",
        ),
        (
            transformer({"pp": 2, "pp_microbatches": 3}),
            "config error: layout.pp_microbatches: must divide the micro-batch (8 % 3 != 0)",
        ),
        (
            transformer({"pp": 2}, tie_embeddings=True),
            "config error: layout.pp: pipeline stages cannot share the tied input/output "
            "embedding; set model.tie_embeddings to false",
        ),
        (
            transformer({"tp": 0}),
            "config error: layout.tp: must be a positive integer (got 0)",
        ),
        (
            {"model": {"name": "gpt"}, "data": {"name": "text"}, "layout": {"shard": "zero3"}},
            "config error: layout.shard: needs model 'transformer' (other models run DDP only)",
        ),
        (
            transformer({}, preset="llama9"),
            "config error: model.preset: must be one of "
            + ", ".join(repr(name) for name in PRESETS)
            + " (got 'llama9')",
        ),
        (
            {"model": {"name": "transformer", "hidden": 32}, "data": {"name": "text"}},
            "config error: model.layers: is required without model.preset",
        ),
    ],
)
def test_layout_errors_name_the_field(raw, expected):
    assert expected in problems_of(raw)


def test_a_layout_that_does_not_fit_the_processes_names_the_field():
    layout = load_config_dict(transformer({"tp": 2, "dp": 2})).layout
    assert resolve_layout(layout, 4).dp == 2
    with pytest.raises(ConfigError) as info:
        resolve_layout(layout, 2)
    assert info.value.lines() == [
        "config error: layout.dp: dp x tp x pp = 2 x 2 x 1 = 4 does not match the 2 processes "
        "started"
    ]
    derived = load_config_dict(transformer({"tp": 2, "pp": 2})).layout
    assert resolve_layout(derived, 8).dp == 2
    with pytest.raises(ConfigError, match=r"layout\.tp: tp x pp = 4 does not divide the 6"):
        resolve_layout(derived, 6)
    with pytest.raises(ConfigError, match=r"layout\.tp: tensor parallelism stays inside a node"):
        resolve_layout(load_config_dict(transformer({"tp": 2})).layout, 4, 3)


def test_the_cli_refuses_a_layout_for_another_world_size(run_harness, write_config, clean_env):
    config = write_config({**transformer({"tp": 2, "dp": 2}), "train": {"device": "cpu"}})
    # given --nproc 2 for a layout of 4 processes: refused before any rank starts
    code, events, stderr = run_harness(["--config", str(config), "--nproc", "2"])
    assert code == 2 and events == []
    assert "config error: layout.dp: dp x tp x pp = 2 x 2 x 1 = 4" in stderr
    # and a rank started by torchrun with a world the layout does not fit exits 2 as well
    env = {**clean_env, "WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}
    code, events, stderr = run_harness(["--config", str(config)], env=env)
    assert code == 2 and events == []
    assert "config error: layout.dp:" in stderr
