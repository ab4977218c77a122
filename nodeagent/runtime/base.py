"""The runtime-driver contract: what the node agent asks of a container runtime.

The agent is stateless: everything it needs to recover after a restart lives with the runtime
(container labels for Docker, a metadata file per run for local processes). Drivers therefore
make `start` idempotent on `run_id` and `list_managed` returns every run they manage, in any state.

No Django import here: the agent runs on GPU hosts without the web stack.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol, Self, runtime_checkable

from agentprotocol import ContainerStatus, DesiredRun

LABEL_MANAGED = "gpumarket.managed"
LABEL_RENTAL = "gpumarket.rental"
LABEL_RUN = "gpumarket.run"
LABEL_NODE = "gpumarket.node"

# Where a container sees its workspace and its datasets (the Docker driver mounts them there).
CONTAINER_WORKSPACE = "/workspace"
CONTAINER_DATA = "/data"
# Where a run finds the team secrets it gets as files (read-only; GPUMARKET_SECRETS_DIR names
# it on every runtime: a host process has it elsewhere).
CONTAINER_SECRETS = "/run/secrets"

# Docker's container-name grammar; the process driver uses run_id as a directory name, so the
# same restriction keeps both safe (no "/" or "..").
_RUN_ID_RE = re.compile(r"^[a-zA-Z0-9][a-zA-Z0-9_.-]{0,127}$")


class RuntimeDriverError(Exception):
    """A runtime operation failed; see the subclasses for whether retrying can help."""


class RetryableRuntimeError(RuntimeDriverError):
    """Transient failure (engine unreachable, timeout, 5xx): the same call may succeed later."""


class PermanentRuntimeError(RuntimeDriverError):
    """The request itself cannot succeed (bad image, bad spec, refused by the runtime)."""


class ImageNotFoundError(PermanentRuntimeError):
    """The image is neither present locally nor pullable."""


class RunNotFoundError(PermanentRuntimeError):
    """No container/process exists for the run id (never started, or removed)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ContainerSpec(DesiredRun):
    """Everything needed to run one container run of a rental on the allocated GPUs: the
    server's desired run, placed on this node."""

    node_id: str
    volume_dir: str
    labels: Mapping[str, str] = field(default_factory=dict)
    # Staged by the agent (nodeagent.staging): a directory with one read-only directory per
    # dataset, seen by the run at $GPUMARKET_DATA_DIR (/data in a container), and files the
    # runtime copies into the workspace before the run starts (a checkpoint to resume from);
    # "": none.
    data_dir: str = ""
    seed_dir: str = ""

    @classmethod
    def place(
        cls,
        run: DesiredRun,
        *,
        node_id: str,
        volume_dir: str,
        env: Mapping[str, str],
        data_dir: str = "",
        seed_dir: str = "",
    ) -> Self:
        """The spec of a desired run on this node; `env` is added to the run's own."""
        fields = {f.name: getattr(run, f.name) for f in dataclasses.fields(DesiredRun)}
        fields["env"] = {**run.env, **env}
        return cls(
            **fields,
            node_id=node_id,
            volume_dir=volume_dir,
            data_dir=data_dir,
            seed_dir=seed_dir,
        )

    def __post_init__(self) -> None:
        if not _RUN_ID_RE.match(self.run_id):
            raise ValueError(f"run_id {self.run_id!r} must match {_RUN_ID_RE.pattern}")
        if self.cpu_limit <= 0:
            raise ValueError("cpu_limit must be positive")
        if self.memory_limit_mb <= 0:
            raise ValueError("memory_limit_mb must be positive")
        if self.gpu_uuids and len(self.gpu_uuids) != len(self.gpu_indices):
            raise ValueError("gpu_uuids, when given, must match gpu_indices one to one")
        if any(not 0 < p < 65536 for p in self.ports):
            raise ValueError("ports must be TCP ports (1-65535)")
        if not self.volume_dir.startswith("/"):
            raise ValueError("volume_dir must be an absolute path")
        for name in ("data_dir", "seed_dir"):
            value = getattr(self, name)
            if value and not value.startswith("/"):
                raise ValueError(f"{name} must be an absolute path")

    def __repr__(self) -> str:
        # Tracebacks and debug logs of a spec must not carry its secrets' values.
        return f"ContainerSpec(rental_id={self.rental_id!r}, run_id={self.run_id!r}, ...)"

    def secrets_dir(self) -> str:
        """The host directory of the run's secret files, beside (never inside) its synced
        workspace; a name no rental id has."""
        return os.path.join(os.path.dirname(self.volume_dir), f".secrets-{self.run_id}")

    def managed_labels(self) -> dict[str, str]:
        """The caller's labels plus ours; ours win so a spec cannot disguise another run."""
        return {
            **self.labels,
            LABEL_MANAGED: "1",
            LABEL_RENTAL: self.rental_id,
            LABEL_RUN: self.run_id,
            LABEL_NODE: self.node_id,
        }


