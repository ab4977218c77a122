"""Docker Engine runtime driver (the `docker` SDK), the production runtime of the node agent.

Each run is one container named `gpumarket-<run_id>` carrying our labels, so a restarted agent
finds and adopts what runs.

Tenant isolation (nothing a rental's container does reaches another rental, the host or the LAN):

- network: each rental gets its own user-defined bridge network (`gpumarket-net-<rental>`,
  labelled like the containers, bridge interface `gpm-<hash>`), created at its first start and
  removed with its last container, shaped by the rental's own choice (`ContainerSpec.network`):
  - `internet` (the default of a rental): the public internet and nothing else. The engine
    NATs the bridge, and the driver installs, idempotently and before every network it makes,
    iptables rules in the engine's DOCKER-USER chain and in INPUT dropping everything from
    `gpm-*` bridges to private, carrier-grade NAT, loopback, link-local (169.254.169.254:
    cloud metadata), multicast and reserved ranges (the LAN, other rentals' bridges) and to
    the host itself (any of its addresses, the bridge's gateway included). This needs root,
    iptables with iptables-restore, and an engine that manages iptables (a DOCKER-USER chain);
    `internet_filter_unavailable` says why a host cannot, the agent declares the answer at
    join (`internet_filtered`), the server then places no internet rental there, and a start
    that still asks for it is refused, saying why. An agent configured with
    `internet_allowed=False` refuses internet runs whatever its engine can.
    tests/e2e/test_rental_network.py shows it on an engine that filters for real.
  - `internal`: no egress at all and no address of the host on the bridge (`inhibit_ipv4`),
    which holds even on engines without iptables (`dockerd --iptables=false`,
    deploy/docker-engine.sh): the container's only route leads to an address nobody has.
  The engine cannot publish ports of an internal network (a port needs a route to the host,
  which is exactly what is taken away): the agent publishes them itself, entering the
  container's network namespace from the host side (nodeagent/publish.py), for either kind.
  IPv6 is switched off inside every container (the private IPv6 ranges are thus unreachable
  too). A gang member's rental network is also the gang's private network across hosts: a
  VXLAN overlay between the members on the same bridge, filtered to them
  (nodeagent/runtime/gangnet.py).
- disk: the root filesystem is read-only with a size-limited tmpfs /tmp (charged to the memory
  limit), logs are rotated, and with `disk_quota_mb` the rental's workspace is an ext4 image of
  that size loop-mounted by the agent (root only), so a full disk is the rental's own ENOSPC.
- user: containers run as `container_user` (1000:1000) unless the image's allow-list entry names
  another, with every capability dropped, no-new-privileges and a pids limit; only images
  matching `image_allow` are run at all.

Every engine call has a timeout and goes through one retry policy: transient failures (engine
unreachable, timeouts, 5xx) are retried with bounded exponential backoff and surface as
RetryableRuntimeError; requests that cannot succeed (missing image, 4xx, runtime refusals, an
image outside the allow-list) surface at once as PermanentRuntimeError.
"""

from __future__ import annotations

import calendar
import contextlib
import hashlib
import logging
import math
import os
import random
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import docker
import docker.errors
import requests.exceptions
from docker.models.containers import Container
from docker.types import DeviceRequest, IPAMConfig, IPAMPool, LogConfig, Mount, Ulimit
from docker.utils import parse_repository_tag

from agentprotocol import ContainerStatus, Network, RegistryAuth
from agentprotocol.images import image_normalize, image_pattern_matches
from nodeagent.imagecache import HeldImage
from nodeagent.runtime import gangnet, jupyter
from nodeagent.runtime.base import (
    CONTAINER_SECRETS,
    LABEL_MANAGED,
    LABEL_NODE,
    LABEL_RENTAL,
    LABEL_RUN,
    ContainerSpec,
    ContainerState,
    ImageNotFoundError,
    PermanentRuntimeError,
    RetryableRuntimeError,
    RunNotFoundError,
    RuntimeDriverError,
    run_env,
    secret_files_remove,
    secret_files_write,
)
from nodeagent.runtime.sshd import LAUNCH_SCRIPT, SSH_PORT, launch_environment
from nodeagent.staging import workspace_delete, workspace_seed

logger = logging.getLogger(__name__)

T = TypeVar("T")

WORKSPACE = "/workspace"
DATA = "/data"  # the run's datasets, read-only (ContainerSpec.data_dir)

_STATUS_MAP = {
    "running": ContainerStatus.RUNNING,
    "paused": ContainerStatus.RUNNING,
    "restarting": ContainerStatus.RUNNING,
    "created": ContainerStatus.CREATED,
    "exited": ContainerStatus.EXITED,
    "dead": ContainerStatus.EXITED,
    "removing": ContainerStatus.EXITED,
}

# 5xx answers that retrying cannot fix: the runtime refused the container's configuration.
_PERMANENT_5XX_FRAGMENTS = (
    "executable file not found",
    "no such file or directory",
    "could not select device driver",
    "unknown or invalid runtime",
    "permission denied",
    "operation not permitted",
    "invalid argument",
    "oci runtime create failed",
    # A registry refusing a pull (missing or wrong credentials) answers the same every time.
    "no basic auth credentials",
    "unauthorized",
)


LABEL_VOLUME = "gpumarket.volume"  # on a rental network: the workspace mounted for the rental
LABEL_NETWORK = "gpumarket.network"  # on a rental network: internet or internal
LABEL_SECRETS = "gpumarket.secrets"  # on a container: its secret files' host directory
BRIDGE_PREFIX = "gpm-"
BRIDGE_OPTION = "com.docker.network.bridge.name"
EGRESS_CHAIN = "GPUMARKET-EGRESS"  # forwarded traffic leaving a rental bridge
HOST_CHAIN = "GPUMARKET-HOST"  # traffic from a rental bridge to the host itself
# Never reachable from a rental with internet: private networks (the LAN, other tenants' bridges),
# carrier-grade NAT, loopback, link-local (169.254.169.254: cloud metadata), multicast, reserved.
BLOCKED_RANGES_V4 = (
    "0.0.0.0/8",
    "10.0.0.0/8",
    "100.64.0.0/10",
    "127.0.0.0/8",
    "169.254.0.0/16",
    "172.16.0.0/12",
    "192.168.0.0/16",
    "224.0.0.0/4",
    "240.0.0.0/4",
)
# Namespaced sysctls: the container has no IPv6 at all, not even link-local addresses through
# which it could reach the host's bridge (fe80::/10) on an IPv4-only network.
NO_IPV6_SYSCTLS = {"net.ipv6.conf.all.disable_ipv6": "1", "net.ipv6.conf.default.disable_ipv6": "1"}
_COMMAND_TIMEOUT_S = 60.0


