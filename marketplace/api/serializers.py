"""Input and output shapes of the marketplace API; no business logic here."""

from __future__ import annotations

import math
from decimal import Decimal

from rest_framework import serializers

from accounts.services.secrets import secret_uses_parse
from advisor.engine.presets import PRESETS, decoder_shape
from core.api.fields import INT32_MAX, BoundedDateTimeField, NameField, refuse_unknown
from core.api.pagination import MAX_OFFSET
from core.api.reuse import ReusedPerThread
from core.errors import ValidationFailed
from marketplace.models import (
    CLUSTER_GBPS_MAX,
    GpuModel,
    Interconnect,
    PreemptionPolicy,
    RentalNetwork,
    RentalStatus,
)
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
    min_memory_gb = serializers.IntegerField(required=False, min_value=1, max_value=INT32_MAX)
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
    fits = serializers.CharField(
        required=False,
        max_length=40,
        help_text="only nodes whose free GPUs can train this model: a preset, or billions of "
        "parameters (13b)",
    )

    limit = serializers.IntegerField(required=False, min_value=1, max_value=500, default=50)
    offset = serializers.IntegerField(required=False, min_value=0, max_value=MAX_OFFSET, default=0)

    PASS_THROUGH = frozenset({"format"})

    def validate(self, attrs):
        refuse_unknown(self, also=self.PASS_THROUGH, why="unknown filter")
        return attrs

    def validate_fits(self, value: str):
        if value in PRESETS:
            return PRESETS[value]
        try:
            billions = float(value.lower().removesuffix("b"))
        except ValueError:
            billions = math.nan
        if not 0.001 <= billions <= 10_000:
            raise serializers.ValidationError(
                f"a preset ({', '.join(sorted(PRESETS))}) or 0.001b to 10000b parameters"
            )
        return decoder_shape(params=billions * 1e9)


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
    degraded_gpus = serializers.IntegerField(
        help_text="GPUs rented with a health warning (throttling, a degraded PCIe link)"
    )
    benchmark_below_band = serializers.BooleanField(
        help_text="the latest benchmark fell below the card's expected band: ranked down"
    )
    nvlink = serializers.BooleanField()
    price_per_gpu_hour = serializers.DecimalField(max_digits=10, decimal_places=4)
    min_bid_per_gpu_hour = serializers.DecimalField(max_digits=10, decimal_places=4)
    price_per_tflop_hour = serializers.DecimalField(max_digits=12, decimal_places=6)
    measured_tflops = serializers.FloatField(
        allow_null=True, help_text="dense matmul TFLOPS measured by the harness benchmark"
    )
    price_per_measured_tflop_hour = serializers.DecimalField(
        max_digits=12, decimal_places=6, allow_null=True
    )
    reliability = serializers.DecimalField(max_digits=5, decimal_places=4)
    simulated = serializers.BooleanField()
    internet = serializers.BooleanField(
        help_text="a rental with network internet may run here (the node filters it to public "
        "addresses); any node takes an internal one"
    )
    cpu_cores = serializers.IntegerField()
    ram_gb = serializers.IntegerField()
    disk_gb = serializers.IntegerField()
    cuda_version = serializers.CharField()
    cluster = serializers.CharField(
        allow_null=True, help_text="the provider's cluster of the node; null: on its own"
    )
    interconnect = serializers.CharField(
        allow_null=True, help_text="the cluster's fabric: infiniband, roce, ethernet, nvlink"
    )
    interconnect_gbps = serializers.IntegerField(
        allow_null=True, help_text="the fabric's bandwidth per node, Gb/s"
    )
    cluster_nodes = serializers.IntegerField(
        allow_null=True,
        help_text="online nodes in the cluster: the most a multi-node rental here can span",
    )


class OfferPageSerializer(serializers.Serializer):
    next = serializers.URLField(allow_null=True)
    previous = serializers.URLField(allow_null=True)
    results = OfferSerializer(many=True)


