"""The agent protocol's shapes, with the size limits a public endpoint needs.

The messages themselves are defined once, in `agentprotocol`; these serializers add the limits
and document the shapes in the OpenAPI schema. tests/provisioning/test_agent_schema.py keeps
their fields equal to the messages' fields.

A heartbeat's elements (one container report, one usage report, one sample, one metric line,
the benchmark) are checked one by one: a bad one is dropped and counted (`dropped` on the
field) and the rest is applied. Only a heartbeat that is not one at all (not an object, a list
that is not a list or is too long, a bad top-level field) is refused whole. Numbers are bounded
to what the database columns and datetime can hold, so a valid element cannot fail later.
"""

from __future__ import annotations

import re
import uuid
from typing import Any

from rest_framework import serializers

from agentprotocol import ContainerStatus, Network
from agentprotocol.untrusted import text_sanitize
from core.api.fields import NameField
from core.api.reuse import ReusedPerThread
from marketplace.models import CLUSTER_GBPS_MAX, Interconnect

MAX_GPUS = 64
INT32_MAX = (1 << 31) - 1
# Unix times up to the year 2286: a larger one overflows datetime.
EPOCH_MAX = 1e10


def _epoch(**kwargs: Any) -> serializers.FloatField:
    return serializers.FloatField(min_value=0, max_value=EPOCH_MAX, **kwargs)


def json_sanitize(value: Any) -> Any:
    """A JSON value with every string (keys too) passed through text_sanitize: PostgreSQL's
    jsonb refuses a NUL anywhere."""
    if isinstance(value, str):
        return text_sanitize(value)
    if isinstance(value, list):
        return [json_sanitize(item) for item in value]
    if isinstance(value, dict):
        return {text_sanitize(str(k)): json_sanitize(item) for k, item in value.items()}
    return value


class ContainerTextField(serializers.CharField):
    """Text a container wrote (its log tail, why it could not start): control characters are
    replaced, not refused, so a NUL it printed cannot hide that it exited."""

    def to_internal_value(self, data: Any) -> str:
        return text_sanitize(super().to_internal_value(data))


class DroppingListSerializer(serializers.ListSerializer):
    """A list whose invalid elements are dropped and counted in `dropped` instead of refusing
    the whole request; a value that is not a list, or too long a list, is still refused."""

    dropped = 0

    def to_internal_value(self, data: Any) -> list:
        if not isinstance(data, list) or (self.max_length and len(data) > self.max_length):
            return super().to_internal_value(data)  # refuses it with DRF's own message
        kept, self.dropped = [], 0
        for item in data:
            try:
                kept.append(self.run_child_validation(item))
            except serializers.ValidationError:
                self.dropped += 1
        return kept


MAX_CACHED_IMAGES = 1000


class ImageAllowField(serializers.ListField):
    """An agent's image allow-list: its patterns (agentprotocol.images)."""

    child = serializers.CharField(max_length=255)

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(max_length=64, **kwargs)


# The JSON types a value of each field kind may have to be checked in one pass: exactly these
# (`type(v) in`), so a bool is never taken for a number; DRF's own path takes any other.
_SCALAR_TYPES: dict[type, tuple[type, ...]] = {
    serializers.IntegerField: (int,),
    serializers.FloatField: (int, float),
    serializers.BooleanField: (bool,),
}
# What DRF's ProhibitSurrogateCharactersValidator refuses, found by one search.
_SURROGATE = re.compile("[\ud800-\udfff]")


class ElementSerializer(serializers.Serializer):
    """One heartbeat element kind; as a list, its bad elements are dropped and counted.

    DRF checks an element field by field, through each field's empty-value, conversion and
    validator calls: for a GPU sample, and for a busy node's container, usage, metric and log
    reports, that cost more server time than the rest of the heartbeat. An element whose every
    value already has its JSON type and passes its field's checks is checked here in one pass
    and gets what DRF gives (the fields' defaults for what is missing); anything else (a number
    sent as a string, a required value missing, a value out of range, NaN, a text to strip)
    goes through DRF's own path and gets DRF's own message.
    tests/provisioning/test_agent_schema.py compares the two on generated elements."""

    _plan: list[tuple] | None = None

    class Meta:
        list_serializer_class = DroppingListSerializer

    def run_validation(self, data: Any = serializers.empty) -> Any:
        if type(data) is dict:
            if self._plan is None:
                self._plan = _scalar_plan(self)
            if self._plan:
                checked = _scalar_checked(self._plan, data)
                if (
                    checked is not None
                    and type(self).validate is not serializers.Serializer.validate
                ):
                    try:
                        checked = self.validate(checked)
                    except serializers.ValidationError:
                        checked = None  # DRF's path says why
                if checked is not None:
                    return checked
        return super().run_validation(data)