@dataclass(frozen=True, slots=True)
class ContainerState:
    """What the runtime reports about one run; the agent forwards it in its heartbeat."""

    rental_id: str
    run_id: str
    status: ContainerStatus
    exit_code: int | None
    started_at: float | None  # unix time
    finished_at: float | None
    ports: Mapping[int, int]  # container port -> host port
    node_id: str | None = None
    oom_killed: bool = False  # killed by the kernel for exceeding memory_limit_mb (Docker only)
    # A process in the run's network namespace while it runs (Docker only): the agent enters
    # that namespace to publish the run's ports (nodeagent/publish.py).
    netns_pid: int | None = None

    @classmethod
    def missing(cls, run_id: str, rental_id: str = "") -> ContainerState:
        return cls(
            rental_id=rental_id,
            run_id=run_id,
            status=ContainerStatus.MISSING,
            exit_code=None,
            started_at=None,
            finished_at=None,
            ports={},
        )


@runtime_checkable
class RuntimeDriver(Protocol):
    """One container runtime behind the interface the node agent reconciles with."""

    name: str

    def list_managed(self) -> list[ContainerState]:
        """Every run carrying our managed label (this node's only, when configured), any state."""
        ...

    def state(self, run_id: str) -> ContainerState:
        """The state of one run; status "missing" when it does not exist."""
        ...

    def start(self, spec: ContainerSpec) -> ContainerState:
        """Start the run; an existing run with the same run_id is returned, never duplicated."""
        ...

    def stop(self, run_id: str, grace_s: float) -> None:
        """SIGTERM, wait up to grace_s, then SIGKILL; no error when it is already gone."""
        ...

    def remove(self, run_id: str) -> None:
        """Remove the run (killing it if still running), and the rental's volume dir once no
        run of the rental is left: the agent removes a run only after its final sync."""
        ...

    def logs_tail(self, run_id: str, lines: int = 50) -> str:
        """The last lines of stdout and stderr, interleaved."""
        ...

    def output_since(self, run_id: str, cursor: str | None) -> tuple[list[str], str]:
        """Complete stdout lines written after `cursor` (opaque; None: from the start)."""
        ...


def secret_files_write(
    spec: ContainerSpec, *, owner: tuple[int, int] | None, readable_by_all: bool = False
) -> str:
    """Write the run's file secrets into its secrets directory (0500, each file 0400, owned by
    the run's user when the agent can give them away; `readable_by_all`: an agent that cannot,
    for a container user it is not); the directory, or "" when the run has none. Written again
    at each start, so a replaced secret is what a restarted run reads."""
    files = [secret for secret in spec.secrets if secret.file]
    if not files:
        return ""
    directory = spec.secrets_dir()
    os.makedirs(directory, mode=0o700, exist_ok=True)
    os.chmod(directory, 0o700)
    for secret in files:
        name = os.path.basename(secret.file)
        if not name or name.startswith(".") or secret.file != f"{CONTAINER_SECRETS}/{name}":
            raise PermanentRuntimeError(f"secret {secret.name}: not a file of {CONTAINER_SECRETS}")
        path = os.path.join(directory, name)
        with contextlib.suppress(FileNotFoundError):
            os.chmod(path, 0o600)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secret.value)
        os.chmod(path, 0o444 if readable_by_all else 0o400)
        if owner is not None:
            os.chown(path, *owner)
    if owner is not None:
        os.chown(directory, *owner)
    os.chmod(directory, 0o555 if readable_by_all else 0o500)
    return directory