@dataclass(frozen=True, slots=True)
class ImageRule:
    """One allow-list entry: `PATTERN` or `PATTERN=USER` (shell wildcards; `*` matches any
    characters, "/" and ":" included). USER, when given, replaces the driver's container_user
    for the images it matches (e.g. `nvcr.io/nvidia/pytorch:*=0:0` for an image that needs root)."""

    pattern: str
    user: str | None = None

    @classmethod
    def parse(cls, entry: str) -> ImageRule:
        pattern, sep, user = entry.strip().partition("=")
        if not pattern or (sep and not user):
            raise ValueError(f"image allow-list entry {entry!r} must be PATTERN or PATTERN=USER")
        return cls(pattern=pattern, user=user or None)

    def matches(self, image: str) -> bool:
        # The scheduler judges with the same function (agentprotocol.images).
        return image_pattern_matches(self.pattern, image)


@dataclass(frozen=True, slots=True)
class DockerDriverConfig:
    """How the driver talks to the engine and shapes containers; see the field comments."""

    base_url: str | None = None  # None: $DOCKER_HOST, else the default socket
    api_version: str = "auto"  # negotiated: hosts run engines from 20.10 upwards
    timeout_s: float = 30.0  # per HTTP request (docker stop/wait add their own grace)
    # "nvidia": GPUs through device requests (NVIDIA Container Toolkit); "none": simulated GPUs.
    gpu_mode: str = "nvidia"
    # Whether runs may have the internet (filtered, see the module docstring); False: the
    # operator allows internal networks only, and an internet run is refused.
    internet_allowed: bool = True
    iptables: str = "iptables"  # the binary that manages the engine's rules (internet, gangs)
    node_id: str | None = None  # when set, list_managed only returns this node's containers
    pids_limit: int = 8192
    shm_size_mb: int | None = None  # None: half the memory limit (DataLoader workers, NCCL)
    read_only_rootfs: bool = True  # with a tmpfs /tmp; images writing elsewhere then fail
    tmp_size_mb: int = 1024  # the tmpfs /tmp of a read-only container (charged to its memory)
    # Per rental workspace, as a loop-mounted ext4 image (needs root); None: no quota.
    disk_quota_mb: int | None = None
    # Where the agent makes workspaces: only those directly under it are unmounted and deleted
    # (agents of other nodes may share the engine, tests do); None: any the network names.
    volume_root: str | None = None
    container_user: str | None = "1000:1000"  # None: the image's USER (often root)
    workspace_uid: int = 1000  # owner given to the volume dir when the user is not numeric
    workspace_gid: int = 1000
    # Images the operator accepts; anything else is refused before it is pulled.
    image_allow: tuple[str, ...] = ("gpumarket/harness:*",)
    image_rules: tuple[ImageRule, ...] = field(init=False, default=())
    pull_policy: str = "if_missing"  # "if_missing" | "never"
    pull_timeout_s: float = 3600.0  # a whole pull, all its layers
    # The largest image this node pulls (its unpacked size; a pull whose layers already add
    # up past it is abandoned); None: no limit.
    max_image_bytes: int | None = None
    init: bool = True  # tini as PID 1: signals reach the program, zombies are reaped
    retry_attempts: int = 4
    retry_base_s: float = 0.5
    retry_max_s: float = 8.0
    log_max_size: str = "50m"
    log_max_files: int = 3

    def __post_init__(self) -> None:
        if self.gpu_mode not in ("nvidia", "none"):
            raise ValueError("gpu_mode must be 'nvidia' or 'none'")
        if self.disk_quota_mb is not None and self.disk_quota_mb < 16:
            raise ValueError("disk_quota_mb must be at least 16 (ext4 needs room for itself)")
        object.__setattr__(
            self, "image_rules", tuple(ImageRule.parse(e) for e in self.image_allow if e.strip())
        )
        if self.pull_policy not in ("if_missing", "never"):
            raise ValueError("pull_policy must be 'if_missing' or 'never'")
        if self.retry_attempts < 1:
            raise ValueError("retry_attempts must be at least 1")


def container_name(run_id: str) -> str:
    return f"gpumarket-{run_id}"


def network_name(rental_id: str) -> str:
    return f"gpumarket-net-{rental_id}"


def bridge_name(node_id: str | None, rental_id: str) -> str:
    """The bridge interface of a rental network: `gpm-` + a hash (Linux allows 15 characters);
    the common prefix is what the egress rules match."""
    digest = hashlib.sha256(f"{node_id}/{rental_id}".encode()).hexdigest()
    return BRIDGE_PREFIX + digest[: 15 - len(BRIDGE_PREFIX)]


def _run_command(argv: list[str], *, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=_COMMAND_TIMEOUT_S,
        check=False,
    )


def egress_rules(bridge_prefix: str = BRIDGE_PREFIX) -> str:
    """iptables-restore input (with --noflush) defining our two chains; applied in one
    transaction, so there is no moment where a chain is empty."""
    lines = [
        "*filter",
        f":{EGRESS_CHAIN} - [0:0]",
        f"-A {EGRESS_CHAIN} -m conntrack --ctstate ESTABLISHED,RELATED -j RETURN",
        *(f"-A {EGRESS_CHAIN} -d {cidr} -j DROP" for cidr in BLOCKED_RANGES_V4),
        f"-A {EGRESS_CHAIN} -j RETURN",
        f":{HOST_CHAIN} - [0:0]",
        # Replies to connections the host opened (docker-proxy's, for published ports) pass;
        # nothing else does.
        f"-A {HOST_CHAIN} -m conntrack --ctstate ESTABLISHED,RELATED -j RETURN",
        f"-A {HOST_CHAIN} -j DROP",
        "COMMIT",
        "",
    ]
    return "\n".join(lines)


def internet_filter_unavailable(iptables: str = "iptables") -> str | None:
    """Why this host cannot filter a rental's internet traffic (see `ensure_egress_rules`), or
    None when it can: the agent runs as root, has iptables and iptables-restore, and the engine
    manages iptables (its DOCKER-USER chain exists). Changes nothing."""
    if os.geteuid() != 0:
        return "the agent does not run as root"
    if shutil.which(iptables) is None or shutil.which(f"{iptables}-restore") is None:
        return f"{iptables} or {iptables}-restore is missing"
    try:
        probe = _run_command([iptables, "-w", "5", "-n", "-L", "DOCKER-USER"])
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{iptables} failed: {exc}"
    if probe.returncode != 0:
        return (
            "the engine does not manage iptables (no DOCKER-USER chain: dockerd runs with "
            f"--iptables=false, so it gives no NAT and no place for our rules); {iptables}: "
            f"{probe.stderr.strip()}"
        )
    return None


def ensure_egress_rules(iptables: str = "iptables", bridge_prefix: str = BRIDGE_PREFIX) -> None:
    """Install (idempotently) the rules keeping rentals with internet off private ranges and
    the host; PermanentRuntimeError saying why when this host cannot have them."""
    reason = internet_filter_unavailable(iptables)
    if reason is not None:
        raise PermanentRuntimeError(f"a rental with internet needs a packet filter: {reason}")
    binary = shutil.which(iptables) or iptables
    restore = shutil.which(f"{iptables}-restore") or f"{iptables}-restore"
    applied = _run_command([restore, "-w", "5", "--noflush"], stdin=egress_rules(bridge_prefix))
    if applied.returncode != 0:
        raise PermanentRuntimeError(f"cannot install egress rules: {applied.stderr.strip()}")
    for parent, chain in (("DOCKER-USER", EGRESS_CHAIN), ("INPUT", HOST_CHAIN)):
        rule = ["-i", f"{bridge_prefix}+", "-j", chain]
        if _run_command([binary, "-w", "5", "-C", parent, *rule]).returncode == 0:
            continue
        inserted = _run_command([binary, "-w", "5", "-I", parent, "1", *rule])
        if inserted.returncode != 0:
            raise PermanentRuntimeError(
                f"cannot insert the jump to {chain} in {parent}: {inserted.stderr.strip()}"
            )