_NUMBER, _TEXT, _UUID, _CHOICE, _EMPTY_LIST = range(5)


def _scalar_plan(serializer: serializers.Serializer) -> list[tuple]:
    """(name, kind, allow_null, default, *kind's checks) per field; empty where one pass cannot
    give DRF's answer (a field of another kind or with validators of its own, or a serializer
    with validators or validate_<field> methods)."""
    if serializer.validators:
        return []
    plan = []
    for name, field in serializer.fields.items():
        if field.read_only or field.source != name or hasattr(serializer, f"validate_{name}"):
            return []
        entry = _field_plan(field)
        if entry is None:
            return []
        default = serializers.empty if field.required else field.default
        if getattr(default, "requires_context", False):
            return []
        plan.append((name, entry[0], field.allow_null, default, *entry[1:]))
    return plan


def _field_plan(field: serializers.Field) -> tuple | None:
    """(kind, *checks) of one field, None for a field the one pass does not check."""
    kind = type(field)
    validators = len(field.validators)
    if kind in _SCALAR_TYPES:
        types = _SCALAR_TYPES[kind]
        low, high = getattr(field, "min_value", None), getattr(field, "max_value", None)
        bounds = [v for v in (low, high) if v is not None]
        if (types != (bool,) and len(bounds) != 2) or validators != len(bounds):
            return None
        return _NUMBER, types, low, high, types == (int, float)
    if kind in (serializers.CharField, ContainerTextField):
        if field.min_length is not None or validators != (field.max_length is not None) + 2:
            return None
        return (_TEXT, field.max_length, field.allow_blank, field.trim_whitespace,
                kind is ContainerTextField)  # fmt: skip
    if kind is serializers.UUIDField and not validators:
        return (_UUID,)
    if kind is serializers.ChoiceField and not validators:
        return _CHOICE, field.choice_strings_to_values
    if isinstance(field, serializers.ListSerializer) and field.allow_empty and not validators:
        return (_EMPTY_LIST,)  # only an empty list is checked here
    return None


def _scalar_checked(plan: list[tuple], data: dict) -> dict | None:
    """The validated element, or None for DRF's path to answer (`plan` is not empty)."""
    checked = {}
    for name, kind, allow_null, default, *checks in plan:
        if name not in data:
            if default is serializers.empty:
                return None  # required (DRF names it), or left out with no default
            checked[name] = default() if callable(default) else default
            continue
        value = data[name]
        if value is None:
            if not allow_null:
                return None
        elif kind is _NUMBER:
            types, low, high, as_float = checks
            if type(value) not in types:
                return None
            if low is not None and not low <= value <= high:
                return None  # NaN too: it compares false (and an infinity is out of bounds)
            if as_float:
                value = float(value)
        elif kind is _TEXT:
            max_length, allow_blank, trim, sanitize = checks
            if type(value) is not str:
                return None
            if trim:
                value = value.strip()
            if not value:
                if not allow_blank:
                    return None
            else:
                if sanitize:
                    value = text_sanitize(value)
                elif "\x00" in value or _SURROGATE.search(value):
                    return None
                if max_length is not None and len(value) > max_length:
                    return None
        elif kind is _UUID:
            if type(value) is not str:
                return None
            try:
                value = uuid.UUID(hex=value)
            except ValueError:
                return None
        elif kind is _CHOICE:
            if type(value) is not str or not value or value not in checks[0]:
                return None
            value = checks[0][value]
        elif value != [] or type(value) is not list:  # _EMPTY_LIST
            return None
        checked[name] = value
    return checked


# What one host can have, with room to spare; a report beyond it is not a host we list.
class HostSerializer(serializers.Serializer):
    cpu_cores = serializers.IntegerField(min_value=1, max_value=1024)
    ram_gb = serializers.IntegerField(min_value=1, max_value=64 * 1024)
    disk_gb = serializers.IntegerField(min_value=1, max_value=10_000_000)
    driver_version = serializers.CharField(max_length=40, allow_blank=True, default="")
    cuda_version = serializers.CharField(max_length=20, allow_blank=True, default="")


