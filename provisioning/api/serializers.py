"""The agent protocol's shapes, with the size limits a public endpoint needs.

The messages themselves are defined once, in `agentprotocol`; these serializers add the limits
and document the shapes in the OpenAPI schema. tests/provisioning/test_agent_schema.py keeps
their fields equal to the messages' fields.
"""

from __future__ import annotations

from rest_framework import serializers

from agentprotocol import ContainerStatus

MAX_GPUS = 64


class HostSerializer(serializers.Serializer):
    cpu_cores = serializers.IntegerField(min_value=1, max_value=4096)
    ram_gb = serializers.IntegerField(min_value=1, max_value=1 << 20)
    disk_gb = serializers.IntegerField(min_value=1, max_value=1 << 30)
    driver_version = serializers.CharField(max_length=40, allow_blank=True, default="")
    cuda_version = serializers.CharField(max_length=20, allow_blank=True, default="")


class ReportedGpuSerializer(serializers.Serializer):
    index = serializers.IntegerField(min_value=0, max_value=255)
    uuid = serializers.CharField(max_length=64)
    name = serializers.CharField(max_length=120)
    memory_mb = serializers.IntegerField(min_value=1, max_value=1 << 24)
    topology_group = serializers.CharField(max_length=40, allow_blank=True, default="")


class JoinSerializer(serializers.Serializer):
    join_token = serializers.CharField(max_length=200)
    hostname = serializers.RegexField(r"^[A-Za-z0-9][A-Za-z0-9.-]{0,252}$")
    host = HostSerializer()
    gpus = ReportedGpuSerializer(many=True, max_length=MAX_GPUS, allow_empty=False)
    simulated = serializers.BooleanField(default=False)


class ContainerReportSerializer(serializers.Serializer):
    rental_id = serializers.UUIDField()
    run_id = serializers.CharField(max_length=128)
    status = serializers.ChoiceField(choices=[status.value for status in ContainerStatus])
    exit_code = serializers.IntegerField(allow_null=True, required=False, default=None)
    started_at = serializers.FloatField(allow_null=True, required=False, default=None)
    finished_at = serializers.FloatField(allow_null=True, required=False, default=None)
    log_tail = serializers.CharField(max_length=8192, allow_blank=True, required=False, default="")
    # Why the agent could not start the run at all (bad image, a runtime that cannot run it).
    error = serializers.CharField(max_length=500, allow_blank=True, required=False, default="")


class UsageReportSerializer(serializers.Serializer):
    seq = serializers.IntegerField(min_value=1)
    rental_id = serializers.UUIDField()
    run_id = serializers.CharField(max_length=128)
    gpu_count = serializers.IntegerField(min_value=1, max_value=MAX_GPUS)
    started_at = serializers.FloatField()
    confirmed_at = serializers.FloatField()
    final = serializers.BooleanField(default=False)

    def validate(self, attrs):
        if attrs["confirmed_at"] < attrs["started_at"]:
            raise serializers.ValidationError({"confirmed_at": ["before started_at"]})
        return attrs


class TelemetrySerializer(serializers.Serializer):
    gpu_index = serializers.IntegerField(min_value=0, max_value=255)
    ts = serializers.FloatField()
    util_pct = serializers.FloatField(min_value=0, max_value=100)
    mem_used_mb = serializers.IntegerField(min_value=0)
    power_w = serializers.FloatField(min_value=0)
    temp_c = serializers.FloatField()
    ecc_errors = serializers.IntegerField(min_value=0, required=False, default=0)
    xid_errors = serializers.IntegerField(min_value=0, required=False, default=0)
    healthy = serializers.BooleanField(required=False, default=True)


class MetricLineSerializer(serializers.Serializer):
    rental_id = serializers.UUIDField()
    run_id = serializers.CharField(max_length=128)
    line = serializers.CharField(max_length=4096)


class HeartbeatSerializer(serializers.Serializer):
    agent_version = serializers.CharField(max_length=40, required=False, default="")
    sent_at = serializers.FloatField(required=False)
    telemetry = TelemetrySerializer(
        many=True, max_length=4 * MAX_GPUS, required=False, default=list
    )
    containers = ContainerReportSerializer(many=True, max_length=256, required=False, default=list)
    usage = UsageReportSerializer(many=True, max_length=5000, required=False, default=list)
    metrics = MetricLineSerializer(many=True, max_length=500, required=False, default=list)
    benchmark = serializers.DictField(required=False, allow_null=True, default=None)


class JoinAnswerSerializer(serializers.Serializer):
    node_id = serializers.IntegerField()
    node_token = serializers.CharField(help_text="shown this once")
    heartbeat_interval_s = serializers.FloatField()


class DesiredRunSerializer(serializers.Serializer):
    rental_id = serializers.UUIDField()
    run_id = serializers.CharField()
    image = serializers.CharField()
    command = serializers.ListField(child=serializers.CharField())
    env = serializers.DictField(child=serializers.CharField())
    gpu_indices = serializers.ListField(child=serializers.IntegerField())
    gpu_uuids = serializers.ListField(child=serializers.CharField())
    cpu_limit = serializers.FloatField()
    memory_limit_mb = serializers.IntegerField()
    ports = serializers.ListField(child=serializers.IntegerField())
    stop_grace_s = serializers.FloatField()


class HeartbeatAnswerSerializer(serializers.Serializer):
    desired = DesiredRunSerializer(many=True)
    ack_usage_seq = serializers.IntegerField()
    heartbeat_interval_s = serializers.FloatField()
    run_benchmark = serializers.BooleanField()


class JoinTokenCreateSerializer(serializers.Serializer):
    provider = serializers.CharField(max_length=120, help_text="your provider's name")
    region = serializers.SlugField(max_length=40)
    pool = serializers.SlugField(max_length=40, default="default")
    price_per_gpu_hour = serializers.DecimalField(max_digits=10, decimal_places=4, min_value=0)
    min_bid_per_gpu_hour = serializers.DecimalField(max_digits=10, decimal_places=4, min_value=0)


class RunMetricQuerySerializer(serializers.Serializer):
    event = serializers.CharField(
        max_length=20, required=False, help_text="start, step, eval, checkpoint, summary, ..."
    )
    after_step = serializers.IntegerField(
        required=False, min_value=-(2**31), max_value=2**31 - 1, help_text="steps after this one"
    )


class RunMetricSerializer(serializers.Serializer):
    """One line the harness printed, as it printed it, with when the server received it."""

    received_at = serializers.DateTimeField()

    def to_representation(self, row: dict) -> dict:
        return {**row["data"], "received_at": super().to_representation(row)["received_at"]}