def classify_docker_error(exc: BaseException) -> RuntimeDriverError:
    """Map an SDK/transport exception to our typed errors (retryable or permanent)."""
    if isinstance(exc, RuntimeDriverError):
        return exc
    if isinstance(exc, docker.errors.ImageNotFound):
        return ImageNotFoundError(str(exc))
    if isinstance(exc, docker.errors.NotFound):
        return RunNotFoundError(str(exc))
    if isinstance(exc, docker.errors.APIError):
        status = exc.status_code
        if status is None:
            return RetryableRuntimeError(str(exc))
        if status >= 500:
            message = str(exc.explanation or exc).lower()
            if any(fragment in message for fragment in _PERMANENT_5XX_FRAGMENTS):
                return PermanentRuntimeError(str(exc))
            return RetryableRuntimeError(str(exc))
        return PermanentRuntimeError(str(exc))
    if isinstance(exc, docker.errors.InvalidArgument | docker.errors.InvalidVersion):
        return PermanentRuntimeError(str(exc))
    # Connection refused, timeouts, "Error while fetching server API version", ...
    return RetryableRuntimeError(str(exc))


class ImageTooLargeError(PermanentRuntimeError):
    """The image is larger than this node takes (`max_image_bytes`)."""


def image_too_large(image: str, size: int, limit: int, *, unpacked: bool = False) -> str:
    """The refusal's text; marketplace.lifecycle reads "too large for this node" as the
    customer's doing."""
    what = "unpacked" if unpacked else "its layers add up to"
    return (
        f"image {image!r} is too large for this node ({what} {size / 1e9:.1f} GB; "
        f"this node takes at most {limit / 1e9:.1f} GB)"
    )


# What a registry answers when the credentials are wrong or missing, and when the image is not
# there (the engine passes its words on): both the customer's doing, never worth a retry. One
# table for the pull's stream and for the engine's refusal to start one. A bare "404" is read
# from the status only: a digest in a message may contain those digits.
_REFUSED_CREDENTIALS = (
    "unauthorized",
    "authentication required",
    "no basic auth credentials",
    "denied",
    "forbidden",
    "incorrect username or password",
)
_REFUSED_UNKNOWN = (
    "manifest unknown",
    "not found",
    "repository does not exist",
    "invalid reference format",
)


def pull_refusal(message: str, status: int | None = None) -> str | None:
    """Why a registry refused a pull, "credentials" or "unknown", or None: not a refusal."""
    text = message.lower()
    if status in (401, 403) or any(f in text for f in _REFUSED_CREDENTIALS):
        return "credentials"
    if status == 404 or any(f in text for f in _REFUSED_UNKNOWN):
        return "unknown"
    return None


def classify_pull_error(image: str, message: str) -> RuntimeDriverError:
    """An error event in a pull's stream as our typed error."""
    if pull_refusal(message):
        # "no such image": marketplace.lifecycle reads it as the customer's doing.
        return ImageNotFoundError(f"no such image {image!r} (or no access to it): {message}")
    return RetryableRuntimeError(f"cannot pull {image}: {message}")


def _pull_error(image: str, exc: BaseException) -> RuntimeDriverError:
    """A pull's failure as our typed error: the engine's refusal to start it (a 4xx: the
    registry has no such image, or refuses the caller) is read like an error in its stream."""
    if isinstance(exc, RuntimeDriverError):
        return exc
    if isinstance(exc, docker.errors.APIError) and exc.status_code and exc.status_code < 500:
        return classify_pull_error(image, str(exc.explanation or exc))
    return classify_docker_error(exc)


class PullLayers:
    """The per-layer progress of one pull's stream, summed: each layer's `progressDetail`
    current and total while it downloads, all of it once it is complete or already there."""

    __slots__ = ("layers",)

    _COMPLETE = ("Download complete", "Pull complete", "Already exists", "Extracting")

    def __init__(self) -> None:
        self.layers: dict[str, list[int]] = {}  # layer id -> [done, total]

    def update(self, event: dict[str, Any]) -> bool:
        """Fold one event in; whether the sums changed."""
        layer = event.get("id")
        status = str(event.get("status") or "")
        if not isinstance(layer, str) or not layer:
            return False
        before = self.layers.get(layer)
        state = list(before) if before else [0, 0]
        detail = event.get("progressDetail") or {}
        if status == "Downloading" and isinstance(detail, dict):
            current, total = detail.get("current"), detail.get("total")
            if isinstance(total, int) and total > 0:
                state[1] = total
            if isinstance(current, int) and current >= 0:
                state[0] = min(current, state[1]) if state[1] else current
        elif status.startswith(self._COMPLETE):
            state[0] = state[1]
        elif before is None and status not in ("Pulling fs layer", "Waiting"):
            return False  # "Pulling from", "Digest", "Status": not a layer
        self.layers[layer] = state
        return state != (before or [0, 0])

    @property
    def done(self) -> int:
        return sum(done for done, _ in self.layers.values())

    @property
    def total(self) -> int:
        return sum(total for _, total in self.layers.values())


def pull_error(
    image: str, auth: RegistryAuth | None, exc: RuntimeDriverError
) -> RuntimeDriverError:
    """A failed pull said plainly: the registry refused the credentials (or asked for some),
    or has no such image, both permanent and the customer's (the server reads "pull access
    denied" and "manifest unknown" as such); anything else stays as it was classified."""
    cause = exc.__cause__
    status = cause.status_code if isinstance(cause, docker.errors.APIError) else None
    refusal = pull_refusal(str(exc), status)
    if refusal == "credentials":
        if auth is not None:
            why = f"the registry refused the credentials in secret {auth.secret}"
        else:
            why = "the registry asked for credentials: name a registry_secret"
        return PermanentRuntimeError(f"pull access denied for {image}: {why} ({exc})")
    if refusal == "unknown":
        return ImageNotFoundError(f"image not found: {image}: manifest unknown ({exc})")
    return exc


def _is_conflict(exc: BaseException) -> bool:
    cause = exc.__cause__
    return isinstance(cause, docker.errors.APIError) and cause.status_code == 409


def parse_docker_time(value: str | None) -> float | None:
    """RFC 3339 (nanoseconds, UTC) to unix time; Docker's zero time means "never"."""
    ns = parse_docker_time_ns(value)
    return None if ns is None else ns / 1e9


