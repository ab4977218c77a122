"""Local-process runtime driver: runs rentals as host processes, for hosts without Docker.

The one-command dev stack uses it with simulated GPUs. Layout per run, under the state dir
(the process driver's equivalent of container labels; a restarted agent re-reads it):

    <state_dir>/<run_id>/meta.json     labels and spec, written before the process starts
                         wrapper.lock  held (flock) by the run's supervisor while it lives
                         child.json    pid + kernel start time of the command
                         stdout.log    the command's stdout          (output_since)
                         output.log    stdout and stderr interleaved (logs_tail)
                         exit.json     exit code and finish time, written by the supervisor

The command runs under a small supervisor (`_process_wrapper.py`, started in its own session) that
records the exit code, so the code survives an agent restart. A process is only ever signalled
after checking its pid *and* its kernel start time, so a recycled pid is never mistaken for it.

Limits are best effort, unlike Docker: no cgroup is created, so cpu_limit and memory_limit_mb are
not enforced. cpu_limit sets OMP_NUM_THREADS/MKL_NUM_THREADS (what actually bounds torch's CPU
use); memory is not limited (RLIMIT_AS would break CUDA and torch's allocator). Ports are opened
directly on the host, so a port maps to itself. Linux only (/proc, flock, process groups).

Paths. A container sees its workspace at /workspace (also its working directory) and its datasets
at /data/NAME; a host process cannot: creating or mounting over /workspace and /data takes root
(or a mount namespace), and two runs would share them. A host process instead runs with its
working directory = its workspace (the rental's volume directory), and finds both through the
variables every runtime sets (nodeagent.runtime.base.run_env): GPUMARKET_WORKSPACE (the volume
directory) and GPUMARKET_DATA_DIR (the staged `data/` directory, one read-only NAME directory per
dataset; with no dataset, an empty read-only directory in the volume root, EMPTY_DATA_DIR). The
harness, the checkpoint the agent seeds for a resume and the synced output all go through them,
so a program that uses the variables (or relative paths from its working directory) behaves the
same on both runtimes; one that hard-codes /data or /workspace works in containers only.

This is no isolation boundary, so it is for development with simulated GPUs only: a run asking
for real GPUs is refused. The command gets a scrubbed environment (a few variables, never the
agent's), and when the agent runs as root it runs as an unprivileged uid (`run_as_uid`), which
cannot read the agent's state dir (the node token: 0600, in a 0700 directory) nor the run
records; as a non-root agent it shares the agent's uid, as any local development process does.

Network: a run is a host process on the host's own network, whatever its spec's `network` asks
(`internet` or `internal`): nothing is filtered and nothing is cut off. The agent therefore
declares at join that it does not filter (`internet_filtered` false), and the server accepts
rentals with the internet on such a node only when it is simulated (the demo hosts of
`dev.py up`), so the demo books the default rental while a real host never gets an unfiltered
one (marketplace.services.node_internet_capable; docs/usage.md, Networking).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from agentprotocol import ContainerStatus
from nodeagent.runtime._process_wrapper import proc_stat, write_json_atomic
from nodeagent.runtime.base import (
    LABEL_MANAGED,
    ContainerSpec,
    ContainerState,
    PermanentRuntimeError,
    RunNotFoundError,
    run_env,
    secret_files_remove,
    secret_files_write,
)
from nodeagent.staging import workspace_delete, workspace_seed

logger = logging.getLogger(__name__)

WRAPPER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_process_wrapper.py")

# The GPUMARKET_DATA_DIR of a run without datasets: empty and read-only, in the volume root
# (searchable by the run's user, like the workspace beside it; no rental id starts with ".").
EMPTY_DATA_DIR = ".no-datasets"

# After SIGKILL the supervisor needs a moment to notice the exit and record it.
_RECORD_EXIT_WAIT_S = 5.0
_POLL_S = 0.05
# A start waits for its supervisor's child.json: polled finely, every start waits on it.
_START_POLL_S = 0.005


@dataclass(frozen=True, slots=True)
class ProcessDriverConfig:
    """Where runs live and how their environment is made."""

    state_dir: str
    gpu_mode: str = "none"  # simulated GPUs only: real ones need the Docker runtime
    node_id: str | None = None  # when set, list_managed only returns this node's runs
    # A command starting with "python"/"python3" runs under this interpreter, so the harness
    # command written for the image also works on a host (None: leave the command as is).
    python_executable: str | None = sys.executable
    # The agent's variables a run inherits; everything else comes from the spec and extra_env.
    inherit_env: tuple[str, ...] = ("PATH", "HOME", "LANG", "LC_ALL", "TZ", "TMPDIR", "USER")
    extra_env: Mapping[str, str] = field(default_factory=dict)
    # Who the command runs as when the agent is root (nobody:nogroup by default).
    run_as_uid: int = 65534
    run_as_gid: int = 65534
    # The NVIDIA driver lists the host's GPUs here (one directory each, with its UUID): a run
    # naming one of them is refused, whatever the server believes the node has.
    nvidia_proc_dir: str = "/proc/driver/nvidia/gpus"

    def __post_init__(self) -> None:
        if self.gpu_mode != "none":
            raise ValueError(
                "the process runtime runs simulated GPUs only (gpu_mode 'none'); real GPUs need "
                "the docker runtime, which isolates the rental"
            )
        if not os.path.isabs(self.state_dir):
            raise ValueError("state_dir must be an absolute path")


def _process_alive(pid: int, start_ticks: int | None) -> bool:
    """True if pid is still the process that was started (same start time), not a zombie."""
    stat = proc_stat(pid)
    return stat is not None and stat[0] not in ("Z", "X") and stat[1] == start_ticks


def _read_json(path: str) -> dict[str, Any] | None:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return None
    except json.JSONDecodeError:
        # Written atomically, so this is damage, not a torn write; treat it as absent.
        logger.warning("unreadable run file", extra={"path": path})
        return None


class LocalProcessDriver:
    """RuntimeDriver running each run as a supervised host process group."""

    name = "process"

    def __init__(self, config: ProcessDriverConfig) -> None:
        self.config = config
        os.makedirs(config.state_dir, mode=0o700, exist_ok=True)
        self._lock = threading.Lock()
        # Supervisors we started are our children: keep their handles to reap them.
        self._supervisors: dict[str, subprocess.Popen[bytes]] = {}

    # -- the RuntimeDriver interface ---------------------------------------------------------

    def list_managed(self) -> list[ContainerState]:
        self._reap()
        states = []
        for run_id in sorted(os.listdir(self.config.state_dir)):
            if not os.path.isdir(self._run_dir(run_id)):
                continue
            meta = _read_json(os.path.join(self._run_dir(run_id), "meta.json"))
            if meta is None or meta.get("labels", {}).get(LABEL_MANAGED) != "1":
                continue
            if self.config.node_id is not None and meta.get("node_id") != self.config.node_id:
                continue
            states.append(self._state_from_dir(run_id, meta))
        return states

    def state(self, run_id: str) -> ContainerState:
        self._reap()
        meta = self._meta(run_id)
        if meta is None:
            return ContainerState.missing(run_id)
        return self._state_from_dir(run_id, meta)

    def start(self, spec: ContainerSpec) -> ContainerState:
        log_extra = {"run_id": spec.run_id, "rental_id": spec.rental_id}
        real = set(spec.gpu_uuids) & self._host_gpu_uuids()
        if real:
            raise PermanentRuntimeError(
                f"the process runtime does not run real GPUs ({', '.join(sorted(real))}): it "
                "does not isolate the rental; use the docker runtime"
            )
        if spec.ssh_authorized_keys:
            # An sshd among the host's processes would be a way into the host, not the rental.
            raise PermanentRuntimeError(
                "the process runtime cannot give SSH access: a rental's process shares the "
                "host; use the docker runtime"
            )
        if spec.jupyter_token:
            raise PermanentRuntimeError(
                "the process runtime cannot run JupyterLab: its port would be open on the "
                "host; use the docker runtime"
            )
        with self._locked():
            meta = self._meta(spec.run_id)
            if meta is not None:
                state = self._state_from_dir(spec.run_id, meta)
                if state.status != ContainerStatus.CREATED:
                    logger.info("run exists, adopting it", extra=log_extra)
                    return state
                # A previous start died before the supervisor came up: start it now.
            else:
                meta = self._write_meta(spec)
            meta = self._spawn(spec, meta)
        # Outside the lock: the node's other starts spawn their supervisors meanwhile, so
        # starts on one node overlap instead of queueing behind each one's interpreter start.
        state = self._wait_started(spec.run_id, meta)
        logger.info("process started", extra=log_extra)
        return state

    def stop(self, run_id: str, grace_s: float) -> None:
        run_dir = self._run_dir(run_id)
        if self._meta(run_id) is None:
            return
        child = self._child(run_id, wait=True)
        if child is not None and _process_alive(child["pid"], child["start_ticks"]):
            pid = child["pid"]
            self._signal_group(pid, signal.SIGTERM)
            if not self._wait_dead(child, grace_s):
                logger.info("grace period over, killing", extra={"run_id": run_id})
                self._signal_group(pid, signal.SIGKILL)
                self._wait_dead(child, _RECORD_EXIT_WAIT_S)
        # Let the supervisor record the exit code before we report back.
        deadline = time.monotonic() + _RECORD_EXIT_WAIT_S
        while self._supervisor_alive(run_dir) and time.monotonic() < deadline:
            time.sleep(_POLL_S)
        self._reap()
        logger.info("process stopped", extra={"run_id": run_id, "grace_s": grace_s})

    def remove(self, run_id: str) -> None:
        run_dir = self._run_dir(run_id)
        if not os.path.isdir(run_dir):
            return
        self.stop(run_id, grace_s=0)
        volume_dir = ((self._meta(run_id) or {}).get("spec") or {}).get("volume_dir")
        with self._locked():
            if isinstance(volume_dir, str) and volume_dir:
                secret_files_remove(os.path.join(os.path.dirname(volume_dir), f".secrets-{run_id}"))
            self._delete_workspace_if_unused(run_id)
            shutil.rmtree(run_dir, ignore_errors=True)
            self._supervisors.pop(run_id, None)
        logger.info("process removed", extra={"run_id": run_id})

    def _delete_workspace_if_unused(self, run_id: str) -> None:
        """Delete the rental's volume dir when `run_id` is its last run here (under the lock,
        so no start of another run of the rental is in between). Before the run's own record:
        a crash in between leaves the record, and the next removal finishes."""
        meta = self._meta(run_id) or {}
        rental_id = meta.get("rental_id")
        volume_dir = (meta.get("spec") or {}).get("volume_dir", "")
        if not rental_id or not volume_dir or os.path.basename(volume_dir) != rental_id:
            return
        for other in os.listdir(self.config.state_dir):
            if other == run_id or not os.path.isdir(self._run_dir(other)):
                continue
            if (self._meta(other) or {}).get("rental_id") == rental_id:
                return
        workspace_delete(volume_dir)

    def logs_tail(self, run_id: str, lines: int = 50) -> str:
        path = os.path.join(self._existing_run_dir(run_id), "output.log")
        return _tail(path, lines)

    def output_since(self, run_id: str, cursor: str | None) -> tuple[list[str], str]:
        """New complete stdout lines; the cursor is the byte offset in stdout.log."""
        path = os.path.join(self._existing_run_dir(run_id), "stdout.log")
        try:
            offset = int(cursor) if cursor else 0
        except ValueError:
            raise ValueError(f"not a cursor of this driver: {cursor!r}") from None
        try:
            with open(path, "rb") as f:
                f.seek(offset)
                data = f.read()
        except FileNotFoundError:
            return [], str(offset)
        end = data.rfind(b"\n") + 1  # a line still being written waits for the next call
        lines = [
            line.decode("utf-8", errors="replace").rstrip("\r")
            for line in data[:end].split(b"\n")[:-1]
        ]
        return lines, str(offset + end)

    # -- helpers -----------------------------------------------------------------------------

    def _run_dir(self, run_id: str) -> str:
        if "/" in run_id or run_id in ("", ".", ".."):
            raise ValueError(f"invalid run_id {run_id!r}")
        return os.path.join(self.config.state_dir, run_id)

    def _existing_run_dir(self, run_id: str) -> str:
        run_dir = self._run_dir(run_id)
        if not os.path.isfile(os.path.join(run_dir, "meta.json")):
            raise RunNotFoundError(f"no process for run {run_id}")
        return run_dir

    def _meta(self, run_id: str) -> dict[str, Any] | None:
        return _read_json(os.path.join(self._run_dir(run_id), "meta.json"))

    def _child(
        self, run_id: str, *, wait: bool = False, poll_s: float = _POLL_S
    ) -> dict[str, Any] | None:
        """child.json; with wait, give a supervisor that is still starting up time to write it."""
        run_dir = self._run_dir(run_id)
        path = os.path.join(run_dir, "child.json")
        deadline = time.monotonic() + (_RECORD_EXIT_WAIT_S if wait else 0)
        while True:
            child = _read_json(path)
            if child is not None or time.monotonic() >= deadline:
                return child
            if os.path.exists(os.path.join(run_dir, "exit.json")):
                return None
            if not self._supervisor_alive(run_dir):
                return None
            time.sleep(poll_s)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """Serialise starts: between threads, and between agent processes sharing a state dir."""
        with self._lock, open(os.path.join(self.config.state_dir, ".lock"), "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def _write_meta(self, spec: ContainerSpec) -> dict[str, Any]:
        run_dir = self._run_dir(spec.run_id)
        os.makedirs(run_dir, mode=0o700, exist_ok=True)
        meta = {
            "rental_id": spec.rental_id,
            "run_id": spec.run_id,
            "node_id": spec.node_id,
            "labels": spec.managed_labels(),
            # Neither the env (it may hold the customer's credentials) nor the team secrets.
            "spec": {
                k: v
                for k, v in asdict(spec).items()
                if k not in ("env", "secrets", "registry_auth")
            },
            "created_at": time.time(),
        }
        write_json_atomic(os.path.join(run_dir, "meta.json"), meta)
        return meta

    def _command(self, spec: ContainerSpec) -> list[str]:
        command = list(spec.command)
        if not command:
            raise PermanentRuntimeError("the process driver needs a command (there is no image)")
        if self.config.python_executable and command[0] in ("python", "python3"):
            command[0] = self.config.python_executable
        return command

    def _host_gpu_uuids(self) -> set[str]:
        uuids = set()
        try:
            entries = os.listdir(self.config.nvidia_proc_dir)
        except OSError:
            return uuids  # no NVIDIA driver loaded: no real GPUs to protect
        for entry in entries:
            path = os.path.join(self.config.nvidia_proc_dir, entry, "information")
            with contextlib.suppress(OSError), open(path) as f:
                for line in f:
                    key, _, value = line.partition(":")
                    if key.strip() == "GPU UUID":
                        uuids.add(value.strip())
        return uuids

    def _drops_privileges(self) -> bool:
        return os.geteuid() == 0

    def _env(self, spec: ContainerSpec) -> dict[str, str]:
        env = {k: os.environ[k] for k in self.config.inherit_env if k in os.environ}
        if self._drops_privileges():
            env.update({"HOME": spec.volume_dir, "USER": "nobody"})  # not root's
        env.update(self.config.extra_env)
        env.update(
            run_env(
                spec,
                gpu_mode=self.config.gpu_mode,
                in_container=False,
                workspace=spec.volume_dir,
                data_dir=self._data_dir(spec),
            )
        )
        return env

    @staticmethod
    def _data_dir(spec: ContainerSpec) -> str:
        """The staged datasets, else an empty read-only directory: the variable is always set
        and always names a directory, so listing it lists the run's datasets (none)."""
        if spec.data_dir:
            return spec.data_dir
        empty = os.path.join(os.path.dirname(os.path.abspath(spec.volume_dir)), EMPTY_DATA_DIR)
        os.makedirs(empty, exist_ok=True)
        os.chmod(empty, 0o555)  # noqa: S103 - the run's user (another uid) lists it
        return empty

    def _spawn(self, spec: ContainerSpec, meta: dict[str, Any]) -> dict[str, Any]:
        run_dir = self._run_dir(spec.run_id)
        os.makedirs(spec.volume_dir, exist_ok=True)
        command = self._command(spec)
        env = self._env(spec)
        user_args: list[str] = []
        owner = None
        if self._drops_privileges():
            uid, gid = self.config.run_as_uid, self.config.run_as_gid
            _check_traversable(os.path.dirname(os.path.abspath(spec.volume_dir)), uid, gid)
            if spec.data_dir:
                _check_traversable(spec.data_dir, uid, gid)
            os.chown(spec.volume_dir, uid, gid)
            user_args = ["--user", f"{uid}:{gid}"]
            owner = (uid, gid)
        if spec.seed_dir:
            workspace_seed(spec.seed_dir, spec.volume_dir, owner=owner)
        secret_files_write(spec, owner=owner)
        lock_fd = os.open(os.path.join(run_dir, "wrapper.lock"), os.O_CREAT | os.O_RDWR, 0o600)
        try:
            # Locked here and inherited: the lock is held from the supervisor's first instant,
            # so there is no moment where a live supervisor looks absent.
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            with open(os.path.join(run_dir, "wrapper.log"), "ab") as wrapper_log:
                proc = subprocess.Popen(
                    # -S: the supervisor is stdlib only, and site-packages cost its start.
                    [sys.executable, "-I", "-S", WRAPPER, run_dir, *user_args, "--", *command],
                    cwd=spec.volume_dir,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=wrapper_log,
                    stderr=wrapper_log,
                    start_new_session=True,
                    pass_fds=(lock_fd,),
                )
        except BlockingIOError:
            raise PermanentRuntimeError(f"run {spec.run_id} already has a supervisor") from None
        finally:
            os.close(lock_fd)
        self._supervisors[spec.run_id] = proc
        meta = {**meta, "supervisor_pid": proc.pid, "spawned_at": time.time()}
        write_json_atomic(os.path.join(run_dir, "meta.json"), meta)
        return meta

    def _wait_started(self, run_id: str, meta: dict[str, Any]) -> ContainerState:
        # Report "running" with its start time, like `docker start` returning after the start.
        self._child(run_id, wait=True, poll_s=_START_POLL_S)
        return self._state_from_dir(run_id, self._meta(run_id) or meta)

    def _supervisor_alive(self, run_dir: str) -> bool:
        try:
            fd = os.open(os.path.join(run_dir, "wrapper.lock"), os.O_RDWR)
        except FileNotFoundError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)  # closing also releases a lock we just took
        return False

    def _state_from_dir(self, run_id: str, meta: dict[str, Any]) -> ContainerState:
        run_dir = self._run_dir(run_id)
        child = _read_json(os.path.join(run_dir, "child.json"))
        exit_info = _read_json(os.path.join(run_dir, "exit.json"))
        status = ContainerStatus.EXITED
        if exit_info is None:
            if child is not None and _process_alive(child["pid"], child["start_ticks"]):
                status = ContainerStatus.RUNNING
            elif self._supervisor_alive(run_dir):
                status = ContainerStatus.RUNNING  # starting up, or recording the exit right now
            else:
                # The supervisor may have recorded the exit and gone since we first looked.
                exit_info = _read_json(os.path.join(run_dir, "exit.json"))
                if exit_info is None and "supervisor_pid" not in meta:
                    status = ContainerStatus.CREATED
        ports = tuple(meta.get("spec", {}).get("ports", ()))
        finished = (
            exit_info["finished_at"] if exit_info and status == ContainerStatus.EXITED else None
        )
        return ContainerState(
            rental_id=meta.get("rental_id", ""),
            run_id=run_id,
            status=status,
            # None for an exit nobody saw (supervisor killed, host rebooted).
            exit_code=exit_info["exit_code"] if exit_info else None,
            started_at=child["started_at"] if child else None,
            finished_at=finished,
            ports={p: p for p in ports} if status == ContainerStatus.RUNNING else {},
            node_id=meta.get("node_id"),
        )

    def _wait_dead(self, child: dict[str, Any], timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while _process_alive(child["pid"], child["start_ticks"]):
            if time.monotonic() >= deadline:
                return False
            time.sleep(_POLL_S)
        return True

    @staticmethod
    def _signal_group(pgid: int, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signum)

    def _reap(self) -> None:
        for run_id, proc in list(self._supervisors.items()):
            if proc.poll() is not None:
                self._supervisors.pop(run_id, None)


def _check_traversable(directory: str, uid: int, gid: int) -> None:
    """PermanentRuntimeError unless uid:gid may pass through `directory` and its ancestors:
    the command finds its workspace by its absolute path (GPUMARKET_WORKSPACE)."""
    path = directory
    while True:
        st = os.stat(path)
        if st.st_uid == uid:
            bit = stat.S_IXUSR
        elif st.st_gid == gid:
            bit = stat.S_IXGRP
        else:
            bit = stat.S_IXOTH
        if not st.st_mode & bit:
            raise PermanentRuntimeError(
                f"{path} is closed to uid {uid}, which runs the command: the volume root and "
                "its parents must be searchable by it (o+x)"
            )
        parent = os.path.dirname(path)
        if parent == path:
            return
        path = parent


def _tail(path: str, lines: int) -> str:
    """The last `lines` lines of a file, reading backwards in blocks (logs can be large)."""
    if lines <= 0:
        return ""
    try:
        f = open(path, "rb")  # noqa: SIM115
    except FileNotFoundError:
        return ""
    with f:
        f.seek(0, os.SEEK_END)
        end = f.tell()
        block, data = 8192, b""
        pos = end
        while pos > 0 and data.count(b"\n") <= lines:
            read = min(block, pos)
            pos -= read
            f.seek(pos)
            data = f.read(read) + data
    text = data.decode("utf-8", errors="replace")
    return "".join(text.splitlines(keepends=True)[-lines:])
