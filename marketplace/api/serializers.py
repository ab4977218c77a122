"""Input and output shapes of the marketplace API; no business logic here."""

from __future__ import annotations

from rest_framework import serializers

from marketplace.models import ApiToken, GpuModel
from marketplace.selectors import OFFER_ORDERINGS


class GpuModelSerializer(serializers.ModelSerializer):
    class Meta:
        model = GpuModel
        fields = [
            "slug",
            "name",
            "vendor",
            "family",
            "architecture",
            "tier",
            "form_factor",
            "memory_gb",
            "memory_type",
            "memory_bandwidth_gbs",
            "fp32_tflops",
            "tensor_tflops",
            "tensor_tflops_fp16_acc",
            "bf16",
            "nvlink_gbs",
            "nvlink_bridge",
            "tdp_w",
            "figures_checked",
        ]


class CommaList(serializers.CharField):
    """`a,b,c` in a query string, as a tuple of non-empty slugs."""

    def to_internal_value(self, data):
        value = super().to_internal_value(data)
        items = tuple(v.strip() for v in value.split(",") if v.strip())
        if not items:
            raise serializers.ValidationError("give at least one value")
        slug = serializers.SlugField()
        for item in items:
            slug.run_validation(item)
        return items


class OfferQuerySerializer(serializers.Serializer):
    """The offers list's query parameters; anything else in the query string is refused."""

    gpu_model = CommaList(required=False, help_text="catalog slugs, comma-separated")
    gpu_family = CommaList(
        required=False, help_text="families (a100, h100, rtx4090), comma-separated"
    )
    min_memory_gb = serializers.IntegerField(required=False, min_value=1)
    min_tensor_tflops = serializers.DecimalField(
        required=False, max_digits=7, decimal_places=2, min_value=0
    )
    min_free_gpus = serializers.IntegerField(required=False, min_value=1, max_value=1024)
    nvlink = serializers.BooleanField(required=False, allow_null=True, default=None)
    region = serializers.SlugField(required=False, max_length=40)
    max_price = serializers.DecimalField(
        required=False, max_digits=10, decimal_places=4, min_value=0
    )
    min_reliability = serializers.DecimalField(
        required=False, max_digits=5, decimal_places=4, min_value=0, max_value=1
    )
    ordering = serializers.ChoiceField(
        required=False, choices=sorted(OFFER_ORDERINGS), default="price"
    )

    limit = serializers.IntegerField(required=False, min_value=1, max_value=500, default=50)
    offset = serializers.IntegerField(required=False, min_value=0, default=0)

    PASS_THROUGH = frozenset({"format"})

    def validate(self, attrs):
        unknown = set(self.initial_data) - set(self.fields) - self.PASS_THROUGH
        if unknown:
            raise serializers.ValidationError(
                {name: ["unknown filter"] for name in sorted(unknown)}
            )
        return attrs


class OfferSerializer(serializers.Serializer):
    node_id = serializers.IntegerField()
    hostname = serializers.CharField()
    provider = serializers.CharField()
    region = serializers.CharField()
    gpu_model = serializers.CharField()
    gpu_name = serializers.CharField()
    memory_gb = serializers.IntegerField()
    tensor_tflops = serializers.DecimalField(max_digits=7, decimal_places=2)
    free_gpus = serializers.IntegerField()
    gpu_count = serializers.IntegerField()
    nvlink = serializers.BooleanField()
    price_per_gpu_hour = serializers.DecimalField(max_digits=10, decimal_places=4)
    min_bid_per_gpu_hour = serializers.DecimalField(max_digits=10, decimal_places=4)
    price_per_tflop_hour = serializers.DecimalField(max_digits=12, decimal_places=6)
    reliability = serializers.DecimalField(max_digits=5, decimal_places=4)
    simulated = serializers.BooleanField()
    cpu_cores = serializers.IntegerField()
    ram_gb = serializers.IntegerField()
    disk_gb = serializers.IntegerField()
    cuda_version = serializers.CharField()


class OfferPageSerializer(serializers.Serializer):
    next = serializers.URLField(allow_null=True)
    previous = serializers.URLField(allow_null=True)
    results = OfferSerializer(many=True)


class ApiTokenSerializer(serializers.ModelSerializer):
    class Meta:
        model = ApiToken
        fields = ["id", "name", "prefix", "created_at", "last_used_at", "expires_at", "revoked_at"]


class ApiTokenCreateSerializer(serializers.Serializer):
    name = serializers.CharField(max_length=80)
    expires_at = serializers.DateTimeField(required=False, allow_null=True, default=None)


class ApiTokenCreatedSerializer(ApiTokenSerializer):
    token = serializers.CharField(help_text="the secret: shown once, never again")

    class Meta(ApiTokenSerializer.Meta):
        fields = [*ApiTokenSerializer.Meta.fields, "token"]