class RuntimeSerializer(serializers.Serializer):
    """What runs in the container: an image and a command, or the training harness config."""

    image = serializers.RegexField(
        r"^[a-z0-9][a-z0-9._/:@-]{0,254}$",
        max_length=255,
        help_text="a local or registry image reference",
    )
    command = serializers.ListField(
        child=serializers.CharField(max_length=4096), max_length=64, required=False, default=list
    )
    harness_config = serializers.DictField(required=False, allow_null=True, default=None)
    env = serializers.DictField(
        child=serializers.CharField(max_length=4096, allow_blank=True),
        required=False,
        default=dict,
    )
    ports = serializers.ListField(
        child=serializers.IntegerField(min_value=1, max_value=65535),
        max_length=16,
        required=False,
        default=list,
    )

    def validate_env(self, value: dict) -> dict:
        import re

        if len(value) > 64:
            raise serializers.ValidationError("at most 64 variables")
        for key in value:
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]{0,127}", key):
                raise serializers.ValidationError(f"bad variable name {key!r}")
            if key.startswith(("GPUMARKET_", "NVIDIA_", "CUDA_VISIBLE")):
                raise serializers.ValidationError(f"{key} is set by the platform")
        return value

    def validate_harness_config(self, value: dict | None) -> dict | None:
        """Checked with the harness's own schema, so a bad key is a 400 now, not a failed run."""
        if value is None:
            return value
        from harness.config import ConfigError, load_config_dict

        try:
            load_config_dict(value)
        except ConfigError as exc:
            raise serializers.ValidationError(
                [f"{path}: {message}" if path else message for path, message in exc.problems]
            ) from exc
        return value

    def validate_ports(self, value: list[int]) -> list[int]:
        if len(set(value)) != len(value):
            raise serializers.ValidationError("ports must be unique")
        return value


class SecretUsesField(serializers.JSONField):
    """The team secrets a run gets: a list of names (each as the variable of its name), or an
    object name -> {"env": "VAR"} and/or {"file": "/run/secrets/FILE"}; stored by name."""

    def __init__(self, **kwargs):
        kwargs.setdefault("required", False)
        kwargs.setdefault("default", list)
        kwargs.setdefault(
            "help_text",
            "names of your team's secrets (each as the variable of its name), or name -> "
            '{"env": "VAR"} / {"file": "/run/secrets/FILE"}',
        )
        super().__init__(**kwargs)

    def to_internal_value(self, data):
        try:
            return secret_uses_parse(super().to_internal_value(data), field=self.field_name)
        except ValidationFailed as exc:
            raise serializers.ValidationError(exc.message) from None


class RegistrySecretField(serializers.CharField):
    def __init__(self, **kwargs):
        kwargs.update(required=False, default="", allow_blank=True, max_length=64)
        kwargs.setdefault(
            "help_text",
            'a team secret holding the image registry\'s credentials: {"username": .., '
            '"password": ..} or user:password',
        )
        super().__init__(**kwargs)