class ReportedGpuSerializer(serializers.Serializer):
    index = serializers.IntegerField(min_value=0, max_value=255)
    uuid = serializers.CharField(max_length=64)
    name = NameField(max_length=120)
    memory_mb = serializers.IntegerField(min_value=1024, max_value=1 << 20)
    topology_group = serializers.CharField(max_length=40, allow_blank=True, default="")


class JoinSerializer(serializers.Serializer):
    join_token = serializers.CharField(max_length=200)
    hostname = serializers.RegexField(r"^[A-Za-z0-9][A-Za-z0-9.-]{0,252}$")
    host = HostSerializer()
    gpus = ReportedGpuSerializer(many=True, max_length=MAX_GPUS, allow_empty=False)
    simulated = serializers.BooleanField(default=False)
    # A secret the host keeps across attempts: repeating a join it never heard the answer to
    # gets it the same node. Agents that predate it send none and cannot repeat a join.
    host_key = serializers.RegexField(r"^[A-Za-z0-9_-]{32,128}$", required=False, default="")
    # What the agent can run (agents that predate these said nothing: docker, with SSH).
    runtime = serializers.ChoiceField(choices=["docker", "process"], required=False, default="")
    ssh = serializers.BooleanField(required=False, default=True)
    # Whether its packet filter keeps a rental with internet to the public internet (agents
    # that predate it said nothing: unable).
    internet_filtered = serializers.BooleanField(required=False, default=False)
    # The address the other members of a multi-node rental reach this node on; the address the
    # join came from when absent.
    fabric_address = serializers.IPAddressField(required=False, default=None, allow_null=True)
    # The provider's cluster to join the node into, by name; created when the interconnect and
    # its bandwidth are given too. Agents that predate clusters send none.
    cluster = serializers.RegexField(
        r"^[a-z0-9]([a-z0-9-]{0,38}[a-z0-9])?$", required=False, default=None, allow_null=True
    )
    interconnect = serializers.ChoiceField(
        choices=Interconnect.choices, required=False, default=None, allow_null=True
    )
    interconnect_gbps = serializers.IntegerField(
        min_value=1, max_value=CLUSTER_GBPS_MAX, required=False, default=None, allow_null=True
    )
    # The image patterns the agent accepts (agents that predate it send none: any image).
    image_allow = ImageAllowField(required=False, default=None, allow_null=True)


class PublishedPortSerializer(serializers.Serializer):
    container_port = serializers.IntegerField(min_value=1, max_value=65535)
    host = serializers.RegexField(r"^[A-Za-z0-9.:\[\]-]{1,253}$", help_text="name or address")
    host_port = serializers.IntegerField(min_value=1, max_value=65535)


class ContainerReportSerializer(ElementSerializer):
    rental_id = serializers.UUIDField()
    run_id = serializers.CharField(max_length=128)
    status = serializers.ChoiceField(choices=[status.value for status in ContainerStatus])
    exit_code = serializers.IntegerField(
        min_value=-INT32_MAX - 1, max_value=INT32_MAX, allow_null=True, required=False, default=None
    )
    started_at = _epoch(allow_null=True, required=False, default=None)
    finished_at = _epoch(allow_null=True, required=False, default=None)
    log_tail = ContainerTextField(
        max_length=8192, allow_blank=True, required=False, default="", trim_whitespace=False
    )
    # Ports of the run reachable from outside the node (SSH), once they listen.
    published = PublishedPortSerializer(many=True, max_length=16, required=False, default=list)
    # Why the agent could not start the run at all (bad image, a runtime that cannot run it).
    error = ContainerTextField(max_length=500, allow_blank=True, required=False, default="")


class PullProgressSerializer(ElementSerializer):
    rental_id = serializers.UUIDField()
    run_id = serializers.CharField(max_length=128)
    done_bytes = serializers.IntegerField(min_value=0, max_value=1 << 50)
    total_bytes = serializers.IntegerField(min_value=0, max_value=1 << 50)


class CachedImageSerializer(ElementSerializer):
    ref = serializers.CharField(max_length=255)
    digest = serializers.CharField(max_length=100, allow_blank=True, required=False, default="")
    size_bytes = serializers.IntegerField(min_value=0, max_value=1 << 50, required=False, default=0)