def secret_files_remove(directory: str) -> None:
    """Delete a run's secrets directory (its files are read-only, the directory too)."""
    if not os.path.basename(directory).startswith(".secrets-") or not os.path.isdir(directory):
        return
    os.chmod(directory, 0o700)
    shutil.rmtree(directory, ignore_errors=True)


def gpu_env(
    *, gpu_mode: str, gpu_indices: tuple[int, ...], gpu_uuids: tuple[str, ...], in_container: bool
) -> dict[str, str]:
    """Environment telling CUDA (or the harness, for simulated GPUs) which GPUs are the rental's.

    With the NVIDIA runtime the container only sees its own GPUs, renumbered 0..n-1. A host
    process sees every GPU, so it is pointed at its own by UUID (stable, unlike CUDA's default
    ordering of indices, which is not nvidia-smi's). Simulated GPUs are no CUDA devices at all:
    CUDA is hidden and the indices travel in GPUMARKET_SIMULATED_GPUS.
    """
    env = {"GPUMARKET_GPU_COUNT": str(len(gpu_indices))}
    if gpu_mode == "nvidia":
        if in_container:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(len(gpu_indices)))
        elif gpu_uuids:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpu_uuids)
        else:
            env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in gpu_indices)
    elif gpu_mode == "none":
        env["CUDA_VISIBLE_DEVICES"] = ""
        env["GPUMARKET_SIMULATED_GPUS"] = ",".join(str(i) for i in gpu_indices)
    else:
        raise ValueError(f"gpu_mode must be 'nvidia' or 'none', not {gpu_mode!r}")
    return env


def run_env(
    spec: ContainerSpec, *, gpu_mode: str, in_container: bool, workspace: str, data_dir: str = ""
) -> dict:
    """The full environment of a run: the caller's, then ours (ours win where they overlap).

    Every run, on every runtime, gets GPUMARKET_WORKSPACE (its writable output directory, which
    is also its working directory) and GPUMARKET_DATA_DIR (one read-only directory per dataset
    in it): /workspace and /data in a container, host paths for a host process, which cannot
    have those root-level paths (see nodeagent.runtime.process). Programs that find their files
    through these two variables behave the same on both runtimes. `data_dir` "" in a container
    still names /data, which then does not exist: no dataset was staged.

    Defaults the caller may override: unbuffered Python (metrics lines reach the agent as they
    are printed) and one intra-op thread per granted core (torch otherwise starts one per host
    core and oversubscribes the CPU share).
    """
    threads = str(max(1, int(spec.cpu_limit)))
    env = {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
    env.update(spec.env)
    env.update({secret.env: secret.value for secret in spec.secrets if secret.env})
    env.update(
        gpu_env(
            gpu_mode=gpu_mode,
            gpu_indices=spec.gpu_indices,
            gpu_uuids=spec.gpu_uuids,
            in_container=in_container,
        )
    )
    env.update(
        {
            "GPUMARKET_RENTAL_ID": spec.rental_id,
            "GPUMARKET_RUN_ID": spec.run_id,
            "GPUMARKET_WORKSPACE": workspace,
            "GPUMARKET_DATA_DIR": data_dir or (CONTAINER_DATA if in_container else ""),
        }
    )
    if any(secret.file for secret in spec.secrets):
        env["GPUMARKET_SECRETS_DIR"] = CONTAINER_SECRETS if in_container else spec.secrets_dir()
    if not env["GPUMARKET_DATA_DIR"]:
        raise ValueError("a host process needs a data_dir (an empty one when nothing is staged)")
    return env