# The create view validates with this thread's instance (`for_data`, core.api.reuse).
class RentalCreateSerializer(ReusedPerThread, serializers.Serializer):
    """A rental request: GPU constraints, placement, timing, pricing and the runtime."""

    name = NameField(max_length=80, required=False, default="", allow_blank=True)
    gpu_models = serializers.ListField(
        child=serializers.SlugField(max_length=40), required=False, default=list, max_length=20
    )
    gpu_families = serializers.ListField(
        child=serializers.SlugField(max_length=20), required=False, default=list, max_length=20
    )
    min_memory_gb = serializers.IntegerField(
        required=False, default=0, min_value=0, max_value=INT32_MAX
    )
    min_tensor_tflops = serializers.DecimalField(
        max_digits=7, decimal_places=2, required=False, default=0, min_value=0
    )
    gpus_per_node = serializers.IntegerField(min_value=1, max_value=64)
    node_count = serializers.IntegerField(required=False, default=1, min_value=1, max_value=64)
    same_group = serializers.BooleanField(
        required=False, default=False, help_text="all GPUs of a node in one NVLink group"
    )
    region = serializers.SlugField(max_length=40, required=False, default="", allow_blank=True)
    max_price_per_gpu_hour = serializers.DecimalField(
        max_digits=10, decimal_places=4, required=False, allow_null=True, default=None,
        min_value=0,
    )  # fmt: skip
    kind = serializers.ChoiceField(choices=["on_demand", "interruptible"], default="on_demand")
    bid_per_gpu_hour = serializers.DecimalField(
        max_digits=10, decimal_places=4, required=False, allow_null=True, default=None,
        min_value=Decimal("0.0001"),
    )  # fmt: skip
    preemption_policy = serializers.ChoiceField(
        choices=PreemptionPolicy.values, required=False, allow_null=True, default=None,
        help_text="an interruptible rental preempted: requeue (resume from its last "
        "checkpoint) or end; by default requeue for a run that checkpoints",
    )  # fmt: skip
    max_charge = serializers.DecimalField(
        max_digits=9, decimal_places=2, required=False, allow_null=True, default=None,
        min_value=Decimal("0.01"), max_value=Decimal(1_000_000),
        help_text="dollars: the rental checkpoints and stops when its charge reaches this",
    )  # fmt: skip
    start_at = BoundedDateTimeField(required=False, allow_null=True, default=None)
    start_deadline = BoundedDateTimeField(required=False, allow_null=True, default=None)
    duration_s = serializers.IntegerField(required=False, min_value=60, max_value=30 * 86400)
    end_at = BoundedDateTimeField(required=False)
    runtime = RuntimeSerializer()
    ssh = serializers.BooleanField(
        required=False, default=False, help_text="an sshd in the container for your SSH keys"
    )
    network = serializers.ChoiceField(
        choices=RentalNetwork.values,
        required=False,
        default=RentalNetwork.INTERNET,
        help_text="internet: the public internet and nothing else (not the host, the "
        "provider's LAN, metadata addresses or other rentals); internal: no network at all",
    )
    jupyter = serializers.BooleanField(
        required=False,
        default=False,
        help_text="JupyterLab beside the command (as the command when none is given), "
        "published with a token of the rental's own",
    )
    min_interconnect_gbps = serializers.IntegerField(
        required=False,
        default=0,
        min_value=0,
        max_value=CLUSTER_GBPS_MAX,
        help_text="a multi-node rental: only a cluster whose fabric is at least this fast, "
        "Gb/s per node (0: any cluster)",
    )
    datasets = serializers.ListField(
        child=serializers.CharField(max_length=80),
        required=False,
        default=list,
        max_length=16,
        help_text="names of your ready datasets, staged read-only at /data/<name>",
    )
    resume_from = serializers.UUIDField(
        required=False,
        allow_null=True,
        default=None,
        help_text="one of your earlier rentals: start from its last synced checkpoint",
    )
    secrets = SecretUsesField()
    registry_secret = RegistrySecretField()

    def validate(self, attrs):
        refuse_unknown(self)
        if ("duration_s" in attrs) == ("end_at" in attrs):
            raise serializers.ValidationError({"duration_s": ["give duration_s or end_at"]})
        if "end_at" in attrs:
            from django.utils import timezone

            start = attrs.get("start_at") or timezone.now()
            seconds = int((attrs.pop("end_at") - start).total_seconds())
            if seconds < 60:
                raise serializers.ValidationError({"end_at": ["must be at least 60 s after start"]})
            attrs["duration_s"] = seconds
        return attrs


class RentalEventSerializer(serializers.Serializer):
    created_at = serializers.DateTimeField()
    from_status = serializers.CharField()
    to_status = serializers.CharField()
    actor_kind = serializers.CharField()
    reason = serializers.CharField()
    cause = serializers.CharField(help_text="whose doing an ending or a re-queue was")


class AllocationSerializer(serializers.Serializer):
    node = serializers.CharField(source="node.hostname")
    gpu_index = serializers.IntegerField(source="gpu.index")
    gpu_uuid = serializers.CharField(source="gpu.uuid")
    start = serializers.DateTimeField(source="during.lower")
    end = serializers.DateTimeField(source="during.upper")
    released_at = serializers.DateTimeField()


