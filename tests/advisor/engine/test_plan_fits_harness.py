"""One memory model for the advisor and the harness: the memory the advisor plans for a run is
the memory the harness computes for the config it is booked as, so a plan that fits is a
config the harness starts, and one that does not is refused by both."""

import pytest

from advisor.engine.compute import Card
from advisor.engine.layouts import Run, default_topology, estimate
from advisor.engine.memory import Checkpointing, Layout, Precision
from advisor.engine.presets import PRESETS
from advisor.engine.runs import harness_config
from harness.config import load_config_dict
from harness.memory import fit_problem, harness_memory_gb

H100 = Card(slug="h100-sxm5-80gb", memory_gb=80, tensor_tflops=989, fp32_tflops=67, nvlink_gbs=900)
RTX4090 = Card(slug="rtx4090-24gb", memory_gb=24, tensor_tflops=165, fp32_tflops=82.6)


def _booked(found, shape) -> dict:
    return harness_config(
        shape=shape,
        layout=found.layout,
        precision=found.precision,
        micro_batches=found.step.micro_batches,
        tokens=1e9,
    )


@pytest.mark.parametrize(
    ("model", "card", "gpus", "fixed"),
    [
        ("gpt2-124m", RTX4090, 2, None),
        ("gpt2-350m", RTX4090, 4, Layout(dp=4, zero_stage=3, micro_batch=4)),
        ("gpt2-774m", H100, 8, Layout(dp=4, tp=2, micro_batch=2)),
        ("llama2-7b", H100, 8, None),
        ("llama2-13b", H100, 16, Layout(dp=2, tp=4, pp=2, micro_batch=1,
                                        checkpointing=Checkpointing.SELECTIVE)),
        ("llama2-70b", H100, 64, None),
    ],
)  # fmt: skip
def test_the_harness_computes_the_memory_the_advisor_planned(model, card, gpus, fixed):
    shape = PRESETS[model]
    found = estimate(
        Run(shape=shape, tokens=1e9, precision=Precision.BF16),
        card,
        default_topology(card, gpus),
        fixed=fixed,
    )
    assert found is not None and found.fits, model
    config = load_config_dict(_booked(found, shape))
    need = harness_memory_gb(config, dp=found.layout.dp, device="cuda")
    assert need["total"] == pytest.approx(found.memory.total / 1e9, rel=1e-6)
    assert (
        fit_problem(config, dp=found.layout.dp, device="cuda", gpu_memory_gb=card.memory_gb) is None
    )


def test_a_layout_the_advisor_finds_too_big_is_refused_by_the_harness_naming_the_fix():
    shape = PRESETS["llama2-7b"]
    too_big = Layout(dp=8, zero_stage=0, micro_batch=1, checkpointing=Checkpointing.FULL)
    found = estimate(
        Run(shape=shape, tokens=1e9, precision=Precision.BF16),
        H100,
        default_topology(H100, 8),
        fixed=too_big,
    )
    assert found is not None and not found.fits
    config = load_config_dict(_booked(found, shape))
    field, reason = fit_problem(config, dp=8, device="cuda", gpu_memory_gb=80)
    assert field == "layout"
    assert f"needs about {found.memory.total / 1e9:.1f} GB per GPU" in reason
    assert "80 GB" in reason and "zero3" in reason
