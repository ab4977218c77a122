"""The agent API's messages: the one definition of what the node agent and the server exchange.

Both ends import this module (the server under Django, the agent on GPU hosts without it), so it
uses the standard library only. Each message is a frozen dataclass; `to_payload()` gives its
JSON object and `from_payload()` parses one, checking every field's type and raising
`ProtocolError` (a ValueError) that names the field. Keys a message does not know are ignored,
so either end may add a field before the other reads it; a missing key takes the field's
default, and is an error when the field has none.

The server's DRF serializers stay the validation layer at its HTTP edge (size limits, ranges);
tests/provisioning/test_agent_schema.py keeps their fields equal to these messages' fields.
Text a container printed is untrusted: `agentprotocol.untrusted` bounds and cleans it, the same
way at both ends.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import types
import typing
import uuid
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Self

JOIN_PATH = "/api/agent/v1/join/"
HEARTBEAT_PATH = "/api/agent/v1/heartbeat/"
# Artifact sync (agent -> server): ask for presigned upload URLs for files of a rental's output
# directory, then commit what was uploaded. `{rental_id}` is the rental's public id; the server
# answers 404 unless that rental currently runs on the calling node.
ARTIFACT_UPLOADS_PATH = "/api/agent/v1/rentals/{rental_id}/artifacts/uploads/"
ARTIFACT_COMMIT_PATH = "/api/agent/v1/rentals/{rental_id}/artifacts/commit/"

DEFAULT_STOP_GRACE_S = 30.0

# A field with this metadata is left out of the payload while empty ("", None or ()): the
# receiver's default is the same, and a report then says only what it has to say.
OMIT_EMPTY: Mapping[str, bool] = types.MappingProxyType({"omit_empty": True})
# A field with this metadata is left out while it equals its default (a health signal that
# shows nothing wrong): every GPU sample of a healthy node stays as short as before.
OMIT_DEFAULT: Mapping[str, bool] = types.MappingProxyType({"omit_default": True})


class ProtocolError(ValueError):
    """A payload that is not the message it should be; `field` names the offending field."""

    def __init__(self, message: str, field: str, why: str) -> None:
        super().__init__(f"bad {message}: {field}: {why}"[:500])
        self.message = message
        self.field = field
        self.why = why


class Network(enum.StrEnum):
    """What a rental's network reaches: the public internet only (NAT, with every private,
    link-local and metadata range and the host dropped by the node's packet filter), or
    nothing outside the rental."""

    INTERNET = "internet"
    INTERNAL = "internal"


class ContainerStatus(enum.StrEnum):
    """A run's state as the runtime sees it and the agent reports it."""

    RUNNING = "running"
    EXITED = "exited"
    CREATED = "created"  # created, never started
    MISSING = "missing"  # not in the runtime (never started, removed, or cannot start)


class Message:
    """Payload conversion for the dataclasses below, driven by their field annotations."""

    __slots__ = ()
    wire_name: ClassVar[str]

    def to_payload(self) -> dict[str, Any]:
        payload = {}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if f.metadata.get("omit_empty") and value in ("", None, ()):
                continue
            if f.metadata.get("omit_default") and value == f.default:
                continue
            payload[f.name] = _dump(value)
        return payload

    @classmethod
    def from_payload(cls, payload: Any) -> Self:
        return _parse(cls, payload)


def _parse(cls: type[_M], payload: Any) -> _M:
    if not isinstance(payload, Mapping):
        raise ProtocolError(cls.wire_name, "(payload)", "must be an object")
    values = {}
    for name, load, required in _field_loaders(cls):
        if name not in payload:
            if required:
                raise ProtocolError(cls.wire_name, name, "missing")
            continue
        try:
            values[name] = load(payload[name])
        except _Bad as exc:
            raise ProtocolError(cls.wire_name, name + exc.path, exc.why) from None
    return cls(**values)


_M = typing.TypeVar("_M", bound=Message)


class _Bad(Exception):
    def __init__(self, why: str, path: str = "") -> None:
        self.why = why
        self.path = path