class SecretUseSerializer(serializers.Serializer):
    """How a run gets one team secret (never its value)."""

    name = serializers.CharField()
    env = serializers.CharField(help_text="the variable it is in; empty: none")
    file = serializers.CharField(help_text="the read-only file it is in; empty: none")


class RentalSerializer(serializers.Serializer):
    id = serializers.UUIDField()
    team = serializers.IntegerField(source="team_id", help_text="the team that owns the rental")
    created_by = serializers.CharField(
        source="customer.username", help_text="the member who created it"
    )
    name = serializers.CharField()
    status = serializers.CharField()
    status_reason = serializers.CharField()
    kind = serializers.CharField()
    gpus_per_node = serializers.IntegerField()
    node_count = serializers.IntegerField()
    gpu_models = serializers.ListField(child=serializers.CharField())
    gpu_families = serializers.ListField(child=serializers.CharField())
    min_memory_gb = serializers.IntegerField()
    min_tensor_tflops = serializers.DecimalField(max_digits=7, decimal_places=2)
    same_group = serializers.BooleanField()
    region = serializers.CharField()
    max_price_per_gpu_hour = serializers.DecimalField(
        max_digits=10, decimal_places=4, allow_null=True
    )
    bid_per_gpu_hour = serializers.DecimalField(max_digits=10, decimal_places=4, allow_null=True)
    price_per_gpu_hour = serializers.DecimalField(
        max_digits=10, decimal_places=4, allow_null=True, help_text="locked at booking"
    )
    start_at = serializers.DateTimeField()
    start_deadline = serializers.DateTimeField()
    duration_s = serializers.IntegerField()
    scheduled_start = serializers.DateTimeField(allow_null=True)
    scheduled_end = serializers.DateTimeField(allow_null=True)
    started_at = serializers.DateTimeField(
        allow_null=True, help_text="the server's RUNNING event: billed time starts here"
    )
    ended_at = serializers.DateTimeField(allow_null=True, help_text="the server's end time")
    end_cause = serializers.CharField(
        help_text="customer, node, platform or preemption; empty while it has not ended"
    )
    preemption_policy = serializers.CharField()
    exit_code = serializers.IntegerField(allow_null=True)
    image = serializers.CharField()
    command = serializers.JSONField()
    harness_config = serializers.JSONField()
    ports = serializers.ListField(child=serializers.IntegerField())
    resume_from = serializers.UUIDField(source="resume_from_id", allow_null=True)
    ssh = serializers.BooleanField()
    network = serializers.CharField(help_text="internet or internal")
    secrets = SecretUseSerializer(many=True, help_text="the team secrets it gets, by name")
    registry_secret = serializers.CharField(help_text="the secret its image is pulled with")
    jupyter = serializers.BooleanField()
    min_interconnect_gbps = serializers.IntegerField()
    created_at = serializers.DateTimeField()


class RentalAccessSerializer(serializers.Serializer):
    """A published port of the rental's running container."""

    container_port = serializers.IntegerField()
    host = serializers.CharField(help_text="the node's public name or address")
    host_port = serializers.IntegerField()
    command = serializers.CharField(help_text="for SSH: the command that logs in; else empty")
    url = serializers.CharField(
        help_text="for any other port: http://host:port/ (JupyterLab's with its token); "
        "for SSH empty"
    )


class RentalMemberSerializer(serializers.Serializer):
    """One member of the rental: its node and its run there (a multi-node rental has one per
    node, by node rank)."""

    node_rank = serializers.IntegerField(allow_null=True, help_text="NODE_RANK; null on one node")
    node = serializers.CharField(help_text="the node's hostname")
    state = serializers.CharField(
        help_text="its run as the agent last reported it: requested, created, running, exited, "
        "missing"
    )
    exit_code = serializers.IntegerField(allow_null=True)
    started_at = serializers.DateTimeField(allow_null=True)
    finished_at = serializers.DateTimeField(allow_null=True)
    log_tail = serializers.CharField(help_text="its last output lines")


