from decimal import Decimal

import pytest

from marketplace.models import GpuModel

pytestmark = pytest.mark.django_db


def test_catalog_has_every_card_of_the_spec_sheet():
    assert GpuModel.objects.count() == 18
    assert set(GpuModel.objects.values_list("family", flat=True)) == {
        "v100", "a100", "h100", "h200", "l40s", "a10", "t4",
        "rtx3090", "rtx3080ti", "rtx4090", "rtxa6000",
    }  # fmt: skip


def test_catalog_figures_are_the_published_ones():
    h100 = GpuModel.objects.get(slug="h100-sxm5-80gb")
    assert (h100.tensor_tflops, h100.fp32_tflops, h100.memory_gb) == (
        Decimal("989.00"),
        Decimal("67.00"),
        80,
    )
    assert (h100.memory_bandwidth_gbs, h100.nvlink_gbs, h100.tdp_w, h100.bf16) == (
        3350,
        Decimal("900.0"),
        700,
        True,
    )
    v100 = GpuModel.objects.get(slug="v100-sxm2-32gb")
    assert (v100.memory_bandwidth_gbs, v100.bf16, v100.tensor_tflops) == (
        900,
        False,
        Decimal("125"),
    )


def test_geforce_cards_carry_the_fp32_accumulate_tensor_rate():
    rtx4090 = GpuModel.objects.get(slug="rtx4090-24gb")
    assert rtx4090.tensor_tflops == Decimal("165.20")
    assert rtx4090.tensor_tflops_fp16_acc == Decimal("330.00")
    assert GpuModel.objects.get(slug="rtx3090-24gb").figures_checked is False


def test_catalog_api_lists_and_filters(api):
    r = api.get("/api/v1/gpu-models/", {"family": "a100", "limit": 10})
    assert r.status_code == 200
    assert [m["slug"] for m in r.json()["results"]] == [
        "a100-pcie-40gb",
        "a100-sxm4-40gb",
        "a100-pcie-80gb",
        "a100-sxm4-80gb",
    ]
    assert api.get("/api/v1/gpu-models/h200-sxm-141gb/").json()["memory_gb"] == 141
