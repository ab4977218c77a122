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
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Self

JOIN_PATH = "/api/agent/v1/join/"
HEARTBEAT_PATH = "/api/agent/v1/heartbeat/"

DEFAULT_STOP_GRACE_S = 30.0

# A field with this metadata is left out of the payload while empty ("" or None): the receiver's
# default is the same, and a report then says only what it has to say.
OMIT_EMPTY: Mapping[str, bool] = types.MappingProxyType({"omit_empty": True})


class ProtocolError(ValueError):
    """A payload that is not the message it should be; `field` names the offending field."""

    def __init__(self, message: str, field: str, why: str) -> None:
        super().__init__(f"bad {message}: {field}: {why}"[:500])
        self.message = message
        self.field = field
        self.why = why


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
            if f.metadata.get("omit_empty") and value in ("", None):
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
    for name, (hint, required) in _fields(cls).items():
        if name not in payload:
            if required:
                raise ProtocolError(cls.wire_name, name, "missing")
            continue
        try:
            values[name] = _load(hint, payload[name])
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


def _load(hint: Any, value: Any) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return value
    if origin in (types.UnionType, typing.Union):  # only `T | None` is used
        if value is None:
            return None
        (inner,) = (arg for arg in args if arg is not type(None))
        return _load(inner, value)
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise _Bad(f"expected a list, got {type(value).__name__}")
        items = []
        for index, item in enumerate(value):
            try:
                items.append(_load(args[0], item))
            except _Bad as exc:
                raise _Bad(exc.why, f"[{index}]{exc.path}") from None
        return tuple(items)
    if origin is Mapping:
        if not isinstance(value, Mapping):
            raise _Bad(f"expected an object, got {type(value).__name__}")
        loaded = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise _Bad(f"expected string keys, got {type(key).__name__}")
            try:
                loaded[key] = _load(args[1], item)
            except _Bad as exc:
                raise _Bad(exc.why, f"[{key!r}]{exc.path}") from None
        return loaded
    if isinstance(hint, type) and issubclass(hint, Message):
        try:
            return hint.from_payload(value)
        except ProtocolError as exc:
            raise _Bad(exc.why, f".{exc.field}") from None
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        try:
            return hint(value)
        except ValueError:
            raise _Bad(f"{value!r} is not one of {', '.join(m.value for m in hint)}") from None
    if hint is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif isinstance(value, hint):  # str, bool
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
class Heartbeat(Message):
    """What the agent sends every round: its runs' actual state and what they used."""

    wire_name: ClassVar[str] = "heartbeat"

    agent_version: str = ""
    sent_at: float | None = dataclasses.field(default=None, metadata=OMIT_EMPTY)
    telemetry: tuple[GpuSample, ...] = ()
    containers: tuple[ContainerReport, ...] = ()
    usage: tuple[UsageReport, ...] = ()
    metrics: tuple[MetricLine, ...] = ()
    # A finished benchmark's result (the harness's benchmark mode prints it).
    benchmark: Mapping[str, Any] | None = dataclasses.field(default=None, metadata=OMIT_EMPTY)


# -- heartbeat: server to agent ------------------------------------------------------------------


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


__all__ = [
    "DEFAULT_STOP_GRACE_S",
    "HEARTBEAT_PATH",
    "JOIN_PATH",
    "ContainerReport",
    "ContainerStatus",
    "DesiredRun",
    "GpuInfo",
    "GpuSample",
    "Heartbeat",
    "HeartbeatAnswer",
    "JoinAnswer",
    "Message",
    "MetricLine",
    "ProtocolError",
    "UsageReport",
]