class RentalPullProgressSerializer(serializers.Serializer):
    """The rental's image being pulled before its start, summed over its nodes."""

    done_bytes = serializers.IntegerField()
    total_bytes = serializers.IntegerField(help_text="as far as the registry announced it")
    text = serializers.CharField(help_text='e.g. "pulling 3.2 of 8.1 GB"')


# Views render with this thread's instance (`for_instance`, core.api.reuse).
class RentalCreditSerializer(serializers.Serializer):
    """GPU time a node fault lost, credited automatically (never billed, never paid out)."""

    node = serializers.CharField(source="hostname")
    reason = serializers.CharField()
    start = serializers.DateTimeField(
        source="during.lower", help_text="the last synced checkpoint (the run's start if none)"
    )
    end = serializers.DateTimeField(source="during.upper", help_text="the fault")


class RentalDetailSerializer(ReusedPerThread, RentalSerializer):
    events = RentalEventSerializer(many=True)
    allocations = AllocationSerializer(many=True)
    credits = RentalCreditSerializer(
        many=True, help_text="GPU time a node fault lost: credited, not billed"
    )
    log_tail = serializers.CharField()
    jupyter_token = serializers.CharField(
        help_text="the token of the rental's JupyterLab (empty without one): the team's only"
    )
    access = RentalAccessSerializer(
        many=True, help_text="how to reach the running container (SSH), once its ports listen"
    )
    datasets = serializers.SerializerMethodField(help_text="the datasets the rental reads")
    pull_progress = RentalPullProgressSerializer(
        allow_null=True,
        help_text="while provisioning: its image being pulled on its node(s); else null",
    )
    members = RentalMemberSerializer(
        many=True, help_text="each node the rental runs on (its current placement)"
    )

    def get_datasets(self, rental) -> list[str]:
        return [link.dataset.name for link in rental.dataset_links.all()]


class RentalListQuerySerializer(serializers.Serializer):
    status = serializers.ChoiceField(
        choices=RentalStatus.choices, required=False, allow_blank=True, default=""
    )


class ProviderSerializer(serializers.Serializer):
    id = serializers.IntegerField()
    name = serializers.CharField()


class GpuHealthSerializer(serializers.Serializer):
    index = serializers.IntegerField()
    health = serializers.CharField()
    health_reason = serializers.CharField()
    health_since = serializers.DateTimeField(allow_null=True)


class ProviderNodeSerializer(serializers.Serializer):
    """One of your nodes as its provider sees it: listing, state and how much of it is rented."""

    id = serializers.IntegerField()
    hostname = serializers.CharField()
    region = serializers.CharField()
    pool = serializers.CharField()
    status = serializers.CharField()
    gpu_model = serializers.CharField(source="gpu_model.slug")
    gpu_name = serializers.CharField(source="gpu_model.name")
    gpu_count = serializers.IntegerField()
    rented_gpus = serializers.IntegerField()
    price_per_gpu_hour = serializers.DecimalField(max_digits=10, decimal_places=4)
    min_bid_per_gpu_hour = serializers.DecimalField(max_digits=10, decimal_places=4)
    reliability = serializers.DecimalField(max_digits=5, decimal_places=4)
    measured_tflops = serializers.FloatField(allow_null=True)
    benchmark_below_band = serializers.BooleanField()
    unhealthy_gpus = GpuHealthSerializer(
        many=True, help_text="GPUs not OK; a FAILED one rents no more"
    )
    simulated = serializers.BooleanField()
    internet_filtered = serializers.BooleanField(
        help_text="its agent filters a rental's internet to public addresses (said at join)"
    )
    internet_capable = serializers.BooleanField(
        help_text="rentals with network internet are placed here"
    )
    last_seen_at = serializers.DateTimeField(allow_null=True)
    driver_version = serializers.CharField()
    cuda_version = serializers.CharField()
    cluster = serializers.IntegerField(
        source="cluster_id", allow_null=True, help_text="its cluster's id; null: on its own"
    )
    cluster_name = serializers.CharField(source="cluster.name", allow_null=True, default=None)


