"""The GPU catalog: one row per card model, with the published figures the advisor uses."""

from django.db import models
from django.db.models import Q


class GpuTier(models.TextChoices):
    DATACENTER = "datacenter", "Datacenter"
    WORKSTATION = "workstation", "Workstation"
    CONSUMER = "consumer", "Consumer"


class GpuModel(models.Model):
    """A GPU card model with its published figures (dense tensor TFLOPS, FP32 accumulate)."""

    slug = models.SlugField(max_length=40, unique=True)
    name = models.CharField(max_length=80)
    vendor = models.CharField(max_length=20, default="NVIDIA")
    family = models.SlugField(max_length=20, help_text="e.g. a100, h100, rtx4090")
    architecture = models.CharField(max_length=20)
    tier = models.CharField(max_length=12, choices=GpuTier.choices)
    form_factor = models.CharField(max_length=12, help_text="SXM, PCIe")
    memory_gb = models.PositiveIntegerField()
    memory_type = models.CharField(max_length=12)
    memory_bandwidth_gbs = models.PositiveIntegerField()
    fp32_tflops = models.DecimalField(max_digits=7, decimal_places=2)
    tensor_tflops = models.DecimalField(
        max_digits=7,
        decimal_places=2,
        help_text="Dense FP16/BF16 tensor TFLOPS with FP32 accumulation (what training uses)",
    )
    bf16 = models.BooleanField()
    tensor_tflops_fp16_acc = models.DecimalField(
        max_digits=7,
        decimal_places=2,
        null=True,
        blank=True,
        help_text="GeForce only: the FP16-accumulate rate (twice the FP32-accumulate one)",
    )
    nvlink_gbs = models.DecimalField(
        max_digits=6, decimal_places=1, default=0, help_text="0: no NVLink"
    )
    nvlink_bridge = models.BooleanField(default=False, help_text="NVLink by bridge, not SXM")
    tdp_w = models.PositiveIntegerField()
    figures_checked = models.BooleanField(
        default=True, help_text="False where a figure was recalled, not read from a datasheet"
    )

    class Meta:
        ordering = ["family", "memory_gb", "slug"]
        constraints = [
            models.CheckConstraint(condition=Q(memory_gb__gt=0), name="gpumodel_memory_positive"),
            models.CheckConstraint(
                condition=Q(tensor_tflops__gt=0) & Q(fp32_tflops__gt=0),
                name="gpumodel_tflops_positive",
            ),
        ]

    def __str__(self) -> str:
        return self.name