class UsageReportSerializer(ElementSerializer):
    seq = serializers.IntegerField(min_value=1, max_value=(1 << 63) - 1)
    rental_id = serializers.UUIDField()
    run_id = serializers.CharField(max_length=128)
    gpu_count = serializers.IntegerField(min_value=1, max_value=MAX_GPUS)
    started_at = _epoch()
    confirmed_at = _epoch()
    final = serializers.BooleanField(default=False)

    def validate(self, attrs):
        if attrs["confirmed_at"] < attrs["started_at"]:
            raise serializers.ValidationError({"confirmed_at": ["before started_at"]})
        return attrs


class TelemetrySerializer(ElementSerializer):
    gpu_index = serializers.IntegerField(min_value=0, max_value=255)
    ts = _epoch()
    util_pct = serializers.FloatField(min_value=0, max_value=100)
    mem_used_mb = serializers.IntegerField(min_value=0, max_value=1 << 24)
    power_w = serializers.FloatField(min_value=0, max_value=100_000)
    temp_c = serializers.FloatField(min_value=-273, max_value=1000)
    ecc_errors = serializers.IntegerField(
        min_value=0, max_value=INT32_MAX, required=False, default=0
    )
    xid_errors = serializers.IntegerField(
        min_value=0, max_value=INT32_MAX, required=False, default=0
    )
    healthy = serializers.BooleanField(required=False, default=True)
    fatal_xid = serializers.IntegerField(
        min_value=0, max_value=INT32_MAX, required=False, default=0
    )
    remap_failed = serializers.BooleanField(required=False, default=False)
    retire_pending = serializers.BooleanField(required=False, default=False)
    throttle_reasons = serializers.IntegerField(
        min_value=0, max_value=(1 << 63) - 1, required=False, default=0
    )
    pcie_width = serializers.IntegerField(min_value=0, max_value=64, required=False, default=0)
    pcie_width_max = serializers.IntegerField(min_value=0, max_value=64, required=False, default=0)
    pcie_gen = serializers.IntegerField(min_value=0, max_value=16, required=False, default=0)
    pcie_gen_max = serializers.IntegerField(min_value=0, max_value=16, required=False, default=0)
    lost = serializers.BooleanField(required=False, default=False)


class MetricLineSerializer(ElementSerializer):
    rental_id = serializers.UUIDField()
    run_id = serializers.CharField(max_length=128)
    line = serializers.CharField(max_length=4096)


class LogLineSerializer(ElementSerializer):
    rental_id = serializers.UUIDField()
    run_id = serializers.CharField(max_length=128)
    line_no = serializers.IntegerField(min_value=0, max_value=(1 << 63) - 1)
    line = ContainerTextField(max_length=4096, allow_blank=True, trim_whitespace=False)


class BenchmarkSerializer(serializers.Serializer):
    """A finished benchmark (the harness's benchmark mode); the whole result is kept as `raw`."""

    matmul_tflops = serializers.FloatField(min_value=0, max_value=1e12)
    precision = serializers.CharField(max_length=8, allow_blank=True, default="")
    device_name = NameField(max_length=120, allow_blank=True, default="")
    mem_bandwidth_gbs = serializers.FloatField(
        min_value=0, max_value=1e9, allow_null=True, default=None
    )
    h2d_gbs = serializers.FloatField(min_value=0, max_value=1e9, allow_null=True, default=None)
    train_samples_per_s = serializers.FloatField(
        min_value=0, max_value=1e12, allow_null=True, default=None
    )

    dropped = 0

    def run_validation(self, data: Any = serializers.empty) -> Any:
        """A bad benchmark is dropped and counted, like any other heartbeat element."""
        try:
            return super().run_validation(data)
        except serializers.ValidationError:
            self.dropped = 1
            return None

    def validate_matmul_tflops(self, value: float) -> float:
        if value <= 0:
            raise serializers.ValidationError("must be positive")
        return value

    def to_internal_value(self, data: Any) -> dict:
        return {**super().to_internal_value(data), "raw": json_sanitize(data)}


