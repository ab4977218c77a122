"""Docker Engine runtime driver (the `docker` SDK), the production runtime of the node agent.

Each run is one container named `gpumarket-<run_id>` carrying our labels, so a restarted agent
finds and adopts what runs. Every engine call has a timeout and goes through one retry policy:
transient failures (engine unreachable, timeouts, 5xx) are retried with bounded exponential
backoff and surface as RetryableRuntimeError; requests that cannot succeed (missing image, 4xx,
runtime refusals) surface at once as PermanentRuntimeError.
"""

from __future__ import annotations

import calendar
import logging
import math
import os
import random
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import docker
import docker.errors
import requests.exceptions
from docker.models.containers import Container
from docker.types import DeviceRequest, LogConfig, Mount, Ulimit
from docker.utils import parse_repository_tag

from agentprotocol import ContainerStatus
from nodeagent.runtime.base import (
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
)

logger = logging.getLogger(__name__)

T = TypeVar("T")

WORKSPACE = "/workspace"

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
)


@dataclass(frozen=True, slots=True)
class DockerDriverConfig:
    """How the driver talks to the engine and shapes containers; see the field comments."""

    base_url: str | None = None  # None: $DOCKER_HOST, else the default socket
    api_version: str = "auto"  # negotiated: hosts run engines from 20.10 upwards
    timeout_s: float = 30.0  # per HTTP request (docker stop/wait add their own grace)
    # "nvidia": GPUs through device requests (NVIDIA Container Toolkit); "none": simulated GPUs.
    gpu_mode: str = "nvidia"
    # "auto": "bridge" when the engine has a bridge network, else "none" (engines started with
    # --bridge=none, see deploy/docker-engine.sh). Host networking is refused outright.
    network_mode: str = "auto"
    publish_host_ip: str = "127.0.0.1"  # "0.0.0.0" to expose rental ports on all interfaces
    node_id: str | None = None  # when set, list_managed only returns this node's containers
    pids_limit: int = 8192
    shm_size_mb: int | None = None  # None: half the memory limit (DataLoader workers, NCCL)
    read_only_rootfs: bool = False  # with a tmpfs /tmp; images writing elsewhere then fail
    container_user: str | None = None  # None: the image's USER
    workspace_uid: int = 1000  # owner given to the volume dir: the harness images' user
    workspace_gid: int = 1000
    pull_policy: str = "if_missing"  # "if_missing" | "never"
    init: bool = True  # tini as PID 1: signals reach the program, zombies are reaped
    retry_attempts: int = 4
    retry_base_s: float = 0.5
    retry_max_s: float = 8.0
    log_max_size: str = "50m"
    log_max_files: int = 3

    def __post_init__(self) -> None:
        if self.gpu_mode not in ("nvidia", "none"):
            raise ValueError("gpu_mode must be 'nvidia' or 'none'")
        if self.network_mode == "host" or self.network_mode.startswith("container:"):
            raise ValueError("rentals never share the host's or another container's network")
        if self.pull_policy not in ("if_missing", "never"):
            raise ValueError("pull_policy must be 'if_missing' or 'never'")
        if self.retry_attempts < 1:
            raise ValueError("retry_attempts must be at least 1")


def container_name(run_id: str) -> str:
    return f"gpumarket-{run_id}"


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
    )


