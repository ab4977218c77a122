"""Config validation: every bad key is named, and the CLI exits 2 before loading PyTorch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from harness.config import (
    CONFIG_ERROR_EXIT_CODE,
    ConfigError,
    GptConfig,
    SyntheticDataConfig,
    apply_overrides,
    load_config_dict,
)

pytestmark = pytest.mark.timeout(60)

REPO_ROOT = Path(__file__).resolve().parents[2]


def problems_of(raw: object) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config_dict(raw)
    return info.value.lines()


def test_empty_config_gives_the_documented_defaults(monkeypatch):
    # given no checkpoint directory in the environment
    monkeypatch.delenv("HARNESS_CHECKPOINT_DIR", raising=False)
    # when an empty config is loaded
    config = load_config_dict({})
    # then every section has its defaults
    assert config.model.name == "mnist_cnn"
    assert config.data.name == "digits"
    assert config.train.precision == "auto"
    assert config.checkpoint.dir == "./checkpoints"


def test_checkpoint_dir_defaults_to_the_environment(monkeypatch):
    monkeypatch.setenv("HARNESS_CHECKPOINT_DIR", "/volume/ckpt")
    assert load_config_dict({}).checkpoint.dir == "/volume/ckpt"


def test_variant_sections_build_their_own_dataclass():
    config = load_config_dict(
        {
            "model": {"name": "gpt", "layers": 2, "width": 32, "heads": 4},
            "data": {"name": "synthetic", "seq_len": 16, "batch_size": 4},
            "train": {"lr": "3e-4"},
        }
    )
    assert config.model == GptConfig(layers=2, width=32, heads=4)
    assert isinstance(config.data, SyntheticDataConfig)
    # YAML 1.1 reads 3e-4 as a string; a number-shaped string is accepted for float keys.
    assert config.train.lr == pytest.approx(3e-4)


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ({"trian": {}}, "config error: trian: unknown key"),
        ({"train": {"lr": -1}}, "config error: train.lr: must be a positive number (got -1)"),
        ({"train": {"lr": "fast"}}, "config error: train.lr: must be a positive number"),
        ({"train": {"steps": 1.5}}, "config error: train.steps: must be a positive integer"),
        ({"train": {"steps": True}}, "config error: train.steps: must be a positive integer"),
        ({"train": {"compile": "yes"}}, "config error: train.compile: must be true or false"),
        ({"train": {"precision": "fp8"}}, "config error: train.precision: must be one of"),
        ({"train": {"lr_schedule": "linear"}}, "config error: train.lr_schedule: must be one of"),
        ({"train": {"min_lr_ratio": 2}}, "config error: train.min_lr_ratio: must be a number"),
        ({"train": []}, "config error: train: must be a mapping (got a list)"),
        ({"model": {"name": "vit"}}, "config error: model.name: must be one of"),
        ({"model": {"layers": 2}}, "config error: model.layers: unknown key for model 'mnist_cnn'"),
        ({"model": {"name": "resnet", "widths": []}}, "config error: model.widths: must be a"),
        ({"model": {"name": "resnet", "widths": [8, 2]}}, "config error: model.widths[1]:"),
        ({"data": {"name": "digits", "seq_len": 8}}, "config error: data.seq_len: unknown key"),
        ({"data": {"batch_size": 0}}, "config error: data.batch_size: must be a positive"),
        ({"checkpoint": {"keep": 0}}, "config error: checkpoint.keep: must be a positive"),
        ({"checkpoint": {"dir": ""}}, "config error: checkpoint.dir: must be a non-empty string"),
        (
            {"model": {"name": "gpt"}, "data": {"name": "digits"}},
            "config error: data.name: 'digits' is an image dataset",
        ),
        (
            {"model": {"name": "gpt", "width": 30, "heads": 4}, "data": {"name": "text"}},
            "config error: model.width: must be divisible by model.heads",
        ),
        (["train"], "config error: the top level must be a mapping"),
    ],
)
def test_each_bad_key_is_named(raw, expected):
    problems = problems_of(raw)
    assert any(line.startswith(expected) for line in problems), problems


def test_all_problems_are_reported_at_once():
    problems = problems_of({"train": {"lr": 0, "seed": -1}, "extra": 1})
    assert [line.split(":")[1].strip() for line in problems] == ["extra", "train.lr", "train.seed"]


def test_overrides_parse_yaml_scalars_and_create_sections():
    raw = apply_overrides({"train": {"steps": 5}}, ["train.lr=1e-2", "checkpoint.keep=2"])
    assert raw == {"train": {"steps": 5, "lr": "1e-2"}, "checkpoint": {"keep": 2}}
    assert load_config_dict(raw).train.lr == pytest.approx(0.01)


def test_override_through_a_scalar_is_an_error():
    with pytest.raises(ConfigError, match=r"train\.steps: is not a mapping"):
        apply_overrides({"train": {"steps": 5}}, ["train.steps.x=1"])


def _cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    # Also checks that a config failure happens before torch is imported (fast, and usable on a
    # machine without PyTorch).
    code = (
        "import sys\n"
        "from harness.__main__ import main\n"
        f"status = main({list(args)!r})\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "sys.exit(status)\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


@pytest.mark.parametrize(
    ("name", "content", "expected"),
    [
        ("unknown.json", '{"train": {"stpes": 10}}', "config error: train.stpes: unknown key"),
        (
            "wrong_type.json",
            '{"train": {"lr": "fast"}}',
            "config error: train.lr: must be a positive number (got string 'fast')",
        ),
        (
            "bad_enum.yaml",
            "train:\n  precision: fp64\n",
            "config error: train.precision: must be one of 'fp32', 'fp16', 'bf16', 'auto'",
        ),
        (
            "nested.yml",
            "model:\n  name: gpt\n  layers: many\ndata:\n  name: text\n",
            "config error: model.layers: must be a positive integer (got string 'many')",
        ),
        ("broken.yaml", "train: [unclosed\n", "is not valid YAML"),
        ("broken.json", '{"train": ', "is not valid JSON"),
    ],
)
def test_cli_exits_2_naming_the_bad_key(tmp_path, clean_env, name, content, expected):
    # given a malformed config file
    path = tmp_path / name
    path.write_text(content)
    # when the harness is started with it
    result = _cli("--config", str(path), env=clean_env)
    # then it exits 2 with the problem on stderr and prints no metrics
    assert result.returncode == CONFIG_ERROR_EXIT_CODE, result.stderr
    assert expected in result.stderr
    assert result.stdout == ""


def test_cli_reports_a_missing_file_and_a_bad_override(tmp_path, clean_env):
    missing = _cli("--config", str(tmp_path / "nope.yaml"), env=clean_env)
    assert missing.returncode == CONFIG_ERROR_EXIT_CODE
    assert "config error: cannot read" in missing.stderr

    path = tmp_path / "ok.yaml"
    path.write_text("train:\n  steps: 3\n")
    override = _cli("--config", str(path), "--set", "train.grad_accum=0", env=clean_env)
    assert override.returncode == CONFIG_ERROR_EXIT_CODE
    assert "config error: train.grad_accum: must be a positive integer (got 0)" in override.stderr


def test_cli_requires_a_config(clean_env):
    result = _cli(env=clean_env)
    assert result.returncode == CONFIG_ERROR_EXIT_CODE
    assert "config error: --config FILE or --config-env NAME is required" in result.stderr


def test_cli_validates_a_config_passed_in_the_environment(clean_env):
    # given the config as JSON in an environment variable (how the node agent passes it)
    env = {**clean_env, "RENTAL_CONFIG": '{"data": {"name": "digits", "batch_size": -4}}'}
    result = _cli("--config-env", "RENTAL_CONFIG", env=env)
    assert result.returncode == CONFIG_ERROR_EXIT_CODE
    assert "config error: data.batch_size: must be a positive integer (got -4)" in result.stderr

    env["RENTAL_CONFIG"] = "{not json"
    result = _cli("--config-env", "RENTAL_CONFIG", env=env)
    assert result.returncode == CONFIG_ERROR_EXIT_CODE
    assert "config error: RENTAL_CONFIG is not valid JSON" in result.stderr

    result = _cli("--config-env", "UNSET_VARIABLE", env=clean_env)
    assert "config error: environment variable UNSET_VARIABLE is not set" in result.stderr


# GPT-2 1.5B in bf16 with AdamW keeps 16 bytes of states per parameter: about 25 GB per GPU under
# plain data parallelism (28 GB with the activations of one 1024-token sequence), more than a
# 24 GB card; ZeRO-3 over 4 ranks with full recomputation fits.
TOO_BIG = {
    "model": {"name": "transformer", "preset": "gpt2-1.5b"},
    "data": {"name": "text", "seq_len": 1024, "batch_size": 1},
    "train": {"steps": 10, "precision": "bf16", "device": "cpu"},
}


def test_cli_refuses_a_config_that_cannot_fit_the_gpus_it_got(tmp_path, clean_env):
    import json

    path = tmp_path / "big.json"
    path.write_text(json.dumps(TOO_BIG))
    env = {**clean_env, "HARNESS_GPU_MEMORY_GB": "24", "GPUMARKET_WORKSPACE": str(tmp_path)}
    result = _cli("--config", str(path), env=env)
    assert result.returncode == CONFIG_ERROR_EXIT_CODE, result.stderr
    assert "config error: layout: needs about 27.9 GB per GPU" in result.stderr
    assert "the GPUs have 24 GB (21.6 usable)" in result.stderr
    assert result.stdout == ""


@pytest.mark.parametrize("given", [None, "", "junk", "0", "-24", "nan"])
def test_without_a_usable_memory_figure_the_harness_does_not_guess(monkeypatch, given):
    from harness.__main__ import _check_fits

    monkeypatch.delenv("HARNESS_GPU_MEMORY_GB", raising=False)
    if given is not None:
        monkeypatch.setenv("HARNESS_GPU_MEMORY_GB", given)
    _check_fits(load_config_dict(TOO_BIG), dp=1)  # no ConfigError
    monkeypatch.setenv("HARNESS_GPU_MEMORY_GB", "24")
    with pytest.raises(ConfigError):
        _check_fits(load_config_dict(TOO_BIG), dp=1)


def test_the_fit_follows_the_layout_and_the_ranks():
    from harness.memory import fit_problem

    config = load_config_dict(TOO_BIG)
    assert fit_problem(config, dp=1, device="cpu", gpu_memory_gb=24) is not None
    sharded = load_config_dict({**TOO_BIG, "layout": {"shard": "zero3", "recompute": "full"}})
    assert fit_problem(sharded, dp=4, device="cpu", gpu_memory_gb=24) is None
    assert fit_problem(sharded, dp=4, device="cpu", gpu_memory_gb=4) is not None
    # A model the memory model does not cover is never refused by it.
    cnn = load_config_dict({"model": {"name": "mnist_cnn"}})
    assert fit_problem(cnn, dp=1, device="cpu", gpu_memory_gb=0.001) is None