# Validated by this thread's instance (`for_data`, core.api.reuse): its field tree is
# about fifty fields.
class HeartbeatSerializer(ReusedPerThread, serializers.Serializer):
    """A heartbeat."""

    agent_version = serializers.CharField(max_length=40, required=False, default="")
    sent_at = _epoch(required=False)
    telemetry = TelemetrySerializer(
        many=True, max_length=4 * MAX_GPUS, required=False, default=list
    )
    containers = ContainerReportSerializer(many=True, max_length=256, required=False, default=list)
    usage = UsageReportSerializer(many=True, max_length=5000, required=False, default=list)
    metrics = MetricLineSerializer(many=True, max_length=500, required=False, default=list)
    logs = LogLineSerializer(many=True, max_length=1000, required=False, default=list)
    benchmark = BenchmarkSerializer(required=False, allow_null=True, default=None)
    pulls = PullProgressSerializer(many=True, max_length=256, required=False, default=list)
    # Only when changed (null or absent: unchanged).
    image_allow = ImageAllowField(required=False, default=None, allow_null=True)
    images = CachedImageSerializer(
        many=True, max_length=MAX_CACHED_IMAGES, required=False, default=None, allow_null=True
    )
    # The digest of the desired state the agent holds (agents that predate it send none).
    desired_digest = serializers.CharField(
        max_length=64, allow_blank=True, required=False, default=""
    )

    # The element fields whose bad elements are dropped and counted.
    ELEMENTS = (
        "telemetry", "containers", "usage", "metrics", "logs", "benchmark", "pulls", "images",
    )  # fmt: skip

    def forget(self) -> None:
        for name in self.ELEMENTS:
            self.fields[name].dropped = 0

    def dropped(self) -> dict[str, int]:
        """After validation: how many elements of each kind were dropped."""
        counts = {name: self.fields[name].dropped for name in self.ELEMENTS}
        return {name: count for name, count in counts.items() if count}


class JoinAnswerSerializer(serializers.Serializer):
    node_id = serializers.IntegerField()
    node_token = serializers.CharField(help_text="shown this once")
    heartbeat_interval_s = serializers.FloatField()


class StagedFileSerializer(serializers.Serializer):
    path = serializers.CharField()
    url = serializers.CharField(help_text="a presigned GET with a short expiry")
    sha256 = serializers.CharField()
    size_bytes = serializers.IntegerField()


class DatasetMountSerializer(serializers.Serializer):
    dataset_id = serializers.UUIDField()
    name = serializers.CharField(help_text="mounted read-only at /data/<name>")
    files = StagedFileSerializer(many=True)


class SecretValueSerializer(serializers.Serializer):
    name = serializers.CharField()
    value = serializers.CharField(help_text="decrypted for the node that runs the rental only")
    env = serializers.CharField(required=False)
    file = serializers.CharField(required=False)


class RegistryAuthSerializer(serializers.Serializer):
    secret = serializers.CharField(help_text="the team secret the credentials come from")
    username = serializers.CharField()
    password = serializers.CharField()


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
    # Left out of the payload while empty (agentprotocol.OMIT_EMPTY).
    datasets = DatasetMountSerializer(many=True, required=False)
    resume_files = StagedFileSerializer(many=True, required=False)
    sync_artifacts = serializers.BooleanField()
    ssh_authorized_keys = serializers.ListField(
        child=serializers.CharField(),
        required=False,
        help_text="OpenSSH public key lines, when SSH was asked for",
    )
    network = serializers.ChoiceField(
        choices=[network.value for network in Network],
        help_text="internet: NAT, filtered to public addresses; internal: no egress",
    )
    secrets = SecretValueSerializer(
        many=True, required=False, help_text="the team secrets the run gets, with their values"
    )
    registry_auth = RegistryAuthSerializer(
        required=False, help_text="credentials the image is pulled with"
    )
    jupyter_token = serializers.CharField(
        required=False,
        help_text="the token of the JupyterLab to start on JUPYTER_PORT, when one was asked for",
    )


class BenchmarkSpecSerializer(serializers.Serializer):
    image = serializers.CharField()
    command = serializers.ListField(child=serializers.CharField())
    gpu_indices = serializers.ListField(child=serializers.IntegerField(), required=False)


class WakeChannelSerializer(serializers.Serializer):
    url = serializers.CharField(help_text="the wake server's long-poll URL (or a path here)")
    ticket = serializers.CharField(help_text="Authorization: Bearer <ticket>; expires")