class DockerDriver:
    """RuntimeDriver on a Docker Engine; safe to share between threads."""

    name = "docker"

    def __init__(self, config: DockerDriverConfig | None = None) -> None:
        self.config = config or DockerDriverConfig()
        self._client_obj: docker.DockerClient | None = None
        self._network_mode: str | None = None
        self._engine_cpus: int | None = None
        self._lock = threading.Lock()

    # -- the RuntimeDriver interface ---------------------------------------------------------

    def list_managed(self) -> list[ContainerState]:
        filters = [f"{LABEL_MANAGED}=1"]
        if self.config.node_id is not None:
            filters.append(f"{LABEL_NODE}={self.config.node_id}")
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
                # A previous start died between create and start (agent crash, timeout).
                self._start_container(container, spec.run_id)
            logger.info("container exists, adopting it", extra=log_extra)
            return self._reload_state(container)

        self._ensure_image(spec.image)
        self._prepare_volume(spec.volume_dir)
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
        state = self._reload_state(container)
        logger.info(
            "container started",
            extra={**log_extra, "image": spec.image, "network_mode": kwargs["network_mode"]},
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
        if container is None:
            return
        try:
            # v=True: anonymous volumes declared by the image go too; the bind-mounted
            # workspace is a host directory and stays.
            self._call("remove", lambda: container.remove(force=True, v=True))
        except RunNotFoundError:
            return
        except PermanentRuntimeError as exc:
            if "already in progress" in str(exc):
                return
            raise
        logger.info("container removed", extra={"run_id": run_id})

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

    def _ensure_image(self, image: str) -> None:
        try:
            self._call("image", lambda: self._client().images.get(image))
            return
        except ImageNotFoundError:
            if self.config.pull_policy == "never":
                raise
        repository, tag = parse_repository_tag(image)
        logger.info("pulling image", extra={"image": image})
        self._call("pull", lambda: self._client().images.pull(repository, tag=tag or "latest"))

    def _effective_network_mode(self) -> str:
        if self.config.network_mode != "auto":
            return self.config.network_mode
        if self._network_mode is None:
            networks = self._call("networks", lambda: self._client().networks.list())
            has_bridge = any(n.name == "bridge" for n in networks)
            self._network_mode = "bridge" if has_bridge else "none"
            if not has_bridge:
                logger.warning("engine has no bridge network: containers run without network")
        return self._network_mode

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

    def _prepare_volume(self, volume_dir: str) -> None:
        os.makedirs(volume_dir, exist_ok=True)
        # cap_drop=ALL takes CAP_DAC_OVERRIDE even from root in the container: the directory
        # must belong to the container's user to be writable.
        if os.geteuid() == 0:
            os.chown(volume_dir, self.config.workspace_uid, self.config.workspace_gid)
            os.chmod(volume_dir, 0o770)  # noqa: S103 - owner and group are the container's user
        else:
            os.chmod(volume_dir, 0o777)  # noqa: S103 - cannot chown; documented fallback
            logger.warning(
                "agent is not root: workspace made world-writable for the container user",
                extra={"volume_dir": volume_dir},
            )

    def create_options(self, spec: ContainerSpec) -> dict[str, Any]:
        """The keyword arguments of `containers.create` for a spec: the whole security and
        resource policy of a rental container in one place."""
        cfg = self.config
        network_mode = self._effective_network_mode()
        kwargs: dict[str, Any] = {
            "image": spec.image,
            "command": list(spec.command) or None,
            "name": container_name(spec.run_id),
            "labels": spec.managed_labels(),
            "environment": run_env(
                spec, gpu_mode=cfg.gpu_mode, in_container=True, workspace=WORKSPACE
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
            "stop_signal": "SIGTERM",
            "auto_remove": False,  # the agent reads exit code and logs before removing
            "init": cfg.init,
            "log_config": LogConfig(
                type="json-file",
                config={"max-size": cfg.log_max_size, "max-file": str(cfg.log_max_files)},
            ),
            "detach": True,
        }
        if cfg.read_only_rootfs:
            kwargs["tmpfs"] = {"/tmp": "rw,nosuid,nodev,size=1g"}  # noqa: S108 - in the container
        if cfg.container_user:
            kwargs["user"] = cfg.container_user
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
        if spec.ports:
            if network_mode == "none":
                logger.warning(
                    "ports requested but the container has no network; none published",
                    extra={"run_id": spec.run_id, "ports": list(spec.ports)},
                )
            else:
                kwargs["ports"] = {f"{p}/tcp": (cfg.publish_host_ip, None) for p in spec.ports}
        return kwargs


def _parse_cursor(cursor: str | None) -> tuple[int, int]:
    if not cursor:
        return 0, 0
    try:
        ns, count = cursor.split(":")
        return int(ns), int(count)
    except ValueError:
        raise ValueError(f"not a cursor of this driver: {cursor!r}") from None