@functools.cache
def _fields(cls: type) -> dict[str, tuple[Any, bool]]:
    """name -> (resolved type, required) of a message class."""
    hints = typing.get_type_hints(cls)
    return {
        f.name: (
            hints[f.name],
            f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING,
        )
        for f in dataclasses.fields(cls)
    }


@functools.cache
def _field_loaders(cls: type) -> tuple[tuple[str, Callable[[Any], Any], bool], ...]:
    """(name, loader, required) per field of a message class: what each field's annotation
    asks of a value is worked out once per class, not once per value (a busy node's heartbeat
    holds dozens of reports)."""
    return tuple((name, _loader(hint), required) for name, (hint, required) in _fields(cls).items())


@functools.cache
def _loader(hint: Any) -> Callable[[Any], Any]:
    """The function that loads a value of type `hint`, raising _Bad when it is not one."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return _same
    if origin in (types.UnionType, typing.Union):  # only `T | None` is used
        (inner,) = (arg for arg in args if arg is not type(None))
        load_inner = _loader(inner)
        return lambda value: None if value is None else load_inner(value)
    if origin is tuple:
        return functools.partial(_load_tuple, _loader(args[0]))
    if origin is Mapping:
        return functools.partial(_load_mapping, _loader(args[1]))
    if isinstance(hint, type) and issubclass(hint, Message):
        return functools.partial(_load_message, hint)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return functools.partial(_load_enum, hint)
    if hint is float:
        return _load_float
    if hint is int:
        return _load_int
    return functools.partial(_load_instance, hint)  # str, bool


def _same(value: Any) -> Any:
    return value


def _load_tuple(load: Callable[[Any], Any], value: Any) -> tuple:
    if not isinstance(value, list | tuple):
        raise _Bad(f"expected a list, got {type(value).__name__}")
    items = []
    for index, item in enumerate(value):
        try:
            items.append(load(item))
        except _Bad as exc:
            raise _Bad(exc.why, f"[{index}]{exc.path}") from None
    return tuple(items)


def _load_mapping(load: Callable[[Any], Any], value: Any) -> dict:
    if not isinstance(value, Mapping):
        raise _Bad(f"expected an object, got {type(value).__name__}")
    loaded = {}
    for key, item in value.items():
        if not isinstance(key, str):
            raise _Bad(f"expected string keys, got {type(key).__name__}")
        try:
            loaded[key] = load(item)
        except _Bad as exc:
            raise _Bad(exc.why, f"[{key!r}]{exc.path}") from None
    return loaded


def _load_message(hint: type[Message], value: Any) -> Message:
    try:
        return hint.from_payload(value)
    except ProtocolError as exc:
        raise _Bad(exc.why, f".{exc.field}") from None


def _load_enum(hint: type[enum.Enum], value: Any) -> enum.Enum:
    try:
        return hint(value)
    except ValueError:
        raise _Bad(f"{value!r} is not one of {', '.join(m.value for m in hint)}") from None


def _load_float(value: Any) -> float:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    raise _Bad(f"expected float, got {type(value).__name__}")


def _load_int(value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise _Bad(f"expected int, got {type(value).__name__}")


def _load_instance(hint: type, value: Any) -> Any:
    if isinstance(value, hint):
        return value
    raise _Bad(f"expected {hint.__name__}, got {type(value).__name__}")


def _dump(value: Any) -> Any:
    if isinstance(value, Message):
        return value.to_payload()
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, Mapping):
        return {key: _dump(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_dump(item) for item in value]
    return value


# Xids that mean the GPU itself is faulty (NVIDIA's "Xid Errors" catalog), so it must leave
# placement: double-bit ECC (48), micro-controller halt (61, 62), row-remap failure (64),
# NVLink error (74), fallen off the bus (79), high single-bit ECC rate (92), contained and
# uncontained ECC (94, 95), GSP errors (119, 120). Application faults (13, 31, 43, 45) are not.
# The agent reports the first it sees (`GpuSample.fatal_xid`); the server judges it by this list.
FATAL_XIDS = frozenset({48, 61, 62, 64, 74, 79, 92, 94, 95, 119, 120})

# NVML's clocks-event reasons that mean the hardware is held back (the rest, idle, an
# application clock setting, the power cap under load, sync boost, are normal operation):
# HW slowdown, SW and HW thermal slowdown, HW power brake.
HARDWARE_THROTTLE_REASONS = {
    0x8: "hardware slowdown",
    0x20: "thermal slowdown",
    0x40: "hardware thermal slowdown",
    0x80: "power brake",
}


# -- join ----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class GpuInfo(Message):
    """One GPU as the join request describes it."""

    wire_name: ClassVar[str] = "gpu"

    index: int
    uuid: str
    name: str  # NVML's device name, or the catalog slug for simulated GPUs
    memory_mb: int
    # GPUs sharing a non-empty group are connected by NVLink (directly or through NVSwitch);
    # "" means the GPU has no NVLink peer.
    topology_group: str = ""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class JoinAnswer(Message):
    """The server's answer to a join: the node's id and its token (shown this once)."""

    wire_name: ClassVar[str] = "join answer"

    node_id: int
    node_token: str
    heartbeat_interval_s: float


# -- heartbeat: agent to server ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class GpuSample(Message):
    """One reading of one GPU (the heartbeat's `telemetry` items)."""

    wire_name: ClassVar[str] = "telemetry sample"

    gpu_index: int
    ts: float
    util_pct: float
    mem_used_mb: int
    power_w: float
    temp_c: float
    ecc_errors: int = 0  # volatile (since driver load) uncorrected ECC errors
    xid_errors: int = 0  # critical Xid events seen since the agent started
    healthy: bool = True
    # Health signals (protocol 2; an older agent sends none and the server reads the defaults,
    # "nothing wrong seen"). The server decides what they mean (provisioning/services/health).
    # The first Xid of NVIDIA's hardware list seen since the agent started, 0 for none.
    fatal_xid: int = dataclasses.field(default=0, metadata=OMIT_DEFAULT)
    # Row remapping failed (the memory cannot be repaired in place) / remaps or page
    # retirements pending (repaired at the next GPU reset).
    remap_failed: bool = dataclasses.field(default=False, metadata=OMIT_DEFAULT)
    retire_pending: bool = dataclasses.field(default=False, metadata=OMIT_DEFAULT)
    # NVML's clocks-event reasons bitmask (nvmlClocksThrottleReason*), as read.
    throttle_reasons: int = dataclasses.field(default=0, metadata=OMIT_DEFAULT)
    # The PCIe link: current width and the card's, the generation the slot allows and the
    # card's (the current generation drops at idle to save power, so it is not compared).
    # 0: unknown.
    pcie_width: int = dataclasses.field(default=0, metadata=OMIT_DEFAULT)
    pcie_width_max: int = dataclasses.field(default=0, metadata=OMIT_DEFAULT)
    pcie_gen: int = dataclasses.field(default=0, metadata=OMIT_DEFAULT)
    pcie_gen_max: int = dataclasses.field(default=0, metadata=OMIT_DEFAULT)
    # NVML answers GPU_IS_LOST: the GPU fell off the bus.
    lost: bool = dataclasses.field(default=False, metadata=OMIT_DEFAULT)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class PublishedPort(Message):
    """A port of a run's container that the node publishes: `host:host_port` reaches
    `container_port` inside the container."""

    wire_name: ClassVar[str] = "published port"

    container_port: int
    host: str  # the node's public address (name or IP) as the agent is configured to announce it
    host_port: int


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ContainerReport(Message):
    """The actual state of one run on the node (the heartbeat's `containers` items)."""

    wire_name: ClassVar[str] = "container report"

    rental_id: str
    run_id: str
    status: ContainerStatus
    exit_code: int | None = None
    started_at: float | None = None  # unix time
    finished_at: float | None = None
    log_tail: str = dataclasses.field(default="", metadata=OMIT_EMPTY)  # of an exited run
    # Ports of the run reachable from outside the node (SSH, Jupyter), once they listen.
    published: tuple[PublishedPort, ...] = dataclasses.field(default=(), metadata=OMIT_EMPTY)
    # Why the agent could not start the run at all (bad image, a runtime that cannot run it).
    error: str = dataclasses.field(default="", metadata=OMIT_EMPTY)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class UsageReport(Message):
    """A run was seen using its GPUs from started_at to confirmed_at (the `usage` items).

    seq is monotonic per node; the server applies reports idempotently by (node, seq) and
    acknowledges the highest seq it handled. `final`: the run has ended, no later report comes.
    """

    wire_name: ClassVar[str] = "usage report"

    seq: int
    rental_id: str
    run_id: str
    gpu_count: int
    started_at: float  # unix time
    confirmed_at: float
    final: bool = False


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class MetricLine(Message):
    """One JSON line a run printed, forwarded as a metric (the `metrics` items)."""

    wire_name: ClassVar[str] = "metric line"

    rental_id: str
    run_id: str
    line: str


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class LogLine(Message):
    """One line of a run's own output (not a metric), for the live log. `line_no` is the line's
    index in the run's output, from 0: a line sent twice is kept once, and a gap in the numbers
    shows where the agent dropped lines it could not hold."""

    wire_name: ClassVar[str] = "log line"

    rental_id: str
    run_id: str
    line_no: int
    line: str


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class PullProgress(Message):
    """A run whose image is being pulled before its start (the `pulls` items): bytes of its
    layers downloaded so far and in all, as the registry announced them (the total grows while
    layers are still being discovered)."""

    wire_name: ClassVar[str] = "pull progress"

    rental_id: str
    run_id: str
    done_bytes: int
    total_bytes: int


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class CachedImage(Message):
    """An image the node holds in its cache (the `images` items): its normalized reference
    (agentprotocol.images), the engine's id and its size."""

    wire_name: ClassVar[str] = "cached image"

    ref: str
    digest: str = ""
    size_bytes: int = 0


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Heartbeat(Message):
    """What the agent sends every round: its runs' actual state and what they used."""

    wire_name: ClassVar[str] = "heartbeat"

    agent_version: str = ""
    sent_at: float | None = dataclasses.field(default=None, metadata=OMIT_EMPTY)
    telemetry: tuple[GpuSample, ...] = ()
    containers: tuple[ContainerReport, ...] = ()
    usage: tuple[UsageReport, ...] = ()
    metrics: tuple[MetricLine, ...] = ()
    logs: tuple[LogLine, ...] = dataclasses.field(default=(), metadata=OMIT_EMPTY)
    # A finished benchmark's result (the harness's benchmark mode prints it).
    benchmark: Mapping[str, Any] | None = dataclasses.field(default=None, metadata=OMIT_EMPTY)
    # Images being pulled for runs about to start.
    pulls: tuple[PullProgress, ...] = dataclasses.field(default=(), metadata=OMIT_EMPTY)
    # Sent only when they changed since the server last took them (None: unchanged): the
    # images the agent accepts (allow-list patterns) and the images it holds.
    image_allow: tuple[str, ...] | None = dataclasses.field(default=None, metadata=OMIT_DEFAULT)
    images: tuple[CachedImage, ...] | None = dataclasses.field(default=None, metadata=OMIT_DEFAULT)
    # The `desired_digest` of the last answer whose desired state the agent holds ("": none,
    # an agent that just started): the server may then answer `desired_unchanged`.
    desired_digest: str = dataclasses.field(default="", metadata=OMIT_EMPTY)


# -- heartbeat: server to agent ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class StagedFile(Message):
    """A file the agent puts in place before the run starts: part of a dataset, or a checkpoint
    to resume from. `url` is a presigned GET with a short expiry; `sha256` is the content hash,
    the key of the node's cache and the check of what was downloaded. `path` is relative (the
    agent refuses absolute paths and `..`)."""

    wire_name: ClassVar[str] = "staged file"

    path: str
    url: str
    sha256: str
    size_bytes: int


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class DatasetMount(Message):
    """A dataset the run reads: staged before start, mounted read-only at /data/<name>."""

    wire_name: ClassVar[str] = "dataset mount"

    dataset_id: str
    name: str
    files: tuple[StagedFile, ...]


# Where the JupyterLab of a run with a `jupyter_token` listens in its container (loopback).
JUPYTER_PORT = 8888


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class SecretValue(Message):
    """A team secret the run uses, decrypted for the node that runs it: as the environment
    variable `env`, or as the read-only file `file` (an absolute path under /run/secrets), or
    both. Never written into the image, never logged; what the run prints is masked with it."""

    wire_name: ClassVar[str] = "secret"

    name: str
    value: str = dataclasses.field(repr=False)
    env: str = dataclasses.field(default="", metadata=OMIT_EMPTY)
    file: str = dataclasses.field(default="", metadata=OMIT_EMPTY)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RegistryAuth(Message):
    """Credentials for pulling the run's image, from the team secret named `secret` (named in
    the reason when the registry refuses them)."""

    wire_name: ClassVar[str] = "registry auth"

    secret: str
    username: str
    password: str = dataclasses.field(repr=False)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class DesiredRun(Message):
    """A run the server wants on the node now: the rental's container on its allocated GPUs."""

    wire_name: ClassVar[str] = "desired entry"

    rental_id: str
    run_id: str
    image: str
    command: tuple[str, ...]
    env: Mapping[str, str]
    gpu_indices: tuple[int, ...]
    gpu_uuids: tuple[str, ...]
    cpu_limit: float
    memory_limit_mb: int
    ports: tuple[int, ...]
    stop_grace_s: float = DEFAULT_STOP_GRACE_S
    datasets: tuple[DatasetMount, ...] = dataclasses.field(default=(), metadata=OMIT_EMPTY)
    # Files written into the run's output directory (/workspace) before it starts: the last
    # synced checkpoint of the run it resumes (a requeued interruptible rental, or a rental
    # started from an earlier one's checkpoint).
    resume_files: tuple[StagedFile, ...] = dataclasses.field(default=(), metadata=OMIT_EMPTY)
    # Sync the output directory to object storage (ARTIFACT_UPLOADS_PATH / ARTIFACT_COMMIT_PATH)
    # at every checkpoint and when the run stops, completes, is preempted or fails.
    sync_artifacts: bool = False
    # Public keys (OpenSSH format) allowed into the run's sshd, when the rental asked for SSH.
    ssh_authorized_keys: tuple[str, ...] = dataclasses.field(default=(), metadata=OMIT_EMPTY)
    # The rental's network. A server that predates it names none: no egress, the safe reading.
    network: Network = Network.INTERNAL
    # The team secrets the rental names, with their values (only in the answer to the node
    # that runs it), and the credentials its image is pulled with.
    secrets: tuple[SecretValue, ...] = dataclasses.field(default=(), metadata=OMIT_EMPTY)
    registry_auth: RegistryAuth | None = dataclasses.field(default=None, metadata=OMIT_EMPTY)
    # The token of the JupyterLab the agent starts beside the command on JUPYTER_PORT, when the
    # rental asked for one ("": none).
    jupyter_token: str = dataclasses.field(default="", metadata=OMIT_EMPTY)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class BenchmarkSpec(Message):
    """The platform's benchmark, as the server pins it: the harness image and the command run
    in it, on these GPUs. The agent runs this and nothing the host configured instead."""

    wire_name: ClassVar[str] = "benchmark spec"

    image: str
    command: tuple[str, ...]
    gpu_indices: tuple[int, ...] = ()  # () for every GPU of the node


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class WakeChannel(Message):
    """Where the agent long-polls to hear at once that its desired state changed: a GET of
    `url` (absolute, or a path on the server URL) with `Authorization: Bearer <ticket>`,
    answered {"woken": true} as soon as the node is woken, {"woken": false} after `timeout`
    seconds (a query parameter, WAKE_POLL_MAX_S at most). Only a hint to heartbeat now: a
    wake-up lost costs the wait for the next heartbeat, nothing else. The ticket is signed by
    the server, names the node and expires; the next heartbeat answer brings a fresh one."""

    wire_name: ClassVar[str] = "wake channel"

    url: str
    ticket: str


WAKE_POLL_MAX_S = 60


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class HeartbeatAnswer(Message):
    """The server's answer to a heartbeat: the desired state and what it has received."""

    wire_name: ClassVar[str] = "heartbeat answer"

    desired: tuple[DesiredRun, ...]
    ack_usage_seq: int  # the highest usage seq handled; the agent drops reports up to it
    heartbeat_interval_s: float
    run_benchmark: bool  # measure the node (on join, or when ops ask for it)
    # Report elements the server refused and dropped, by kind ("containers", "usage",
    # "telemetry", "metrics", "benchmark"): the rest of the heartbeat was applied.
    dropped: Mapping[str, int] = dataclasses.field(default_factory=dict)
    # With run_benchmark: what to run (an older server sends none; the agent then runs the
    # harness's benchmark it ships with).
    benchmark: BenchmarkSpec | None = dataclasses.field(default=None, metadata=OMIT_EMPTY)
    # What names this desired state, for the agent to send back (Heartbeat.desired_digest);
    # "": the server keeps none. With `desired_unchanged` the server did not send the desired
    # state again (`desired` is empty): it is the one the agent holds under the digest it sent.
    # Only an agent that sent a digest is told so; an older agent always gets the whole state.
    desired_digest: str = dataclasses.field(default="", metadata=OMIT_EMPTY)
    desired_unchanged: bool = dataclasses.field(default=False, metadata=OMIT_DEFAULT)
    # Where to hear of the next change at once (None: no wake server; heartbeats alone).
    wake: WakeChannel | None = dataclasses.field(default=None, metadata=OMIT_EMPTY)

    @classmethod
    def from_payload(
        cls, payload: Any, *, on_bad_run: Callable[[ProtocolError], None] | None = None
    ) -> Self:
        """With `on_bad_run`, a desired entry that does not parse is handed to it and dropped
        instead of refusing the whole answer: one broken run must not stop the others."""
        entries = payload.get("desired") if isinstance(payload, Mapping) else None
        if on_bad_run is None or not isinstance(entries, list):
            return _parse(cls, payload)
        desired = []
        for entry in entries:
            try:
                desired.append(DesiredRun.from_payload(entry))
            except ProtocolError as exc:
                on_bad_run(exc)
        answer = _parse(cls, {**payload, "desired": []})
        return dataclasses.replace(answer, desired=tuple(desired))


# The most an agent waits on one Retry-After (a longer one is cut to this): a node silent for
# three intervals, or NODE_SILENCE_TIMEOUT_S, is taken offline.
RETRY_AFTER_MAX_S = 60.0


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class HeartbeatRefusal(Message):
    """The body of a heartbeat the server refused before any of its work (503, with
    `Retry-After` in whole seconds): the web process already serves its bound of heartbeats
    (Kubernetes' API priority and fairness, in its simplest form). Nothing of the heartbeat was
    applied; the agent does not resend it within the call, waits `retry_after_s` (seconds, to
    the millisecond: a turn the server booked for it, or a delay jittered over the interval so
    the refused nodes do not all come back at one instant; RETRY_AFTER_MAX_S at most) and from
    then on heartbeats every `heartbeat_interval_s` until an answer says otherwise."""

    wire_name: ClassVar[str] = "heartbeat refusal"

    detail: str
    retry_after_s: float
    heartbeat_interval_s: float


# -- artifact sync: agent to server --------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ArtifactFile(Message):
    """A file of a run's output directory, relative to it."""

    wire_name: ClassVar[str] = "artifact file"

    path: str
    size_bytes: int
    sha256: str


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ArtifactUploadRequest(Message):
    """Agent to server: presign uploads for these files (ones already stored with the same
    sha256 are answered with no URL and need no upload)."""

    wire_name: ClassVar[str] = "artifact upload request"

    run_id: str
    files: tuple[ArtifactFile, ...]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ArtifactUpload(Message):
    """Where to put one file: a single presigned PUT (`url`), or a multipart upload
    (`upload_id`, one presigned URL per part of `part_size_bytes`, the last part shorter)."""

    wire_name: ClassVar[str] = "artifact upload"

    path: str
    url: str = dataclasses.field(default="", metadata=OMIT_EMPTY)
    upload_id: str = dataclasses.field(default="", metadata=OMIT_EMPTY)
    part_urls: tuple[str, ...] = ()
    part_size_bytes: int = 0
    skip: bool = False  # already stored with this sha256: nothing to upload
    expires_at: float = 0.0  # unix time after which the URLs no longer work


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ArtifactUploadAnswer(Message):
    wire_name: ClassVar[str] = "artifact upload answer"

    uploads: tuple[ArtifactUpload, ...]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class CommittedFile(Message):
    """A file the agent finished uploading; for a multipart upload, the parts' ETags in order."""

    wire_name: ClassVar[str] = "committed file"

    path: str
    size_bytes: int
    sha256: str
    upload_id: str = dataclasses.field(default="", metadata=OMIT_EMPTY)
    etags: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ArtifactCommit(Message):
    """Agent to server: these uploads are done; the server checks each object (size) before it
    records it as an artifact of the rental."""

    wire_name: ClassVar[str] = "artifact commit"

    run_id: str
    files: tuple[CommittedFile, ...]
    reason: str = ""  # "checkpoint", "stop", "complete", "preempt", "fail"


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ArtifactCommitAnswer(Message):
    wire_name: ClassVar[str] = "artifact commit answer"

    stored: int
    refused: Mapping[str, str] = dataclasses.field(default_factory=dict)  # path -> why


# A simulated GPU's UUID, uuid5 of "hostname/index" in this namespace: stable across an agent's
# restarts and distinct across hosts. Both ends know it: the simulated agent reports it, and the
# dev stack's demo seed names the GPUs its hosts will report.
_SIMULATED_UUID_NAMESPACE = uuid.UUID("6f1d2c3e-9a4b-5c7d-8e9f-0a1b2c3d4e5f")


def simulated_gpu_uuid(hostname: str, index: int) -> str:
    return f"GPU-{uuid.uuid5(_SIMULATED_UUID_NAMESPACE, f'{hostname}/{index}')}"


__all__ = [
    "ARTIFACT_COMMIT_PATH",
    "ARTIFACT_UPLOADS_PATH",
    "DEFAULT_STOP_GRACE_S",
    "FATAL_XIDS",
    "HARDWARE_THROTTLE_REASONS",
    "HEARTBEAT_PATH",
    "JOIN_PATH",
    "RETRY_AFTER_MAX_S",
    "WAKE_POLL_MAX_S",
    "ArtifactCommit",
    "ArtifactCommitAnswer",
    "ArtifactFile",
    "ArtifactUpload",
    "ArtifactUploadAnswer",
    "ArtifactUploadRequest",
    "BenchmarkSpec",
    "CachedImage",
    "CommittedFile",
    "ContainerReport",
    "ContainerStatus",
    "DatasetMount",
    "DesiredRun",
    "GpuInfo",
    "GpuSample",
    "Heartbeat",
    "HeartbeatAnswer",
    "HeartbeatRefusal",
    "JoinAnswer",
    "LogLine",
    "Message",
    "MetricLine",
    "Network",
    "ProtocolError",
    "PublishedPort",
    "PullProgress",
    "RegistryAuth",
    "SecretValue",
    "StagedFile",
    "UsageReport",
    "WakeChannel",
    "simulated_gpu_uuid",
]