class HeartbeatAnswerSerializer(serializers.Serializer):
    desired = DesiredRunSerializer(many=True)
    ack_usage_seq = serializers.IntegerField()
    heartbeat_interval_s = serializers.FloatField()
    run_benchmark = serializers.BooleanField()
    dropped = serializers.DictField(
        child=serializers.IntegerField(), help_text="report elements refused and dropped, by kind"
    )
    benchmark = BenchmarkSpecSerializer(
        required=False, help_text="the platform's benchmark to run, with run_benchmark"
    )
    desired_digest = serializers.CharField(
        required=False, help_text="names this desired state; sent back in the next heartbeat"
    )
    desired_unchanged = serializers.BooleanField(
        required=False,
        help_text="desired is empty: the state is the one held under the digest sent back",
    )
    wake = WakeChannelSerializer(
        required=False, help_text="where to hear of a change at once, when a wake server runs"
    )


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


class RunLogQuerySerializer(serializers.Serializer):
    after = serializers.IntegerField(
        required=False,
        min_value=0,
        max_value=(1 << 63) - 1,
        help_text="lines after this id (the `id` of the last line you have): for following",
    )
    tail = serializers.IntegerField(
        required=False, min_value=1, max_value=10_000, help_text="only the last N lines"
    )


class RunLogLineSerializer(serializers.Serializer):
    """One output line of the rental's container, in the order the agent read them."""

    id = serializers.IntegerField()
    run_id = serializers.CharField()
    line_no = serializers.IntegerField()
    line = serializers.CharField()
    received_at = serializers.DateTimeField()


class RunMetricSerializer(serializers.Serializer):
    """One line the harness printed, as it printed it, with when the server received it."""

    received_at = serializers.DateTimeField()

    def to_representation(self, row: dict) -> dict:
        return {**row["data"], "received_at": super().to_representation(row)["received_at"]}


# -- artifact sync ---------------------------------------------------------------------------------
# Paths are checked by the service (relative, no `..`, no NUL): a bad one refuses the request.

MAX_ARTIFACT_FILES = 1000
MAX_ARTIFACT_BYTES = 1 << 40


class ArtifactFileSerializer(serializers.Serializer):
    path = serializers.CharField(max_length=1024, trim_whitespace=False)
    size_bytes = serializers.IntegerField(min_value=0, max_value=MAX_ARTIFACT_BYTES)
    sha256 = serializers.RegexField(r"^[0-9a-f]{64}$")


class ArtifactUploadRequestSerializer(serializers.Serializer):
    run_id = serializers.CharField(max_length=128)
    files = ArtifactFileSerializer(many=True, max_length=MAX_ARTIFACT_FILES, allow_empty=False)


class ArtifactUploadSerializer(serializers.Serializer):
    path = serializers.CharField()
    url = serializers.CharField(required=False, help_text="a presigned PUT (single upload)")
    upload_id = serializers.CharField(required=False, help_text="a multipart upload")
    part_urls = serializers.ListField(child=serializers.CharField())
    part_size_bytes = serializers.IntegerField()
    skip = serializers.BooleanField(help_text="already stored with this sha256")
    expires_at = serializers.FloatField()


class ArtifactUploadAnswerSerializer(serializers.Serializer):
    uploads = ArtifactUploadSerializer(many=True)


class CommittedFileSerializer(serializers.Serializer):
    path = serializers.CharField(max_length=1024, trim_whitespace=False)
    size_bytes = serializers.IntegerField(min_value=0, max_value=MAX_ARTIFACT_BYTES)
    sha256 = serializers.RegexField(r"^[0-9a-f]{64}$")
    upload_id = serializers.CharField(max_length=1024, required=False, default="")
    etags = serializers.ListField(
        child=serializers.CharField(max_length=200), max_length=10_000, required=False, default=list
    )


class ArtifactCommitSerializer(serializers.Serializer):
    run_id = serializers.CharField(max_length=128)
    files = CommittedFileSerializer(many=True, max_length=MAX_ARTIFACT_FILES, allow_empty=False)
    reason = serializers.ChoiceField(
        choices=["", "checkpoint", "stop", "complete", "preempt", "fail"],
        required=False,
        default="",
    )


class ArtifactCommitAnswerSerializer(serializers.Serializer):
    stored = serializers.IntegerField()
    refused = serializers.DictField(child=serializers.CharField(), help_text="path -> why")
