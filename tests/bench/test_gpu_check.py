"""bench/gpu_check.py runs once on a lent GPU, with no second try: what it does without a GPU is
checked here so that it cannot rot. Its cards must be the catalog's, every layout it measures must
be the harness config the advisor plans for that layout, and its CPU rehearsal must measure a
layout beside its estimate and train one job over two launchers."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from harness.config import load_config_dict, resolve_layout
from marketplace.models import GpuModel
from marketplace.selectors import catalog_card
from tests.harness.helpers import REPO_ROOT as ROOT
from tests.harness.helpers import harness_env

_spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "bench" / "gpu_check.py")
assert _spec is not None and _spec.loader is not None
gpu_check = importlib.util.module_from_spec(_spec)
sys.modules["gpu_check"] = gpu_check  # its dataclasses look their module up
_spec.loader.exec_module(gpu_check)

CASES = (*gpu_check.ONE_GPU_CASES, *gpu_check.TWO_GPU_CASES)


def _rehearse(*args: str, timeout: float) -> tuple[int, dict]:
    process = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--cpu-rehearsal", *args],
        cwd=ROOT,
        env=harness_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    lines = [line for line in process.stdout.splitlines() if line.strip()]
    assert lines, process.stderr[-3000:]
    return process.returncode, json.loads(lines[-1])


@pytest.mark.django_db
def test_the_scripts_cards_are_the_catalogs():
    # given the catalog as the migrations load it
    catalog = {model.slug: catalog_card(model) for model in GpuModel.objects.all()}
    # then every card the script plans for is the catalog's row, as the advisor takes it
    assert gpu_check.CARDS
    for slug, card in gpu_check.CARDS.items():
        assert card == catalog[slug], slug
    # and every device name it recognises leads to one of them
    named = {slug for _, slug in gpu_check.DEVICE_CARDS if slug is not None}
    assert named <= set(gpu_check.CARDS)


@pytest.mark.parametrize(
    ("device_name", "slug"),
    [
        ("NVIDIA H100 80GB HBM3", "h100-sxm5-80gb"),
        ("NVIDIA H100 PCIe", "h100-pcie-80gb"),
        ("NVIDIA H100 NVL", None),
        ("NVIDIA H200", "h200-sxm-141gb"),
        ("NVIDIA H200 NVL", None),
        ("NVIDIA A100-SXM4-80GB", "a100-sxm4-80gb"),
        ("NVIDIA A100-SXM4-40GB", "a100-sxm4-40gb"),
        ("NVIDIA A100 80GB PCIe", "a100-pcie-80gb"),
        ("NVIDIA A100-PCIE-40GB", "a100-pcie-40gb"),
        ("NVIDIA L40S", "l40s-48gb"),
        ("Tesla T4", "t4-16gb"),
        ("Tesla V100-SXM2-32GB", "v100-sxm2-32gb"),
        ("NVIDIA GeForce RTX 4090", "rtx4090-24gb"),
        ("NVIDIA A10G", None),
    ],
)
def test_device_names_lead_to_catalog_cards(device_name, slug):
    assert gpu_check.card_slug(device_name) == slug


def test_an_unlisted_card_is_planned_from_the_device_and_its_datasheet_peak():
    card, source = gpu_check.device_card("NVIDIA H100 NVL", 94 * 10**9, 835.0)
    assert (card.memory_gb, card.tensor_tflops, card.nvlink_gbs) == (94.0, 835.0, 0.0)
    assert "not in the catalog" in source
    # and without a known peak there is nothing to estimate with
    assert gpu_check.device_card("NVIDIA A10G", 24 * 10**9, None)[0] is None


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_each_layout_runs_the_advisors_harness_config_for_it(case):
    # given a layout of the 1B decoder on H100s, planned for 16 steps
    card = gpu_check.CARDS["h100-sxm5-80gb"]
    planned = gpu_check.plan_layout(
        case, gpu_check.ONE_B, card, precision=gpu_check.Precision.BF16, steps=16, device="cuda"
    )
    # then the harness takes its config on that many GPUs as it is
    assert planned.problems == []
    config = load_config_dict(planned.config)
    resolved = resolve_layout(config.layout, case.gpus, case.gpus)
    assert (resolved.dp, resolved.tp, resolved.pp) == (
        case.layout.dp,
        case.layout.tp,
        case.layout.pp,
    )
    assert config.layout.recompute == str(case.layout.checkpointing)
    assert config.model.shape() == gpu_check.ONE_B and config.train.steps == 16
    # and the estimate is for that layout, the same GPUs and the same batch of the same model
    found = planned.estimate
    assert found.layout == case.layout and found.gpus == case.gpus
    global_batch = resolved.dp * config.layout.micro_batch * config.layout.grad_accum
    assert global_batch == gpu_check.LAYOUT_GLOBAL_BATCH
    assert found.step.tokens == global_batch * gpu_check.ONE_B.seq_len


def test_a_run_out_of_memory_is_set_beside_the_advisors_memory_verdict():
    card = gpu_check.CARDS["h100-sxm5-80gb"]
    planned = gpu_check.plan_layout(
        gpu_check.ONE_GPU_CASES[0],
        gpu_check.ONE_B,
        card,
        precision=gpu_check.Precision.BF16,
        steps=16,
        device="cuda",
    )
    fits = planned.estimate.fits
    # when the harness ran out of memory, the verdicts agree only if the advisor said no fit
    row = gpu_check.compare(planned, None, "does not fit")
    assert row["fits_measured"] is False and row["memory_verdicts_agree"] is (not fits)
    # and a run that could not be measured for another reason gives no verdict
    assert "memory_verdicts_agree" not in gpu_check.compare(planned, None, "failed (exit 1)")


def test_a_part_that_would_not_end_within_the_budget_is_skipped_and_said_so():
    code, result = _rehearse("--only", "layouts", "--budget-s", "1", timeout=120)
    assert code == 1 and result["ok"] is False
    assert result["layouts"] and all(
        row["status"].startswith("skipped: time budget") for row in result["layouts"]
    )


@pytest.mark.timeout(400)
def test_the_rehearsal_measures_a_layout_beside_its_estimate_and_trains_one_job_on_two_nodes():
    # given the rehearsal of the new parts on CPU: a pipeline over 2 gloo ranks, and the gang
    code, result = _rehearse("--only", "layouts,gang", "--layouts", "pp2", timeout=360)
    # then every check passed
    assert code == 0 and result["ok"] is True, result
    (row,) = result["layouts"]
    # the layout trained, and its measurement stands beside the advisor's estimate
    assert row["status"] == "ok" and row["harness_layout"]["pp_microbatches"] == 2
    assert row["measured"]["step_s"] > 0 and row["estimated"]["step_s"] > 0
    assert row["ratio_measured_to_estimated"]["step_s"] == pytest.approx(
        row["measured"]["step_s"] / row["estimated"]["step_s"]
    )
    # and two launchers as two nodes trained one job with one launcher's losses
    gang = result["gang"]
    assert gang["world_size"] == 2 and gang["loss_max_rel_diff"] == 0.0
    assert gang["losses_gang"] == gang["losses_one_launcher"] != []