def parse_docker_time_ns(value: str | None) -> int | None:
    if not value or value.startswith("0001-01-01"):
        return None
    # Docker writes UTC with "Z" and up to 9 fractional digits (trailing zeros trimmed), which
    # datetime cannot hold; integer nanoseconds keep log cursors exact.
    text = value.rstrip("Z")
    base, _, frac = text.partition(".")
    seconds = calendar.timegm(time.strptime(base, "%Y-%m-%dT%H:%M:%S"))
    return seconds * 1_000_000_000 + int((frac or "0")[:9].ljust(9, "0"))


# Docker's log drivers store a line longer than 16 KiB as 16 KiB partial messages, each with its
# own timestamp and no newline; read back with timestamps, the next chunk's stamp sits right after
# each full chunk. That is where they are cut out to give the line back whole.
_PARTIAL_BYTES = 16 * 1024
_STAMP = re.compile(rb"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d{1,9})?Z ")


def _join_partials(text: bytes) -> bytes:
    at = _PARTIAL_BYTES
    while len(text) > at and (stamp := _STAMP.match(text, at)):
        text = text[:at] + text[stamp.end() :]
        at += _PARTIAL_BYTES
    return text


def _state_from_attrs(attrs: dict[str, Any]) -> ContainerState:
    labels = attrs.get("Config", {}).get("Labels") or {}
    state = attrs.get("State", {})
    status = _STATUS_MAP.get(state.get("Status", ""), ContainerStatus.EXITED)
    ports: dict[int, int] = {}
    for key, bindings in ((attrs.get("NetworkSettings") or {}).get("Ports") or {}).items():
        port, _, proto = key.partition("/")
        if proto == "tcp" and bindings:
            ports[int(port)] = int(bindings[0]["HostPort"])
    return ContainerState(
        rental_id=labels.get(LABEL_RENTAL, ""),
        run_id=labels.get(LABEL_RUN, ""),
        status=status,
        exit_code=int(state.get("ExitCode", 0)) if status == ContainerStatus.EXITED else None,
        started_at=parse_docker_time(state.get("StartedAt")),
        finished_at=(
            parse_docker_time(state.get("FinishedAt")) if status == ContainerStatus.EXITED else None
        ),
        ports=ports,
        node_id=labels.get(LABEL_NODE),
        oom_killed=bool(state.get("OOMKilled")),
        netns_pid=int(state.get("Pid") or 0) or None if status == ContainerStatus.RUNNING else None,
    )