class ProviderNodePriceSerializer(serializers.Serializer):
    """What a provider may change on its node: prices for new bookings, and its cluster."""

    price_per_gpu_hour = serializers.DecimalField(
        max_digits=10, decimal_places=4, min_value=Decimal("0.0001"), required=False
    )
    min_bid_per_gpu_hour = serializers.DecimalField(
        max_digits=10, decimal_places=4, min_value=Decimal("0.0001"), required=False
    )
    cluster = serializers.IntegerField(
        min_value=1,
        max_value=INT32_MAX,
        allow_null=True,
        required=False,
        help_text="one of the provider's clusters; null takes the node out of its cluster",
    )

    def validate(self, attrs):
        refuse_unknown(self)
        if not attrs:
            raise serializers.ValidationError(
                {"price_per_gpu_hour": ["give price_per_gpu_hour, min_bid_per_gpu_hour or cluster"]}
            )
        return attrs


class ClusterNodeSerializer(serializers.Serializer):
    id = serializers.IntegerField()
    hostname = serializers.CharField()
    status = serializers.CharField()
    gpu_model = serializers.CharField(source="gpu_model.slug")
    gpu_count = serializers.IntegerField()


class ClusterSerializer(serializers.Serializer):
    """A provider's cluster: nodes on one fabric, where a multi-node rental is placed."""

    id = serializers.IntegerField()
    provider = serializers.IntegerField(source="provider_id")
    name = serializers.CharField()
    interconnect = serializers.CharField()
    bandwidth_gbps = serializers.IntegerField()
    interconnect_label = serializers.CharField(help_text='e.g. "InfiniBand 400 Gb/s"')
    nodes = ClusterNodeSerializer(many=True, source="nodes.all")
    created_at = serializers.DateTimeField()


class ClusterWriteSerializer(serializers.Serializer):
    name = serializers.CharField(max_length=40)
    interconnect = serializers.ChoiceField(choices=Interconnect.choices)
    bandwidth_gbps = serializers.IntegerField(
        min_value=1, max_value=CLUSTER_GBPS_MAX, help_text="the fabric's bandwidth per node"
    )

    def validate(self, attrs):
        refuse_unknown(self)
        return attrs


class ProviderNodeActionSerializer(serializers.Serializer):
    action = serializers.ChoiceField(choices=["drain", "maintenance", "online"])
    reason = serializers.CharField(max_length=200, required=False, default="", allow_blank=True)


class TemplateWriteSerializer(RuntimeSerializer):
    """A rental template: what runs (the runtime a rental request takes), its datasets and SSH."""

    name = serializers.SlugField(max_length=40, required=False)
    description = serializers.CharField(
        max_length=200, required=False, default="", allow_blank=True
    )
    datasets = serializers.ListField(
        child=serializers.CharField(max_length=80), required=False, default=list, max_length=16
    )
    ssh = serializers.BooleanField(required=False, default=False)
    network = serializers.ChoiceField(
        choices=RentalNetwork.values, required=False, default=RentalNetwork.INTERNET
    )
    secrets = SecretUsesField()
    registry_secret = RegistrySecretField()

    def validate(self, attrs):
        refuse_unknown(self)
        return attrs


class TemplateSerializer(serializers.Serializer):
    name = serializers.CharField()
    description = serializers.CharField()
    image = serializers.CharField()
    command = serializers.ListField(child=serializers.CharField())
    env = serializers.DictField(child=serializers.CharField())
    ports = serializers.ListField(child=serializers.IntegerField())
    datasets = serializers.ListField(child=serializers.CharField())
    harness_config = serializers.JSONField(allow_null=True)
    ssh = serializers.BooleanField()
    network = serializers.CharField()
    secrets = SecretUseSerializer(many=True, help_text="team secrets by name (never values)")
    registry_secret = serializers.CharField()
    created_by = serializers.CharField(source="created_by.username", allow_null=True)
    created_at = serializers.DateTimeField()
    updated_at = serializers.DateTimeField()
