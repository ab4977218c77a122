"""Load the GPU catalog from the published vendor figures (shared/gpu-specs.md).

Tensor figures are dense; GeForce cards carry the FP32-accumulate rate that training uses, with the
FP16-accumulate rate beside it. Rows whose figures were recalled rather than read from a datasheet
have figures_checked=False so the UI can say so.
"""

from django.db import migrations

# slug, name, family, architecture, tier, form, memory GB, memory type, bandwidth GB/s,
# FP32 TFLOPS, tensor TFLOPS, FP16-acc TFLOPS, BF16, NVLink GB/s, bridge, TDP W, checked
CATALOG = [
    ("v100-sxm2-16gb", "V100 SXM2 16 GB", "v100", "Volta", "datacenter", "SXM2", 16, "HBM2", 900, "15.7", "125", None, False, "300", False, 300, True),
    ("v100-sxm2-32gb", "V100 SXM2 32 GB", "v100", "Volta", "datacenter", "SXM2", 32, "HBM2", 900, "15.7", "125", None, False, "300", False, 300, True),
    ("v100-pcie-16gb", "V100 PCIe 16 GB", "v100", "Volta", "datacenter", "PCIe", 16, "HBM2", 900, "14", "112", None, False, "0", False, 250, True),
    ("v100-pcie-32gb", "V100 PCIe 32 GB", "v100", "Volta", "datacenter", "PCIe", 32, "HBM2", 900, "14", "112", None, False, "0", False, 250, True),
    ("a100-sxm4-40gb", "A100 SXM4 40 GB", "a100", "Ampere", "datacenter", "SXM4", 40, "HBM2", 1555, "19.5", "312", None, True, "600", False, 400, True),
    ("a100-sxm4-80gb", "A100 SXM4 80 GB", "a100", "Ampere", "datacenter", "SXM4", 80, "HBM2e", 2039, "19.5", "312", None, True, "600", False, 400, True),
    ("a100-pcie-40gb", "A100 PCIe 40 GB", "a100", "Ampere", "datacenter", "PCIe", 40, "HBM2", 1555, "19.5", "312", None, True, "600", True, 250, False),
    ("a100-pcie-80gb", "A100 PCIe 80 GB", "a100", "Ampere", "datacenter", "PCIe", 80, "HBM2e", 1935, "19.5", "312", None, True, "600", True, 300, False),
    ("h100-sxm5-80gb", "H100 SXM5 80 GB", "h100", "Hopper", "datacenter", "SXM5", 80, "HBM3", 3350, "67", "989", None, True, "900", False, 700, True),
    ("h100-pcie-80gb", "H100 PCIe 80 GB", "h100", "Hopper", "datacenter", "PCIe", 80, "HBM2e", 2000, "51", "756", None, True, "600", True, 350, True),
    ("h200-sxm-141gb", "H200 SXM 141 GB", "h200", "Hopper", "datacenter", "SXM", 141, "HBM3e", 4800, "67", "989", None, True, "900", False, 700, True),
    ("l40s-48gb", "L40S 48 GB", "l40s", "Ada Lovelace", "datacenter", "PCIe", 48, "GDDR6", 864, "91.6", "362", None, True, "0", False, 350, True),
    ("a10-24gb", "A10 24 GB", "a10", "Ampere", "datacenter", "PCIe", 24, "GDDR6", 600, "31.2", "125", None, True, "0", False, 150, True),
    ("t4-16gb", "T4 16 GB", "t4", "Turing", "datacenter", "PCIe", 16, "GDDR6", 320, "8.1", "65", None, False, "0", False, 70, True),
    ("rtx3090-24gb", "GeForce RTX 3090 24 GB", "rtx3090", "Ampere", "consumer", "PCIe", 24, "GDDR6X", 936, "35.6", "71", "142", True, "112.5", True, 350, False),
    ("rtx3080ti-12gb", "GeForce RTX 3080 Ti 12 GB", "rtx3080ti", "Ampere", "consumer", "PCIe", 12, "GDDR6X", 912, "34.1", "68", None, True, "0", False, 350, False),
    ("rtx4090-24gb", "GeForce RTX 4090 24 GB", "rtx4090", "Ada Lovelace", "consumer", "PCIe", 24, "GDDR6X", 1008, "82.6", "165.2", "330", True, "0", False, 450, True),
    ("rtx-a6000-48gb", "RTX A6000 48 GB", "rtxa6000", "Ampere", "workstation", "PCIe", 48, "GDDR6", 768, "38.7", "154.8", None, True, "112.5", True, 300, True),
]

FIELDS = (
    "slug", "name", "family", "architecture", "tier", "form_factor", "memory_gb", "memory_type",
    "memory_bandwidth_gbs", "fp32_tflops", "tensor_tflops", "tensor_tflops_fp16_acc", "bf16",
    "nvlink_gbs", "nvlink_bridge", "tdp_w", "figures_checked",
)


def load(apps, schema_editor):
    GpuModel = apps.get_model("marketplace", "GpuModel")
    for row in CATALOG:
        values = dict(zip(FIELDS, row, strict=True))
        GpuModel.objects.update_or_create(slug=values.pop("slug"), defaults=values)


def unload(apps, schema_editor):
    apps.get_model("marketplace", "GpuModel").objects.filter(
        slug__in=[row[0] for row in CATALOG]
    ).delete()


class Migration(migrations.Migration):
    dependencies = [("marketplace", "0001_initial")]
    operations = [migrations.RunPython(load, unload)]