class DockerDriver:
    """RuntimeDriver on a Docker Engine; safe to share between threads."""

    name = "docker"

    def __init__(self, config: DockerDriverConfig | None = None) -> None:
        self.config = config or DockerDriverConfig()
        self._client_obj: docker.DockerClient | None = None
        self._engine_cpus: int | None = None
        self._lock = threading.Lock()
        self._rental_lock = threading.RLock()
        # (run id, bytes done, bytes in all) while a run's image is pulled before its start.
        self.on_pull_progress: Callable[[str, int, int], None] | None = None
        # (image) after each image a start pulled: the agent's image cache accounts for it.
        self.on_image_pulled: Callable[[str], None] | None = None
        if self.config.disk_quota_mb is not None and not self.enforces_disk_quota:
            logger.warning(
                "disk quota asked for but not enforceable here (needs root and mkfs.ext4): "
                "rental workspaces are not size-limited"
            )

    # -- the RuntimeDriver interface ---------------------------------------------------------

    def _managed_filters(self) -> list[str]:
        """The label filters of this node's containers."""
        filters = [f"{LABEL_MANAGED}=1"]
        if self.config.node_id is not None:
            filters.append(f"{LABEL_NODE}={self.config.node_id}")
        return filters

    def list_managed(self) -> list[ContainerState]:
        filters = self._managed_filters()
        containers = self._call(
            "list",
            lambda: self._client().containers.list(
                all=True, filters={"label": filters}, ignore_removed=True
            ),
        )
        return [_state_from_attrs(c.attrs) for c in containers]

    def state(self, run_id: str) -> ContainerState:
        container = self._find(run_id)
        if container is None:
            return ContainerState.missing(run_id)
        return _state_from_attrs(container.attrs)

    def start(self, spec: ContainerSpec) -> ContainerState:
        log_extra = {"run_id": spec.run_id, "rental_id": spec.rental_id}
        container = self._find(spec.run_id)
        if container is not None:
            if container.status == "created":
                # A previous start died between create and start (agent crash, timeout), or the
                # host rebooted: the quota mount is gone, the container would write beside it.
                with self._rental_lock:
                    self.ensure_network(spec)
                    self._prepare_volume(spec)
                    self._write_secrets(spec)
                    self._start_container(container, spec.run_id)
                self._start_sshd(container, spec)
                self._start_jupyter(container, spec)
            logger.info("container exists, adopting it", extra=log_extra)
            return self._reload_state(container)

        self.image_rule(spec.image)  # refused before anything is pulled or made
        self._ensure_image(spec.image, spec.registry_auth, run_id=spec.run_id)
        # Under the lock: a removal of another run of this rental must not take its network or
        # workspace away between their preparation here and the container's creation.
        with self._rental_lock:
            self.ensure_network(spec)
            self._prepare_volume(spec)
            self._write_secrets(spec)
            kwargs = self.create_options(spec)
            try:
                container = self._call("create", lambda: self._client().containers.create(**kwargs))
            except PermanentRuntimeError as exc:
                # Another caller (or a retried request that did succeed) created it first.
                if not _is_conflict(exc):
                    raise
                container = self._find(spec.run_id)
                if container is None:
                    raise
                logger.info("container created concurrently, adopting it", extra=log_extra)
        if container.status == "created":
            self._start_container(container, spec.run_id)
            self._start_sshd(container, spec)
            self._start_jupyter(container, spec)
        state = self._reload_state(container)
        logger.info(
            "container started",
            extra={**log_extra, "image": spec.image, "network": network_name(spec.rental_id)},
        )
        return state

    def stop(self, run_id: str, grace_s: float) -> None:
        container = self._find(run_id)
        if container is None:
            return
        # The engine sends the container's stop signal (SIGTERM), waits t seconds, then SIGKILLs;
        # the SDK extends the HTTP timeout by t.
        timeout = max(0, math.ceil(grace_s))
        try:
            self._call("stop", lambda: container.stop(timeout=timeout))
        except RunNotFoundError:
            return
        logger.info("container stopped", extra={"run_id": run_id, "grace_s": grace_s})

    def remove(self, run_id: str) -> None:
        container = self._find(run_id)
        if container is not None:
            secrets_dir = container.labels.get(LABEL_SECRETS, "")
            try:
                # v=True: anonymous volumes declared by the image go too; the bind-mounted
                # workspace is a host directory: release_unused_rentals deletes it.
                self._call("remove", lambda: container.remove(force=True, v=True))
                logger.info("container removed", extra={"run_id": run_id})
            except RunNotFoundError:
                pass
            except PermanentRuntimeError as exc:
                if "already in progress" not in str(exc):
                    raise
            if secrets_dir:
                secret_files_remove(secrets_dir)
        # Also after a crash between a container's removal and its rental's cleanup.
        self.release_unused_rentals()

    def release_unused_rentals(self, rental_id: str | None = None) -> None:
        """Remove what rentals of this node (or the one rental) that have no container left
        still hold on the host: the workspace (unmounted and its quota image deleted), then the
        network. The agent removes a run's container only once its final output sync is done,
        so nothing unsynced is lost. The network goes last: it names the workspace
        (LABEL_VOLUME), so a crash in between leaves a record the next call (a restarted agent
        makes one at start) finishes with."""
        filters = [f"{LABEL_MANAGED}=1"]
        if self.config.node_id is not None:
            filters.append(f"{LABEL_NODE}={self.config.node_id}")
        wanted = [*filters, f"{LABEL_RENTAL}={rental_id}"] if rental_id else filters
        every_rental = rental_id is None
        with self._rental_lock:
            networks = self._call(
                "networks", lambda: self._client().networks.list(filters={"label": wanted})
            )
            if every_rental:
                # Gang devices and filter rules whose network is gone (a crash between the
                # two removals). Any node's networks count as live: agents sharing an engine
                # (tests, several simulated nodes) must not take each other's.
                live = self._call(
                    "networks",
                    lambda: self._client().networks.list(filters={"label": [f"{LABEL_MANAGED}=1"]}),
                )
                gangnet.sweep(
                    {(n.attrs.get("Options") or {}).get(BRIDGE_OPTION, "") for n in live},
                    iptables=self.config.iptables,
                )
            for network in networks:
                rental_id = network.attrs.get("Labels", {}).get(LABEL_RENTAL, "")
                users = self._call(
                    "list",
                    lambda r=rental_id: self._client().containers.list(
                        all=True,
                        filters={"label": [*filters, f"{LABEL_RENTAL}={r}"]},
                        ignore_removed=True,
                    ),
                )
                if users:
                    continue
                volume_dir = network.attrs.get("Labels", {}).get(LABEL_VOLUME, "")
                if not self._owns_workspace(volume_dir, rental_id):
                    volume_dir = ""
                if volume_dir and os.path.ismount(volume_dir):
                    self._unmount(volume_dir)
                if volume_dir:
                    workspace_delete(volume_dir)
                bridge = (network.attrs.get("Options") or {}).get(BRIDGE_OPTION, "")
                if bridge:
                    gangnet.remove(bridge, iptables=self.config.iptables)
                try:
                    self._call("network remove", network.remove)
                except RunNotFoundError:
                    continue
                except RuntimeDriverError as exc:
                    # The run itself is gone; the next removal tries its network again.
                    logger.warning(
                        "rental network not removed",
                        extra={"rental_id": rental_id, "error": str(exc)},
                    )
                    continue
                logger.info("rental network removed", extra={"rental_id": rental_id})

    def _owns_workspace(self, volume_dir: str, rental_id: str) -> bool:
        """Whether `volume_dir` is a workspace this driver's agent made for the rental: named
        after it, under the agent's volume root when one is configured."""
        if not volume_dir or os.path.basename(volume_dir) != rental_id:
            return False
        root = self.config.volume_root
        return root is None or os.path.dirname(volume_dir) == os.path.abspath(root)

    def image_rule(self, image: str) -> ImageRule:
        """The allow-list entry admitting `image`; PermanentRuntimeError when none does."""
        for rule in self.config.image_rules:
            if rule.matches(image):
                return rule
        raise PermanentRuntimeError(
            f"image {image!r} is not allowed on this node (allowed: "
            f"{', '.join(self.config.image_allow) or 'none'})"
        )

    def images_held(self) -> list[HeldImage]:
        """The tagged images the engine holds: references (normalized), id and size."""
        images = self._call("images", lambda: self._client().api.images())
        held = []
        for item in images:
            refs = tuple(
                image_normalize(tag) for tag in item.get("RepoTags") or () if tag != "<none>:<none>"
            )
            if refs:
                held.append(HeldImage(refs, str(item.get("Id", "")), int(item.get("Size") or 0)))
        return held

    def images_in_use(self) -> set[str]:
        """The images of every container this agent manages, in any state."""
        filters = self._managed_filters()
        containers = self._call(
            "list",
            lambda: self._client().api.containers(all=True, filters={"label": filters}),
        )
        return {image_normalize(c["Image"]) for c in containers if c.get("Image")}

    def image_remove(self, ref: str) -> None:
        """Untag an image (its data goes with its last tag); never forced: an image a
        container still uses is refused by the engine."""
        self._call("image remove", lambda: self._client().images.remove(ref, noprune=False))

    @property
    def enforces_disk_quota(self) -> bool:
        """Whether a rental's workspace is size-limited here (what the node can promise)."""
        return (
            self.config.disk_quota_mb is not None
            and os.geteuid() == 0
            and shutil.which("mkfs.ext4") is not None
        )

    def logs_tail(self, run_id: str, lines: int = 50) -> str:
        container = self._get(run_id)
        raw = self._call(
            "logs", lambda: container.logs(stdout=True, stderr=True, tail=max(0, lines))
        )
        return raw.decode("utf-8", errors="replace")

    def output_since(self, run_id: str, cursor: str | None) -> tuple[list[str], str]:
        """New stdout lines; the cursor is "<ns of last line>:<lines seen at that ns>".

        Docker's `since` is inclusive and we ask from the whole second of the cursor (float
        seconds lose nanoseconds), so lines at or before the cursor come back again and are
        skipped here by timestamp; the count disambiguates lines sharing one timestamp. A line
        still being written (no newline yet) is left for the next call.
        """
        cur_ns, cur_count = _parse_cursor(cursor)
        container = self._get(run_id)
        kwargs: dict[str, Any] = {"stdout": True, "stderr": False, "timestamps": True}
        if cur_ns >= 1_000_000_000:
            kwargs["since"] = cur_ns // 1_000_000_000
        raw = self._call("logs", lambda: container.logs(**kwargs))
        lines, last_ns, count = [], cur_ns, cur_count
        seen_at_cursor = 0
        for entry in raw.split(b"\n")[:-1]:  # the part after the last newline is incomplete
            stamp, _, text = entry.partition(b" ")
            text = _join_partials(text)
            ns = parse_docker_time_ns(stamp.decode("ascii", errors="replace"))
            if ns is None or ns < cur_ns:
                continue
            if ns == cur_ns:
                seen_at_cursor += 1
                if seen_at_cursor <= cur_count:
                    continue
            lines.append(text.decode("utf-8", errors="replace").rstrip("\r"))
            if ns == last_ns:
                count += 1
            else:
                last_ns, count = ns, 1
        return lines, f"{last_ns}:{count}"

    # -- helpers -----------------------------------------------------------------------------

    def _client(self) -> docker.DockerClient:
        with self._lock:
            if self._client_obj is None:
                # Created lazily inside the retry policy: the engine may be down at agent start.
                if self.config.base_url:
                    self._client_obj = docker.DockerClient(
                        base_url=self.config.base_url,
                        version=self.config.api_version,
                        timeout=self.config.timeout_s,
                    )
                else:
                    self._client_obj = docker.from_env(
                        version=self.config.api_version, timeout=self.config.timeout_s
                    )
            return self._client_obj

    def close(self) -> None:
        with self._lock:
            if self._client_obj is not None:
                self._client_obj.close()
                self._client_obj = None

    def _call(self, op: str, fn: Callable[[], T]) -> T:
        """Run one engine call under the retry policy, raising only our typed errors."""
        cfg = self.config
        for attempt in range(1, cfg.retry_attempts + 1):
            try:
                return fn()
            except (docker.errors.DockerException, requests.exceptions.RequestException) as exc:
                error = classify_docker_error(exc)
                if isinstance(error, RetryableRuntimeError) and attempt < cfg.retry_attempts:
                    delay = min(cfg.retry_max_s, cfg.retry_base_s * 2 ** (attempt - 1))
                    delay *= 0.5 + random.random() / 2  # jitter: agents do not retry in step
                    logger.warning(
                        "docker call failed, retrying",
                        extra={"op": op, "attempt": attempt, "delay_s": delay, "error": str(exc)},
                    )
                    time.sleep(delay)
                    continue
                # Not-found answers are routine (existence checks before create, image lookups).
                not_found = isinstance(error, RunNotFoundError | ImageNotFoundError)
                log = logger.debug if not_found else logger.error
                log("docker call failed", extra={"op": op, "attempt": attempt, "error": str(exc)})
                raise error from exc
        raise AssertionError("unreachable")

    def _find(self, run_id: str) -> Container | None:
        try:
            container = self._call(
                "get", lambda: self._client().containers.get(container_name(run_id))
            )
        except RunNotFoundError:
            return None
        labels = container.labels
        if labels.get(LABEL_MANAGED) != "1" or labels.get(LABEL_RUN) != run_id:
            raise PermanentRuntimeError(
                f"container {container_name(run_id)} exists but is not managed by us"
            )
        return container

    def _get(self, run_id: str) -> Container:
        container = self._find(run_id)
        if container is None:
            raise RunNotFoundError(f"no container for run {run_id}")
        return container

    def _reload_state(self, container: Container) -> ContainerState:
        self._call("inspect", container.reload)
        return _state_from_attrs(container.attrs)

    def _start_container(self, container: Container, run_id: str) -> None:
        try:
            self._call("start", container.start)
        except PermanentRuntimeError:
            # The runtime refused it (bad command, missing GPU driver): a half-made container
            # would be adopted by the next start and fail the same way forever.
            self.remove(run_id)
            raise

    def _start_sshd(self, container: Container, spec: ContainerSpec) -> None:
        """Start the run's sshd beside its main process (nodeagent/runtime/sshd.py)."""
        if spec.ssh_authorized_keys:
            env = launch_environment(spec.ssh_authorized_keys)
            self._exec_beside(container, spec, "sshd", LAUNCH_SCRIPT, env)

    def _start_jupyter(self, container: Container, spec: ContainerSpec) -> None:
        """Start the run's JupyterLab beside its main process (nodeagent/runtime/jupyter.py)."""
        if spec.jupyter_token:
            env = jupyter.launch_environment(spec.jupyter_token)
            self._exec_beside(container, spec, "JupyterLab", jupyter.LAUNCH_SCRIPT, env)

    def _exec_beside(
        self, container: Container, spec: ContainerSpec, what: str, script: str, env: dict
    ) -> None:
        """Run `script` with `sh -c` in the container, detached, as the container's user. An
        image without the program keeps running without it: its port is then never
        published, and the log says why."""
        try:
            self._call(
                f"exec {what}",
                lambda: container.exec_run(
                    ["sh", "-c", script], environment=env, detach=True,
                    user=self.container_user(spec.image) or "",
                ),
            )  # fmt: skip
        except RuntimeDriverError as exc:
            logger.warning(
                f"cannot start {what} in the container",
                extra={"run_id": spec.run_id, "error": str(exc)},
            )
            return
        logger.info(f"{what} started", extra={"run_id": spec.run_id})

    def _ensure_image(
        self, image: str, auth: RegistryAuth | None = None, *, run_id: str = ""
    ) -> None:
        """The image present, pulled with the run's credentials when missing (its progress
        handed to `on_pull_progress`). An image this engine pulled from a registry (it has a
        repository digest) is asked for again before each start, with the run's credentials or
        none: a private image another team's credentials brought here is then refused to a run
        without them, as the registry would refuse it. Where the registry cannot be reached,
        the copy here is used."""
        try:
            present = self._call("image", lambda: self._client().images.get(image))
        except ImageNotFoundError:
            if self.config.pull_policy == "never":
                raise
            present = None
        if present is not None and (
            self.config.pull_policy == "never" or not present.attrs.get("RepoDigests")
        ):
            return  # made on this host: no registry to ask
        auth_config = {"username": auth.username, "password": auth.password} if auth else None
        on_progress = self.on_pull_progress
        try:
            self.pull(
                image,
                auth_config=auth_config,
                progress=(lambda done, total: on_progress(run_id, done, total))
                if on_progress is not None and run_id
                else None,
            )
        except RuntimeDriverError as exc:
            error = pull_error(image, auth, exc)
            refused = "pull access denied" in str(error) or isinstance(error, ImageNotFoundError)
            if present is None or refused:
                if error is exc:
                    raise
                raise error from exc
            logger.warning(
                "image not checked with its registry, the copy here is used",
                extra={"image": image, "error": str(error)},
            )
            return
        if self.on_image_pulled is not None:
            self.on_image_pulled(image)

    def pull(
        self,
        image: str,
        *,
        auth_config: dict[str, str] | None = None,
        progress: Callable[[int, int], None] | None = None,
    ) -> None:
        """Pull the image through the engine's streaming API, handing `progress` the bytes of
        its layers downloaded so far and in all (as far as the registry has announced them).

        One policy with the other engine calls: a stream broken by the transport (engine
        restarted, connection reset, no event for `timeout_s`) is retried with backoff up to
        `retry_attempts` times, the engine keeping the layers it finished; what the registry
        refuses (no such image, access denied) is permanent. With `max_image_bytes`, a pull
        whose layers add up past it is abandoned, and an image whose unpacked size passes it is
        removed: both refused as too large for this node (the customer's image, not the node)."""
        repository, tag = parse_repository_tag(image)
        tag = tag or "latest"
        cfg = self.config
        logger.info("pulling image", extra={"image": image})
        deadline = time.monotonic() + cfg.pull_timeout_s
        for attempt in range(1, cfg.retry_attempts + 1):
            try:
                self._pull_stream(repository, tag, image, auth_config, progress, deadline)
                break
            except (
                docker.errors.DockerException,
                requests.exceptions.RequestException,
                RuntimeDriverError,
            ) as exc:
                error = _pull_error(image, exc)
                if (
                    isinstance(error, RetryableRuntimeError)
                    and attempt < cfg.retry_attempts
                    and time.monotonic() < deadline
                ):
                    delay = min(cfg.retry_max_s, cfg.retry_base_s * 2 ** (attempt - 1))
                    logger.warning(
                        "pull failed, retrying",
                        extra={"image": image, "attempt": attempt, "error": str(exc)},
                    )
                    time.sleep(delay * (0.5 + random.random() / 2))
                    continue
                logger.error("pull failed", extra={"image": image, "error": str(error)})
                if error is exc:
                    raise
                raise error from exc
        limit = cfg.max_image_bytes
        if limit is not None:
            pulled = self._call("image", lambda: self._client().images.get(image))
            size = int(pulled.attrs.get("Size") or 0)
            if size > limit:
                with contextlib.suppress(RuntimeDriverError):
                    self._call("image remove", lambda: self._client().images.remove(image))
                raise ImageTooLargeError(image_too_large(image, size, limit, unpacked=True))
        logger.info("image pulled", extra={"image": image})

    def _pull_stream(
        self,
        repository: str,
        tag: str,
        image: str,
        auth_config: dict[str, str] | None,
        progress: Callable[[int, int], None] | None,
        deadline: float,
    ) -> None:
        layers = PullLayers()
        stream = self._client().api.pull(
            repository, tag=tag, stream=True, decode=True, auth_config=auth_config
        )
        try:
            for event in stream:
                if not isinstance(event, dict):
                    continue
                if event.get("error"):
                    message = str(event.get("error"))
                    raise classify_pull_error(image, message)
                if layers.update(event) and progress is not None:
                    progress(layers.done, layers.total)
                limit = self.config.max_image_bytes
                if limit is not None and layers.total > limit:
                    raise ImageTooLargeError(image_too_large(image, layers.total, limit))
                if time.monotonic() > deadline:
                    raise RetryableRuntimeError(
                        f"pulling {image} took more than {self.config.pull_timeout_s:g} s"
                    )
        finally:
            # Leaving early (too large, too slow) closes the connection: the engine cancels
            # the pull.
            close = getattr(stream, "close", None)
            if close is not None:
                close()
        if progress is not None and layers.total:
            progress(layers.total, layers.total)

    def _write_secrets(self, spec: ContainerSpec) -> None:
        root = os.geteuid() == 0
        owner = self._workspace_owner(spec.image) if root else None
        secret_files_write(spec, owner=owner, readable_by_all=not root)

    def ensure_network(self, spec: ContainerSpec) -> str:
        """The rental's own network, created on its first start and adopted afterwards."""
        name = network_name(spec.rental_id)
        internal = spec.network == Network.INTERNAL
        if not internal:
            if not self.config.internet_allowed:
                raise PermanentRuntimeError(
                    "this node's operator allows internal networks only (network_policy "
                    "internal); a rental with internet cannot run here"
                )
            ensure_egress_rules(self.config.iptables)  # again each time: rules can be flushed
        try:
            network = self._call("network", lambda: self._client().networks.get(name))
        except RunNotFoundError:
            network = None
        if network is not None:
            labels = network.attrs.get("Labels") or {}
            if labels.get(LABEL_MANAGED) != "1" or labels.get(LABEL_RENTAL) != spec.rental_id:
                raise PermanentRuntimeError(f"network {name} exists but is not managed by us")
        bridge = bridge_name(self.config.node_id, spec.rental_id)
        gang = gangnet.Gang.of(spec.rental_id, spec.env)
        if network is not None:
            if gang is not None:
                gangnet.ensure(gang, bridge, iptables=self.config.iptables)
            return name
        options = {
            BRIDGE_OPTION: bridge,
            # No address of the host on the bridge: with nothing to route to, an internal
            # network cannot reach the host even where the engine installs no iptables rules.
            "com.docker.network.bridge.inhibit_ipv4": "true" if internal else "false",
            "com.docker.network.bridge.enable_ip_masquerade": "false" if internal else "true",
        }
        labels = {
            LABEL_MANAGED: "1",
            LABEL_RENTAL: spec.rental_id,
            LABEL_NODE: spec.node_id,
            LABEL_VOLUME: spec.volume_dir,
            LABEL_NETWORK: str(spec.network),
        }
        ipam = None
        if gang is not None:
            # The same subnet on every member's host, each container at its rank's address;
            # frames cross hosts inside VXLAN, hence the smaller MTU.
            gangnet.check_filter_possible(self.config.iptables)
            options["com.docker.network.driver.mtu"] = str(gangnet.overlay_mtu(gang))
            ipam = IPAMConfig(
                pool_configs=[IPAMPool(subnet=str(gang.subnet), gateway=gang.gateway)]
            )
        try:
            self._call(
                "network create",
                lambda: self._client().networks.create(
                    name,
                    driver="bridge",
                    internal=internal,
                    enable_ipv6=False,
                    options=options,
                    ipam=ipam,
                    labels=labels,
                    check_duplicate=True,
                ),
            )
        except PermanentRuntimeError as exc:
            if not _is_conflict(exc):
                raise
        if gang is not None:
            try:
                gangnet.ensure(gang, bridge, iptables=self.config.iptables)
            except RuntimeDriverError:
                self.release_unused_rentals(spec.rental_id)
                raise
        logger.info(
            "rental network created",
            extra={"rental_id": spec.rental_id, "network": str(spec.network)},
        )
        return name

    def _cpu_limit(self, spec: ContainerSpec) -> float:
        # The engine refuses a quota above its CPU count; a share computed for more cores than
        # this host has (e.g. a simulated 8-GPU node on a laptop) gets the whole host instead.
        if self._engine_cpus is None:
            self._engine_cpus = int(self._call("info", lambda: self._client().info())["NCPU"])
        if spec.cpu_limit > self._engine_cpus:
            logger.warning(
                "cpu_limit above the engine's CPU count, clamped",
                extra={
                    "run_id": spec.run_id,
                    "cpu_limit": spec.cpu_limit,
                    "cpus": self._engine_cpus,
                },
            )
            return float(self._engine_cpus)
        return spec.cpu_limit

    def container_user(self, image: str) -> str | None:
        """The user a container of `image` runs as: its allow-list entry's, else ours."""
        return self.image_rule(image).user or self.config.container_user

    def _workspace_owner(self, image: str) -> tuple[int, int]:
        uid, _, gid = (self.container_user(image) or "").partition(":")
        if uid.isdigit():
            return int(uid), int(gid) if gid.isdigit() else int(uid)
        return self.config.workspace_uid, self.config.workspace_gid

    def _prepare_volume(self, spec: ContainerSpec) -> None:
        volume_dir = spec.volume_dir
        os.makedirs(volume_dir, exist_ok=True)
        if self.enforces_disk_quota:
            self._mount_quota_volume(volume_dir)
        # cap_drop=ALL takes CAP_DAC_OVERRIDE even from root in the container: the directory
        # must belong to the container's user to be writable.
        owner = None
        if os.geteuid() == 0:
            owner = self._workspace_owner(spec.image)
            os.chown(volume_dir, *owner)
            os.chmod(volume_dir, 0o770)  # noqa: S103 - owner and group are the container's user
        else:
            os.chmod(volume_dir, 0o777)  # noqa: S103 - cannot chown; documented fallback
            logger.warning(
                "agent is not root: workspace made world-writable for the container user",
                extra={"volume_dir": volume_dir},
            )
        if spec.seed_dir:
            # After the quota mount: the files land in the rental's own volume.
            workspace_seed(spec.seed_dir, volume_dir, owner=owner)

    def _mount_quota_volume(self, volume_dir: str) -> None:
        """Mount the rental's ext4 image (made on first use, sparse) on its volume dir."""
        if os.path.ismount(volume_dir):
            return
        image = f"{volume_dir}.ext4"
        if not os.path.exists(image):
            if os.listdir(volume_dir):
                # Mounting over it would hide the data; moving it could overflow the quota.
                raise PermanentRuntimeError(
                    f"{volume_dir} holds data outside a quota image; move it away or into "
                    f"{image} mounted there"
                )
            with open(f"{image}.tmp", "wb") as f:
                f.truncate(self.config.disk_quota_mb * 1024 * 1024)
            # A fresh sparse file reads as zeros: lazy init skips writing tables nobody reads.
            made = _run_command(
                ["mkfs.ext4", "-q", "-F", "-m", "0", "-i", "65536", "-J", "size=16", "-E",
                 "lazy_itable_init=1,lazy_journal_init=1,nodiscard", f"{image}.tmp"]
            )  # fmt: skip
            if made.returncode != 0:
                os.unlink(f"{image}.tmp")
                raise RetryableRuntimeError(f"mkfs.ext4 failed: {made.stderr.strip()}")
            os.replace(f"{image}.tmp", image)
        mounted = _run_command(
            ["mount", "-o", "loop,nosuid,nodev,noinit_itable", image, volume_dir]
        )
        if mounted.returncode != 0:
            # Loop devices can run out for a while: the start is retried with backoff.
            raise RetryableRuntimeError(f"cannot mount {image}: {mounted.stderr.strip()}")
        logger.info(
            "quota workspace mounted",
            extra={"volume_dir": volume_dir, "quota_mb": self.config.disk_quota_mb},
        )

    def _unmount(self, volume_dir: str) -> None:
        done = _run_command(["umount", volume_dir])
        if done.returncode != 0:
            # Busy (a shell of an operator in it): detach now, the kernel finishes later.
            _run_command(["umount", "-l", volume_dir])

    def create_options(self, spec: ContainerSpec) -> dict[str, Any]:
        """The keyword arguments of `containers.create` for a spec: the whole security and
        resource policy of a rental container in one place."""
        cfg = self.config
        network_mode = network_name(spec.rental_id)
        kwargs: dict[str, Any] = {
            "image": spec.image,
            "command": list(spec.command) or None,
            "name": container_name(spec.run_id),
            "labels": spec.managed_labels(),
            "environment": run_env(
                spec,
                gpu_mode=cfg.gpu_mode,
                in_container=True,
                workspace=WORKSPACE,
                data_dir=DATA if spec.data_dir else "",
            ),
            "working_dir": WORKSPACE,
            "mounts": [Mount(target=WORKSPACE, source=spec.volume_dir, type="bind")],
            "nano_cpus": int(self._cpu_limit(spec) * 1e9),
            "mem_limit": f"{spec.memory_limit_mb}m",
            "memswap_limit": f"{spec.memory_limit_mb}m",  # equal: no swap beyond the limit
            "pids_limit": cfg.pids_limit,
            "shm_size": f"{cfg.shm_size_mb or max(64, spec.memory_limit_mb // 2)}m",
            "privileged": False,
            "cap_drop": ["ALL"],
            "security_opt": ["no-new-privileges"],
            "read_only": cfg.read_only_rootfs,
            "network_mode": network_mode,
            "sysctls": dict(NO_IPV6_SYSCTLS),
            "stop_signal": "SIGTERM",
            "auto_remove": False,  # the agent reads exit code and logs before removing
            "init": cfg.init,
            "log_config": LogConfig(
                type="json-file",
                config={"max-size": cfg.log_max_size, "max-file": str(cfg.log_max_files)},
            ),
            "detach": True,
        }
        gang = gangnet.Gang.of(spec.rental_id, spec.env)
        if gang is not None:
            # The gang's private network: this member at its rank's overlay address, and the
            # rendezvous variables naming overlay addresses (the server only knows fabric ones).
            kwargs["environment"].update(gang.overlay_env())
            # The overlay is the container's one interface besides loopback: gloo and NCCL
            # bind there unless the customer says otherwise (gloo resolves the hostname
            # otherwise, and falls back to loopback where that fails).
            for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
                kwargs["environment"].setdefault(name, gangnet.CONTAINER_IFNAME)
            del kwargs["network_mode"]
            kwargs["network"] = network_mode
            kwargs["networking_config"] = {
                network_mode: self._client().api.create_endpoint_config(
                    ipv4_address=gang.address(gang.node_rank)
                )
            }
            # NCCL's RDMA transport (InfiniBand/RoCE), where the host has it.
            if devices := gangnet.rdma_devices():
                kwargs["devices"] = devices
        if spec.data_dir:
            kwargs["mounts"].append(
                Mount(target=DATA, source=spec.data_dir, type="bind", read_only=True)
            )
        if any(secret.file for secret in spec.secrets):
            # The run's secret files, read-only, from a directory beside its workspace (never
            # in the image, nor in the synced workspace); removed with the container.
            kwargs["mounts"].append(
                Mount(
                    target=CONTAINER_SECRETS,
                    source=spec.secrets_dir(),
                    type="bind",
                    read_only=True,
                )
            )
            kwargs["labels"][LABEL_SECRETS] = spec.secrets_dir()
        if spec.ssh_authorized_keys and SSH_PORT in spec.ports:
            # The container's user binds sshd's port 22 in its own network namespace (newer
            # engines set this by default; older ones do not).
            kwargs["sysctls"]["net.ipv4.ip_unprivileged_port_start"] = "0"
        if cfg.read_only_rootfs:
            kwargs["tmpfs"] = {"/tmp": f"rw,nosuid,nodev,size={cfg.tmp_size_mb}m"}  # noqa: S108
        user = self.container_user(spec.image)
        if user:
            kwargs["user"] = user
        if cfg.gpu_mode == "nvidia" and spec.gpu_indices:
            device_ids = list(spec.gpu_uuids) or [str(i) for i in spec.gpu_indices]
            kwargs["device_requests"] = [
                DeviceRequest(device_ids=device_ids, capabilities=[["gpu"]])
            ]
            # NVIDIA's recommended limits: unlimited pinned (page-locked) memory for CUDA/NCCL
            # and a larger stack. Only here: the engine must itself run with an unlimited
            # memlock limit (the systemd units of GPU hosts do), or runc refuses to start.
            kwargs["ulimits"] = [
                Ulimit(name="memlock", soft=-1, hard=-1),
                Ulimit(name="stack", soft=64 * 1024 * 1024, hard=64 * 1024 * 1024),
            ]
        # The ports are published by the agent (nodeagent/publish.py) into the container's
        # network namespace, whatever the rental's network: the engine's own publishing needs a
        # route to the host, which an internal network does not have.
        return kwargs


def _parse_cursor(cursor: str | None) -> tuple[int, int]:
    if not cursor:
        return 0, 0
    try:
        ns, count = cursor.split(":")
        return int(ns), int(count)
    except ValueError:
        raise ValueError(f"not a cursor of this driver: {cursor!r}") from None
