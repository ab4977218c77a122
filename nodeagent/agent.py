"""The node agent: join once, then heartbeat and reconcile, like a kubelet.

Each round (`Agent.tick`):

1. observe: the runtime's managed runs (`driver.list_managed()`), in any state;
2. spool usage: one report per running run (confirmed_at = now) and one final report per run
   that has exited (confirmed_at = when this agent last saw it running), appended durably to the
   spool before anything is sent;
3. read output: new stdout lines of each run since its cursor; lines that pass
   `agentprotocol.untrusted.metric_line_parse` (a bounded JSON object, at most 4 KB) are
   forwarded as metrics, at most 500 per heartbeat. Output is untrusted: a line that looks like
   a metric and is not one (too deep, NaN, a step past 2^31, control characters) is dropped,
   counted per run and logged, and the cursor moves past it like past any other line;
4. heartbeat: telemetry, the runs' states (with the log tail of exited ones), the unacknowledged
   spool (oldest first), metrics and a finished benchmark; the answer is the desired state;
5. on that answer: drop acknowledged usage, record how far metrics went, mark exited runs as
   delivered, and reconcile (`plan_reconcile`): starts, stops and removals run in worker
   threads, so a stop's grace period never holds up the heartbeats.

A start first stages the run's datasets and resume checkpoint (`nodeagent.staging`, through the
node's content-addressed cache): nothing runs and nothing is billed until that is done, and a
staging failure is reported like any start that cannot succeed. A run asking for artifact sync
has its output directory synced (`nodeagent.artifacts`, a background thread) at each
checkpoint line it prints, every SYNC_INTERVAL_S while it runs, and once more after it exits;
its exit is reported only after that final sync, so the server takes its last uploads while it
still believes the run is running, and a restarted agent finishes what was not committed.

Nothing of a rental stays on the host: a run's container is removed only after its exit and
final sync were delivered, and its removal deletes the rental's workspace once no run of it is
left (the runtime driver), then its stage dir when the run is forgotten; a restarted agent
sweeps what an earlier one left (`_sweep_leftovers`). Only the content-addressed dataset cache
(read-only, keyed by sha256) is kept for later runs.

The runtime is the source of truth for what runs (labels, so a restarted agent adopts its runs);
the spool directory only keeps what billing and metrics need across restarts (see `spool`).

Between rounds the agent waits for its interval, or less: a run that has just started or failed
to, a run whose state changed in the runtime (listed every RUNS_POLL_S: an exit, a crash), and
the server's wake channel (`nodeagent.wake`: a long-poll named in the heartbeat answer, answered
when the node's desired state changes), cut the wait short, so a run's lifecycle reaches the
server at once however long the interval. The wake channel is only a hint: without it, or with
it down, rounds come at the interval as before. A heartbeat the server refused before any work
(503 with Retry-After: it is at its bound of heartbeats in flight) is not resent at once: the
next round comes after the Retry-After, at the interval the refusal names.

If the server is unreachable, rounds go on with growing delays (bounded exponential backoff with
jitter): runs keep running, usage keeps being spooled and is replayed later. A 401 means the node
token was revoked: the agent logs it and exits non-zero instead of retrying forever.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import json
import logging
import os
import re
import secrets
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

import structlog

from agentprotocol import (
    CachedImage,
    ContainerReport,
    ContainerStatus,
    DesiredRun,
    GpuSample,
    Heartbeat,
    HeartbeatAnswer,
    JoinAnswer,
    LogLine,
    MetricLine,
    ProtocolError,
    PullProgress,
    UsageReport,
)
from agentprotocol.images import allow_patterns, image_allowed
from agentprotocol.untrusted import mask_terms, metric_line_parse, secrets_mask, text_sanitize
from nodeagent import hostinfo
from nodeagent import metrics as metrics_module
from nodeagent.artifacts import ArtifactSyncer
from nodeagent.benchmark import DEFAULT_COMMAND, BenchmarkRunner, benchmark_env
from nodeagent.client import (
    AgentApiClient,
    AgentApiError,
    AuthRejectedError,
    RequestRejectedError,
    ServerBusyError,
    TransientApiError,
    backoff_delay,
)
from nodeagent.config import AgentConfig, ConfigError
from nodeagent.imagecache import ImageCache
from nodeagent.publish import Publisher, wanted_ports
from nodeagent.reconcile import plan_reconcile
from nodeagent.runtime import create_driver, gangnet
from nodeagent.runtime.base import (
    ContainerSpec,
    ContainerState,
    PermanentRuntimeError,
    RuntimeDriver,
    RuntimeDriverError,
)
from nodeagent.spool import RunLedger, RunRecord, UsageSpool, write_atomic
from nodeagent.staging import (
    ContentCache,
    StagedRun,
    stage_dir_remove,
    stage_run,
    workspace_delete,
)
from nodeagent.telemetry import SampleWatchdog, TelemetryError, TelemetrySource, create_source
from nodeagent.telemetry.simulated import (
    parse_simulate_gpus,
    simulated_benchmark,
    simulated_host,
)
from nodeagent.wake import WakeListener

logger = logging.getLogger(__name__)

try:
    AGENT_VERSION = metadata.version("gpumarket")
except metadata.PackageNotFoundError:  # running from a checkout that was never installed
    AGENT_VERSION = "dev"

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_REJECTED = 3  # the server refused us: join token refused, node token revoked

TOKEN_FILE = "node_token.json"
# This host's own secret, sent with every join attempt: a join whose answer was lost (the
# server committed, the request timed out here) is repeated with the same token and key, and
# the server hands back the same node with a fresh node token.
HOST_KEY_FILE = "host_key"
SPOOL_DIR = "spool"
CACHE_DIR = "cache"  # staged files by content (nodeagent.staging)
STAGE_DIR = ".staging"  # under the volume root: what each run reads (rental ids never start so)
# A running run's output dir is synced at each checkpoint it announces, and at least this often
# (files it writes without announcing them).
SYNC_INTERVAL_S = 60.0

USAGE_PER_HEARTBEAT = 1000
METRICS_PER_HEARTBEAT = 500
# The server refuses bodies over 1 MiB; metrics get half of that.
METRICS_BYTES_PER_HEARTBEAT = 512 * 1024
# A run's unsent lines: past this, its output waits in the runtime's log instead of in memory.
RUN_BUFFER_LINES = 2 * METRICS_PER_HEARTBEAT
LOG_TAIL_LINES = 50
# The live log: every output line, numbered; a run's unsent lines past LOG_BUFFER_LINES are
# dropped oldest first (the numbers then show the gap), and a heartbeat carries at most
# LOGS_PER_HEARTBEAT lines / LOGS_BYTES_PER_HEARTBEAT, LOG_LINE_MAX_CHARS each.
LOG_BUFFER_LINES = 2000
LOGS_PER_HEARTBEAT = 400
LOGS_BYTES_PER_HEARTBEAT = 128 * 1024
LOG_LINE_MAX_CHARS = 2000
LOG_TAIL_MAX_BYTES = 8192
MIN_INTERVAL_S, MAX_INTERVAL_S = 1.0, 300.0
MAX_RETRY_DELAY_S = 60.0
# Between rounds the runtime's runs are listed this often: an exit is sent at once.
RUNS_POLL_S = 1.0
START_RETRY_BASE_S, START_RETRY_MAX_S = 10.0, 300.0
TELEMETRY_TIMEOUT_S = 5.0
OP_WORKERS = 16
# While an image is pulled, its progress goes out at most this often (a heartbeat is sent early
# for it); the cached images are listed and pruned to their budget this often besides after
# each start.
PULL_REPORT_S = 2.0
# Runs handed over together start together: the last of their starts to end wakes the loop,
# so one heartbeat reports them all RUNNING (each report is a lifecycle transition on the
# server). One that ends while others still start waits at most this long for them.
START_REPORT_GRACE_S = 1.0
IMAGE_PASS_S = 60.0
MAX_REPORTED_IMAGES = 1000

# Rental ids name the volume directory: no separators, no "..".
_SAFE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


@dataclass(frozen=True, slots=True)
class Credentials:
    node_id: int
    node_token: str


def host_key(state_dir: str) -> str:
    """This host's join secret, made once and kept in the state directory."""
    path = os.path.join(state_dir, HOST_KEY_FILE)
    try:
        with open(path) as f:
            key = f.read().strip()
        if re.fullmatch(r"[A-Za-z0-9_-]{32,128}", key):
            return key
    except FileNotFoundError:
        pass
    key = secrets.token_urlsafe(32)
    write_atomic(path, key + "\n")
    return key


def load_credentials(state_dir: str) -> Credentials | None:
    path = os.path.join(state_dir, TOKEN_FILE)
    try:
        with open(path) as f:
            data = json.load(f)
        return Credentials(node_id=int(data["node_id"]), node_token=str(data["node_token"]))
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"{path} is damaged ({exc}); remove it and join again") from None


def save_credentials(state_dir: str, credentials: Credentials, *, server_url: str) -> None:
    data = {
        "node_id": credentials.node_id,
        "node_token": credentials.node_token,
        "server_url": server_url,
        "joined_at": time.time(),
    }
    write_atomic(os.path.join(state_dir, TOKEN_FILE), json.dumps(data) + "\n")


def metric_lines(lines: Sequence[str]) -> tuple[list[str], int]:
    """The metric lines among a run's output lines, and how many lines looked like metrics
    (they start with `{`) but were refused; other lines are the program's own log."""
    metrics, refused = [], 0
    for line in lines:
        if not line.startswith("{"):
            continue
        try:
            metric_line_parse(line)
        except ProtocolError:
            refused += 1
            continue
        metrics.append(line)
    return metrics, refused


def trim_log_tail(text: str) -> str:
    """The last LOG_TAIL_LINES lines, at most LOG_TAIL_MAX_BYTES (cut at a character), with
    control characters replaced: a NUL the container printed must not reach the server."""
    text = text_sanitize("".join(text.splitlines(keepends=True)[-LOG_TAIL_LINES:]))
    data = text.encode()
    if len(data) <= LOG_TAIL_MAX_BYTES:
        return text
    return data[-LOG_TAIL_MAX_BYTES:].decode(errors="ignore")


def _is_checkpoint(line: str) -> bool:
    """A harness checkpoint event (`{"event": "checkpoint", ...}`)."""
    if '"checkpoint"' not in line:
        return False
    try:
        return json.loads(line).get("event") == "checkpoint"
    except (ValueError, AttributeError):
        return False


def _log_extend(live: _Live, lines: Sequence[str]) -> None:
    """Number a read's lines and keep them for the live log, bounded: the oldest go first."""
    for line in lines:
        if live.next_line > live.log_sent:  # lines read again after a restart are not resent
            live.log_buffer.append((live.next_line, text_sanitize(line[:LOG_LINE_MAX_CHARS])))
        live.next_line += 1
    excess = len(live.log_buffer) - LOG_BUFFER_LINES
    if excess > 0:
        del live.log_buffer[:excess]
        live.log_dropped += excess


def _missing_report(rental_id: str, run_id: str, error: str) -> ContainerReport:
    return ContainerReport(
        rental_id=rental_id,
        run_id=run_id,
        status=ContainerStatus.MISSING,
        log_tail=trim_log_tail(f"cannot start: {error}\n"),
        error=text_sanitize(error[:500]),
    )


@dataclass(slots=True)
class _Live:
    """In-memory state of one run (what need not survive a restart)."""

    rental_id: str = ""
    buffer: list[str] = field(default_factory=list)  # metrics lines read, not yet delivered
    # Where delivery stands: reading from base_cursor and skipping base_skip metric lines gives
    # buffer[0]. Persisted after each delivery, so a restart resends nothing and loses nothing.
    base_cursor: str | None = None
    base_skip: int = 0
    read_cursor: str | None = None  # after the last read; None: not read since the start
    read_after_exit: bool = False  # the output was read after the run had exited: it is all
    delivered: bool = False  # exited state and all output reached the server
    last_seen_running: float | None = None
    log_tail: str | None = None
    start_error: str | None = None  # a permanent start failure, reported as "missing"
    start_failures: int = 0
    next_start_at: float = 0.0
    refused_lines: int = 0  # output lines that looked like metrics and were not
    checkpoint_seen: bool = False  # a checkpoint line since the last sync request
    last_sync_at: float = 0.0
    stop_requested: bool = False  # the server no longer wants it: its exit is a stop
    final_requested: bool = False
    # The live log: (line_no, line) read and not yet delivered; line numbers count every output
    # line of the run from 0, base_line being the number of the line at base_cursor.
    log_buffer: list[tuple[int, str]] = field(default_factory=list)
    base_line: int = 0
    next_line: int = 0
    log_dropped: int = 0
    log_sent: int = -1  # the highest line number delivered (persisted: a restart skips them)
    # Its secrets' values, blanked out of every line, tail and error before they are sent
    # (the server masks again); known from its desired entry, kept in memory only. None: not
    # known yet (this agent has not had an answer since it started).
    mask: tuple[str, ...] | None = None


class _Operations:
    """Starts, stops and removals in worker threads, at most one in flight per run."""

    def __init__(self) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(OP_WORKERS, thread_name_prefix="run-op")
        self._ops: dict[str, tuple[str, concurrent.futures.Future[Any]]] = {}

    def in_flight(self) -> set[str]:
        return set(self._ops)

    def submit(self, run_id: str, kind: str, fn: Callable[[], Any]) -> None:
        self._ops[run_id] = (kind, self._pool.submit(fn))

    def harvest(self) -> list[tuple[str, str, concurrent.futures.Future[Any]]]:
        done = [(run_id, kind, f) for run_id, (kind, f) in self._ops.items() if f.done()]
        for run_id, _, _ in done:
            del self._ops[run_id]
        return done

    def wait(self) -> None:
        concurrent.futures.wait([f for _, f in self._ops.values()])

    def shutdown(self) -> None:
        # Stops already running finish (their grace is bounded); queued ones are dropped and
        # redone by the next agent.
        self._pool.shutdown(wait=False, cancel_futures=True)


class Agent:
    """One node's agent; `run()` is the whole program."""

    def __init__(self, config: AgentConfig, *, clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self._clock = clock
        self.interval_s = config.interval_s
        self._client = AgentApiClient(config.server_url, timeout_s=config.request_timeout_s)
        os.makedirs(config.state_dir, mode=0o700, exist_ok=True)
        spool_dir = os.path.join(config.state_dir, SPOOL_DIR)
        self.spool = UsageSpool(spool_dir)
        self.ledger = RunLedger(spool_dir)
        # Simulated GPUs have no card to measure: the simulated card's figure stands in.
        simulated = (
            functools.partial(
                simulated_benchmark,
                hostname=config.hostname,
                model_slug=parse_simulate_gpus(config.simulate_gpus)[0],
            )
            if config.telemetry == "simulated" and config.simulate_gpus
            else None
        )
        if config.benchmark_command != DEFAULT_COMMAND:
            logger.warning(
                "--benchmark-command is ignored: the platform's benchmark runs as the server "
                "names it",
                extra={"ignored": " ".join(config.benchmark_command)},
            )
        self._benchmark = BenchmarkRunner(
            runtime=config.runtime,
            env=benchmark_env(gpu_mode=config.gpu_mode),
            timeout_s=config.benchmark_timeout_s,
            simulated=simulated,
        )
        self._ops = _Operations()
        self._live: dict[str, _Live] = {}
        self._stopping = threading.Event()
        # Set when a run has just started: the next heartbeat goes out at once, so the server
        # learns RUNNING without waiting a whole interval.
        self._wake = threading.Event()
        # The server's wake channel sets it too: a change of the desired state is heard at once.
        self._listener = WakeListener(server_url=config.server_url, on_wake=self._wake.set)
        self._telemetry: TelemetrySource | None = None
        self._watchdog: SampleWatchdog | None = None
        self._driver: RuntimeDriver | None = None
        self._credentials: Credentials | None = None
        self._cache = ContentCache(
            os.path.join(config.state_dir, CACHE_DIR), max_bytes=config.cache_max_bytes
        )
        self._stage_root = os.path.join(config.volume_root, STAGE_DIR)
        self._syncer = ArtifactSyncer(
            server_url=config.server_url,
            state_dir=config.state_dir,
            token=lambda: self._credentials.node_token if self._credentials else None,
            request_timeout_s=config.request_timeout_s,
        )
        self._publisher = Publisher(config.publish)
        self._image_cache = ImageCache(
            config.state_dir,
            budget_bytes=config.image_cache_bytes,
            pinned=config.pinned_images,
            clock=clock,
        )
        # Pulls in progress: run id -> (bytes done, bytes in all); images of starts in flight
        # (kept from pruning between their pull and their container's creation).
        self._pull_lock = threading.Lock()
        self._pulls: dict[str, tuple[int, int]] = {}
        self._pull_woken_at = 0.0
        self._starting: dict[str, str] = {}
        # What the server has taken of the allow-list and the images held (sent when changed).
        self._allow_sent = False
        self._images: tuple[CachedImage, ...] | None = None
        self._images_sent: tuple[CachedImage, ...] | None = None
        self._images_pass_at = -IMAGE_PASS_S
        # The desired state of the last answer that carried one, and its digest (sent back: the
        # server then answers "unchanged" instead of sending it again). Memory only: a
        # restarted agent sends none and gets the whole state.
        self._desired: tuple[DesiredRun, ...] = ()
        self._desired_digest = ""
        # The runs' states the last round observed: a change between rounds sends one at once.
        self._observed: dict[str, ContainerStatus] = {}

    # -- the program ---------------------------------------------------------------------------

    def stop(self) -> None:
        """Ask `run()` to return (from any thread): what SIGTERM does to a lone agent."""
        self._stopping.set()
        self._wake.set()

    def run(self) -> int:
        """Join if needed, then loop (or one round with --once); returns the exit status."""
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGTERM, signal.SIGINT):
                signal.signal(signum, lambda *_: self.stop())
        structlog.contextvars.bind_contextvars(host=self.config.hostname)
        try:
            self._telemetry = create_source(
                self.config.telemetry,
                hostname=self.config.hostname,
                simulate_gpus=self.config.simulate_gpus,
            )
            self._watchdog = SampleWatchdog(self._telemetry, TELEMETRY_TIMEOUT_S)
            if self.config.metrics_port:
                metrics_module.serve(
                    port=self.config.metrics_port, address=self.config.metrics_address
                )
            credentials = self._credentials_or_join()
            if credentials is None:
                return EXIT_OK  # asked to stop while waiting for the server
            self._credentials = credentials
            structlog.contextvars.bind_contextvars(node_id=credentials.node_id)
            self._driver = self._create_driver(credentials.node_id)
            try:
                self._sweep_leftovers()
            except (RuntimeDriverError, OSError) as exc:
                # Leftovers wait for the next start (or the next removal): the runs go first.
                logger.warning("leftovers not swept", extra={"error": str(exc)})
            self._syncer.start()
            self._listener.start()
            return self._loop()
        except RequestRejectedError as exc:
            logger.error(
                "server refused the agent", extra={"status": exc.status, "error": exc.message}
            )
            return EXIT_REJECTED
        except (
            ConfigError,
            TelemetryError,
            AgentApiError,
            RuntimeDriverError,
            OSError,
            ValueError,
        ) as exc:
            logger.error("agent cannot continue", extra={"error": str(exc)})
            return EXIT_ERROR
        finally:
            self._close()

    def _loop(self) -> int:
        failures = 0
        while not self._stopping.is_set():
            began = time.monotonic()
            refused = False
            try:
                self.tick()
                metrics_module.RECONCILE_SECONDS.observe(time.monotonic() - began)
                failures = 0
                delay = self.interval_s - (time.monotonic() - began)
            except AuthRejectedError as exc:
                path = os.path.join(self.config.state_dir, TOKEN_FILE)
                logger.error(
                    "node token rejected (revoked?); to join again, remove the token file and "
                    "start with a new join token",
                    extra={"status": exc.status, "error": exc.message, "token_file": path},
                )
                return EXIT_REJECTED
            except ServerBusyError as exc:
                # Refused before any work: nothing was applied, the next round sends it all.
                # Back when the server says (it spreads the refused nodes over the interval),
                # not sooner: a retry at once is what overloads it.
                refused = True
                if exc.interval_s is not None:
                    self._set_interval(exc.interval_s)
                delay = exc.retry_after_s
                logger.warning(
                    "heartbeat refused: server busy",
                    extra={"retry_in_s": round(delay, 1), "interval_s": self.interval_s},
                )
                if self.config.once:
                    return EXIT_ERROR
            except (AgentApiError, RuntimeDriverError) as exc:
                # Unreachable server, a refused heartbeat, a runtime that does not answer: the
                # runs go on and usage keeps being spooled; retry with growing delays.
                delay = backoff_delay(failures, base_s=self.interval_s, max_s=MAX_RETRY_DELAY_S)
                failures += 1
                logger.warning(
                    "round failed",
                    extra={"error": str(exc), "failures": failures, "retry_in_s": round(delay, 1)},
                )
                if self.config.once:
                    return EXIT_ERROR
            if self.config.once:
                self._ops.wait()
                self._harvest(self._clock())
                return EXIT_OK
            if refused:
                self._stopping.wait(max(0.0, delay))
                self._wake.clear()
            else:
                self._wait_round(delay, watch_runs=failures == 0)
        logger.info("agent stopping")
        return EXIT_OK

    def _wait_round(self, delay: float, *, watch_runs: bool) -> None:
        """Until the next round: `delay`, or less when woken (a start, the server's wake
        channel, stop()) or, with `watch_runs`, when a run's state changed in the runtime (an
        exit, a crash, a run gone), as the kubelet relists its pods every second: the server
        hears of a lifecycle change at once, however long the interval it asked for."""
        deadline = time.monotonic() + max(0.0, delay)
        while not self._wake.wait(max(0.0, min(RUNS_POLL_S, deadline - time.monotonic()))):
            if time.monotonic() >= deadline or (watch_runs and self._runs_changed()):
                break
        self._wake.clear()

    def _runs_changed(self) -> bool:
        """Whether the runtime's runs differ from those the last round observed; a run removed
        after its exit was reported (the agent's own cleanup) is no change."""
        if self._driver is None:
            return False
        try:
            now = {state.run_id: state.status for state in self._driver.list_managed()}
        except RuntimeDriverError:
            return False  # the round at the interval tells
        before = self._observed
        return any(run_id not in before for run_id in now) or any(
            now.get(run_id) != status
            for run_id, status in before.items()
            if not (status == ContainerStatus.EXITED and run_id not in now)
        )

    def _close(self) -> None:
        self._listener.close()
        self._ops.shutdown()
        # A sync in progress is dropped: the next agent uploads again what was not committed.
        self._syncer.close()
        self._cache.close()
        self._publisher.close()
        if self._watchdog is not None:
            self._watchdog.close()
        self._client.close()
        self.ledger.flush()

    # -- joining -------------------------------------------------------------------------------

    def _credentials_or_join(self) -> Credentials | None:
        stored = load_credentials(self.config.state_dir)
        if stored is not None:
            logger.info("using the stored node token", extra={"node_id": stored.node_id})
            return stored
        if not self.config.join_token:
            raise ConfigError("not joined yet: pass --join-token or set GPUMARKET_JOIN_TOKEN")
        payload = self.join_payload()
        failures = 0
        while True:
            try:
                answer = self._client.join(payload)
                break
            except TransientApiError as exc:
                if self.config.once:
                    raise
                delay = backoff_delay(failures, base_s=self.interval_s, max_s=MAX_RETRY_DELAY_S)
                if isinstance(exc, ServerBusyError):
                    delay = exc.retry_after_s
                failures += 1
                logger.warning(
                    "join failed, retrying", extra={"error": str(exc), "retry_in_s": delay}
                )
                if self._stopping.wait(delay):
                    return None
        try:
            joined = JoinAnswer.from_payload(answer)
        except ProtocolError as exc:
            # The join token is spent by now: retrying cannot help, a person has to look.
            raise AgentApiError(f"{exc}: {answer!r}"[:500]) from exc
        credentials = Credentials(node_id=joined.node_id, node_token=joined.node_token)
        save_credentials(self.config.state_dir, credentials, server_url=self.config.server_url)
        self._set_interval(joined.heartbeat_interval_s)
        logger.info(
            "joined",
            extra={"node_id": credentials.node_id, "gpus": len(payload["gpus"])},
        )
        return credentials

    def join_payload(self) -> dict[str, Any]:
        assert self._telemetry is not None
        inventory = self._telemetry.discover()
        return {
            "join_token": self.config.join_token,
            "hostname": self.config.hostname,
            "host": {
                **(
                    simulated_host(len(inventory.gpus))
                    if self._telemetry.simulated
                    else {
                        "cpu_cores": hostinfo.cpu_cores(),
                        "ram_gb": hostinfo.ram_gb(),
                        "disk_gb": hostinfo.disk_gb(self.config.volume_root),
                    }
                ),
                "driver_version": inventory.driver_version,
                "cuda_version": inventory.cuda_version,
            },
            "gpus": [gpu.to_payload() for gpu in inventory.gpus],
            "simulated": self._telemetry.simulated,
            "host_key": host_key(self.config.state_dir),
            "runtime": self.config.runtime,
            **self._allow_field(),
            # An sshd in the rental needs a container and a published port.
            "ssh": self.config.runtime == "docker" and self.config.publish is not None,
            # Whether a rental with the internet can run here, filtered to the public internet
            # (the server places none where not).
            "internet_filtered": self.internet_filtered(),
            # Whether its gang members get a private network across hosts (Docker: a VXLAN
            # overlay per gang, nodeagent/runtime/gangnet.py); the host network otherwise.
            "gang_network": self.config.runtime == "docker" and gangnet.capable(),
            # Where the other nodes of a multi-node rental reach this one's runs.
            "fabric_address": self.config.fabric_address
            or hostinfo.source_address(self.config.server_url),
            # Said only when set: the provider's cluster to join, and its fabric to create it.
            **(
                {
                    "cluster": self.config.cluster,
                    "interconnect": self.config.interconnect,
                    "interconnect_gbps": self.config.interconnect_gbps,
                }
                if self.config.cluster
                else {}
            ),
        }

    def internet_filtered(self) -> bool:
        """Whether this node can give a rental the internet and nothing else: the Docker
        runtime on an engine whose packets the agent filters (nodeagent/runtime/docker.py),
        unless the operator allows internal networks only. The process runtime filters
        nothing: a run there has the host's own network (see nodeagent/runtime/process.py)."""
        if self.config.runtime != "docker" or self.config.network_policy != "internet":
            return False
        # Imported here: hosts using the process driver need not have the docker SDK.
        from nodeagent.runtime.docker import internet_filter_unavailable

        reason = internet_filter_unavailable()
        if reason is not None:
            logger.warning("rentals with internet are not offered here", extra={"why": reason})
        return reason is None

    def _create_driver(self, node_id: int) -> RuntimeDriver:
        if self.config.runtime == "process":
            return create_driver(
                "process",
                state_dir=self.config.process_dir,
                gpu_mode=self.config.gpu_mode,
                node_id=str(node_id),
            )
        driver = create_driver(
            "docker",
            gpu_mode=self.config.gpu_mode,
            node_id=str(node_id),
            image_allow=self.config.image_allow,
            internet_allowed=self.config.network_policy == "internet",
            disk_quota_mb=self.config.disk_quota_mb,
            container_user=self.config.container_user,
            max_image_bytes=self.config.max_image_bytes,
            volume_root=self.config.volume_root,
        )
        driver.on_pull_progress = self._pull_progress  # type: ignore[attr-defined]
        driver.on_image_pulled = self._image_cache.pulled  # type: ignore[attr-defined]
        return driver

    def _sweep_leftovers(self) -> None:
        """Delete what an earlier agent left of rentals that are gone (it stopped between a
        run's removal and the deletion of its files): networks and workspaces of rentals with
        no container (the Docker driver), then stage dirs and workspaces under the volume root
        (this agent's own) that no run in the runtime or in the ledger names. A run in the
        ledger keeps its files: its final sync may not be done. The dataset cache is kept."""
        assert self._driver is not None
        release = getattr(self._driver, "release_unused_rentals", None)
        if release is not None:
            release()
        actual = self._driver.list_managed()
        records = [record for run_id in self.ledger if (record := self.ledger.get(run_id))]
        runs = {state.run_id for state in actual} | set(self.ledger)
        rentals = {state.rental_id for state in actual} | {r.rental_id for r in records}
        if os.path.isdir(self._stage_root):
            for name in os.listdir(self._stage_root):
                if _SAFE_ID.match(name) and name not in runs:
                    stage_dir_remove(os.path.join(self._stage_root, name))
        root = self.config.volume_root
        for name in os.listdir(root) if os.path.isdir(root) else []:
            rental_id = name.removesuffix(".ext4")
            if name.startswith(".") or not _SAFE_ID.match(name) or rental_id in rentals:
                continue
            path = os.path.join(root, rental_id)
            if os.path.isdir(path) or os.path.isfile(f"{path}.ext4"):
                workspace_delete(path)

    # -- one round -----------------------------------------------------------------------------

    def tick(self) -> None:
        """Observe, spool, heartbeat, reconcile (see the module docstring)."""
        assert self._driver is not None and self._credentials is not None
        now = self._clock()
        self._harvest(now)
        actual = self._driver.list_managed()
        self._observed = {state.run_id: state.status for state in actual}
        metrics_module.containers_observe(state.status for state in actual)
        for state in actual:
            live = self._live.setdefault(state.run_id, _Live())
            live.rental_id = state.rental_id
            if state.status == ContainerStatus.RUNNING:
                live.last_seen_running = now
        self._spool_usage(actual, now)
        self._read_output(actual)
        self._sync_artifacts(actual, now)

        metrics, taken = self._take_metrics()
        logs, logs_taken = self._take_logs()
        benchmark = self._benchmark.result()
        if now - self._images_pass_at >= IMAGE_PASS_S:
            self._images_pass(now)
        image_allow = None if self._allow_sent else self._allow_field().get("image_allow")
        images = self._images if self._images != self._images_sent else None
        heartbeat = Heartbeat(
            agent_version=AGENT_VERSION,
            sent_at=self._clock(),
            telemetry=tuple(self._telemetry_samples(actual)),
            containers=tuple(self._container_reports(actual)),
            usage=tuple(
                UsageReport.from_payload(r) for r in self.spool.pending(USAGE_PER_HEARTBEAT)
            ),
            metrics=tuple(metrics),
            logs=tuple(logs),
            benchmark=benchmark,
            pulls=tuple(self._pull_reports()),
            image_allow=image_allow,
            images=images,
            desired_digest=self._desired_digest,
        )
        payload = self._client.heartbeat(heartbeat.to_payload(), token=self._credentials.node_token)
        try:
            answer = HeartbeatAnswer.from_payload(payload, on_bad_run=self._bad_run)
        except ProtocolError as exc:
            raise TransientApiError(str(exc)) from exc

        if answer.dropped:
            # Applied all the same: resending would be refused again, the counts say what to fix.
            logger.warning("the server dropped report elements", extra=dict(answer.dropped))
        for run_id, count in logs_taken.items():
            live = self._live[run_id]
            live.log_sent = max(live.log_sent, live.log_buffer[count - 1][0])
            del live.log_buffer[:count]
            if run_id in self.ledger:
                self.ledger.update(run_id, log_sent=live.log_sent)
        self._after_delivery(answer, actual, taken, benchmark_sent=benchmark is not None)
        self._listener.offer(answer.wake)
        self._allow_sent = True
        if images is not None:
            self._images_sent = images
        desired = self._desired_held(answer)
        self._remember(desired)
        for live in self._live.values():
            # A run no longer desired is not said again: the server masks what it prints.
            if live.mask is None:
                live.mask = ()
        self._forget(desired, actual)
        self.ledger.flush()
        self._reconcile(desired, actual, now)
        self._publisher.reconcile(wanted_ports(desired, actual))
        metrics_module.SPOOL_DEPTH.set(len(self.spool))
        if answer.run_benchmark:
            if self.config.once:
                logger.info("benchmark requested; not run with --once")
            else:
                self._benchmark.request(answer.benchmark)
        logger.debug(
            "heartbeat",
            extra={
                "runs": len(actual),
                "desired": len(desired),
                "usage_sent": len(heartbeat.usage),
                "spooled": len(self.spool),
                "metrics": len(metrics),
            },
        )

    def _spool_usage(self, actual: Sequence[ContainerState], now: float) -> None:
        reports, finals = [], []
        for state in actual:
            record = self.ledger.get(state.run_id)
            # Without the GPU count (a run this agent has never seen desired) there is nothing
            # honest to report; the server bills from the reports it gets.
            if record is None or not record.gpu_indices or state.started_at is None:
                continue
            if state.status == ContainerStatus.RUNNING:
                confirmed, final = now, False
            elif state.status == ContainerStatus.EXITED and not record.final_spooled:
                last_seen = self._live[state.run_id].last_seen_running
                confirmed, final = last_seen or state.started_at, True
                finals.append(state.run_id)
            else:
                continue
            reports.append(
                {
                    "rental_id": state.rental_id or record.rental_id,
                    "run_id": state.run_id,
                    "gpu_count": len(record.gpu_indices),
                    "started_at": state.started_at,
                    "confirmed_at": max(confirmed, state.started_at),
                    "final": final,
                }
            )
        self.spool.append(reports)
        for run_id in finals:
            self.ledger.update(run_id, final_spooled=True)
        self.ledger.flush()

    def _read_output(self, actual: Sequence[ContainerState]) -> None:
        assert self._driver is not None
        for state in actual:
            if state.status not in (ContainerStatus.RUNNING, ContainerStatus.EXITED):
                continue
            live = self._live[state.run_id]
            if len(live.buffer) >= RUN_BUFFER_LINES:
                continue
            first_read = live.read_cursor is None
            record = self.ledger.get(state.run_id)
            if live.mask is None and record is not None and record.secrets:
                continue  # read once the server has said its secrets again

            if first_read and record is not None:
                live.base_cursor, live.base_skip = record.cursor, record.skip
                live.base_line, live.log_sent = record.line, record.log_sent
            if first_read:
                live.next_line = live.base_line
            cursor = live.base_cursor if first_read else live.read_cursor
            try:
                lines, read_cursor = self._driver.output_since(state.run_id, cursor)
            except RuntimeDriverError as exc:
                logger.warning(
                    "cannot read output", extra={"run_id": state.run_id, "error": str(exc)}
                )
                continue
            if live.mask:
                lines = [secrets_mask(line, live.mask) for line in lines]

            metrics, refused = metric_lines(lines)
            if refused:
                live.refused_lines += refused
                logger.warning(
                    "output lines refused as metrics",
                    extra={"run_id": state.run_id, "lines": refused, "total": live.refused_lines},
                )
            fresh = metrics[live.base_skip :] if first_read else metrics
            live.checkpoint_seen |= any(_is_checkpoint(line) for line in fresh)
            live.buffer.extend(fresh)
            _log_extend(live, lines)
            live.read_cursor = read_cursor
            if not live.buffer and not live.log_buffer:
                live.base_cursor, live.base_skip = read_cursor, 0
                live.base_line = live.next_line
            if state.status == ContainerStatus.EXITED:
                live.read_after_exit = True

    def _sync_artifacts(self, actual: Sequence[ContainerState], now: float) -> None:
        """Queue artifact syncs (nodeagent.artifacts) of the runs that asked for them: at each
        checkpoint and every SYNC_INTERVAL_S while running, and once more after the exit."""
        for state in actual:
            record = self.ledger.get(state.run_id)
            if record is None or not record.sync_artifacts or not _SAFE_ID.match(state.rental_id):
                continue
            live = self._live[state.run_id]
            target = {
                "run_id": state.run_id,
                "rental_id": state.rental_id,
                "output_dir": os.path.join(self.config.volume_root, state.rental_id),
            }
            if state.status == ContainerStatus.RUNNING:
                due = live.checkpoint_seen or now - live.last_sync_at >= SYNC_INTERVAL_S
                if due and self._syncer.request(**target, reason="checkpoint"):
                    live.checkpoint_seen, live.last_sync_at = False, now
            elif state.status == ContainerStatus.EXITED and not record.final_synced:
                if not live.final_requested:
                    if live.stop_requested:
                        reason = "stop"
                    else:
                        reason = "complete" if state.exit_code == 0 else "fail"
                    live.final_requested = self._syncer.request(**target, reason=reason)
                elif self._syncer.final_done(state.run_id):
                    self.ledger.update(state.run_id, final_synced=True)

    def _awaits_final_sync(self, state: ContainerState) -> bool:
        """An exited run whose final sync is not done: its exit is not reported yet, so the
        server still takes its uploads (it believes the run is still running)."""
        record = self.ledger.get(state.run_id)
        return (
            state.status == ContainerStatus.EXITED
            and record is not None
            and record.sync_artifacts
            and not record.final_synced
        )

    def _take_metrics(self) -> tuple[list[MetricLine], dict[str, int]]:
        """Up to the per-heartbeat limits, round robin over runs (none starves the others)."""
        order = sorted(run_id for run_id, live in self._live.items() if live.buffer)
        metrics: list[MetricLine] = []
        taken = dict.fromkeys(order, 0)
        size = 0
        progressed = True
        while progressed and len(metrics) < METRICS_PER_HEARTBEAT:
            progressed = False
            for run_id in order:
                live = self._live[run_id]
                if taken[run_id] >= len(live.buffer) or len(metrics) >= METRICS_PER_HEARTBEAT:
                    continue
                line = live.buffer[taken[run_id]]
                # As it goes on the wire (escaped inside a JSON string), plus keys and ids.
                size += len(json.dumps(line)) + len(run_id) + 100
                if size > METRICS_BYTES_PER_HEARTBEAT:
                    return metrics, taken
                metrics.append(MetricLine(rental_id=live.rental_id, run_id=run_id, line=line))
                taken[run_id] += 1
                progressed = True
        return metrics, taken

    def _take_logs(self) -> tuple[list[LogLine], dict[str, int]]:
        """Up to the per-heartbeat limits, an equal share per run, oldest lines first."""
        order = sorted(run_id for run_id, live in self._live.items() if live.log_buffer)
        logs: list[LogLine] = []
        taken = dict.fromkeys(order, 0)
        size = 0
        share = LOGS_PER_HEARTBEAT // max(1, len(order))
        for run_id in order:
            live = self._live[run_id]
            for line_no, line in live.log_buffer[: max(1, share)]:
                size += len(json.dumps(line)) + len(run_id) + 120
                if size > LOGS_BYTES_PER_HEARTBEAT or len(logs) >= LOGS_PER_HEARTBEAT:
                    return logs, taken
                logs.append(
                    LogLine(rental_id=live.rental_id, run_id=run_id, line_no=line_no, line=line)
                )
                taken[run_id] += 1
        return logs, taken

    def _telemetry_samples(self, actual: Sequence[ContainerState]) -> list[GpuSample]:
        assert self._watchdog is not None
        busy: set[int] = set()
        for state in actual:
            record = self.ledger.get(state.run_id)
            if state.status == ContainerStatus.RUNNING and record is not None:
                busy.update(record.gpu_indices)
        return self._watchdog.sample(busy)

    def _container_reports(self, actual: Sequence[ContainerState]) -> list[ContainerReport]:
        assert self._driver is not None
        reports = []
        for state in actual:
            if not state.rental_id:
                continue  # damaged run metadata: a report without its rental would be refused
            if self._awaits_final_sync(state):
                continue
            live = self._live[state.run_id]
            record = self.ledger.get(state.run_id)
            if live.mask is None and record is not None and record.secrets:
                continue  # its tail is read once its secrets are known again

            report = ContainerReport(
                rental_id=state.rental_id,
                run_id=state.run_id,
                status=state.status,
                exit_code=state.exit_code,
                started_at=state.started_at,
                finished_at=state.finished_at,
                published=self._publisher.published(state.run_id),
            )
            if state.status == ContainerStatus.EXITED:
                if live.log_tail is None:
                    try:
                        tail = self._driver.logs_tail(state.run_id, LOG_TAIL_LINES)
                        live.log_tail = trim_log_tail(secrets_mask(tail, live.mask or ()))
                    except RuntimeDriverError as exc:
                        logger.warning(
                            "no log tail", extra={"run_id": state.run_id, "error": str(exc)}
                        )
                report = dataclasses.replace(report, log_tail=live.log_tail or "")
            elif state.status == ContainerStatus.CREATED and live.start_error is not None:
                report = _missing_report(state.rental_id, state.run_id, live.start_error)
            reports.append(report)
        # Desired runs that cannot be started are "missing", with the reason in the log tail:
        # the server decides what becomes of the rental instead of waiting for it forever.
        present = {state.run_id for state in actual}
        for run_id, live in sorted(self._live.items()):
            if live.start_error is not None and run_id not in present and live.rental_id:
                reports.append(_missing_report(live.rental_id, run_id, live.start_error))
        return reports

    def _after_delivery(
        self,
        answer: HeartbeatAnswer,
        actual: Sequence[ContainerState],
        taken: dict[str, int],
        *,
        benchmark_sent: bool,
    ) -> None:
        """The server took the heartbeat (200): trim what it has received."""
        self.spool.ack(answer.ack_usage_seq)
        for run_id, count in taken.items():
            live = self._live[run_id]
            del live.buffer[:count]
            live.base_skip += count
        for state in actual:
            live = self._live[state.run_id]
            if live.read_cursor is None:
                continue  # not read yet: nothing delivered
            if not live.buffer and not live.log_buffer:
                live.base_cursor, live.base_skip = live.read_cursor, 0
                live.base_line = live.next_line
            if state.run_id in self.ledger:
                self.ledger.update(
                    state.run_id,
                    cursor=live.base_cursor,
                    skip=live.base_skip,
                    line=live.base_line,
                )
            if (
                state.status == ContainerStatus.EXITED
                and live.read_after_exit
                and not live.buffer
                and not live.log_buffer
                and not self._awaits_final_sync(state)
            ):
                live.delivered = True
        if benchmark_sent:
            self._benchmark.delivered()
        self._set_interval(answer.heartbeat_interval_s)

    def _desired_held(self, answer: HeartbeatAnswer) -> tuple[DesiredRun, ...]:
        """The desired state an answer names: its own, or the one held when it is unchanged."""
        if not answer.desired_unchanged:
            self._desired = answer.desired
        self._desired_digest = answer.desired_digest
        return self._desired

    @staticmethod
    def _bad_run(error: ProtocolError) -> None:
        logger.error("ignoring a desired entry", extra={"error": str(error)})

    def _remember(self, desired: Sequence[DesiredRun]) -> None:
        for entry in desired:
            values = [secret.value for secret in entry.secrets]
            if entry.registry_auth is not None:
                values.append(entry.registry_auth.password)
            known = {
                "rental_id": entry.rental_id,
                "gpu_indices": entry.gpu_indices,
                "stop_grace_s": entry.stop_grace_s,
                "sync_artifacts": entry.sync_artifacts,
                "secrets": bool(values),
            }
            if entry.run_id in self.ledger:
                self.ledger.update(entry.run_id, **known)
            else:
                self.ledger.put(entry.run_id, RunRecord(**known))
            live = self._live.setdefault(entry.run_id, _Live())
            live.rental_id = entry.rental_id
            live.mask = mask_terms(values)

    def _forget(self, desired: Sequence[DesiredRun], actual: Sequence[ContainerState]) -> None:
        """Drop what we know of runs that are gone for good: not desired, not in the runtime."""
        keep = {d.run_id for d in desired} | {s.run_id for s in actual} | self._ops.in_flight()
        gone = (set(self.ledger) | set(self._live)) - keep
        for run_id in gone:
            self.ledger.remove(run_id)
            self._live.pop(run_id, None)
            self._syncer.forget(run_id)
            if _SAFE_ID.match(run_id):
                stage_dir_remove(os.path.join(self._stage_root, run_id))

    # -- reconciling ---------------------------------------------------------------------------

    def _reconcile(
        self, desired: Sequence[DesiredRun], actual: Sequence[ContainerState], now: float
    ) -> None:
        assert self._driver is not None
        driver = self._driver
        backing_off = {run_id for run_id, live in self._live.items() if live.next_start_at > now}
        records = {run_id: self.ledger.get(run_id) for run_id in self.ledger}
        plan = plan_reconcile(
            desired=desired,
            actual=actual,
            delivered={run_id for run_id, live in self._live.items() if live.delivered},
            hold=self._ops.in_flight() | backing_off,
            gpus_of={run_id: r.gpu_indices for run_id, r in records.items() if r is not None},
            grace_of={run_id: r.stop_grace_s for run_id, r in records.items() if r is not None},
        )
        with self._pull_lock:
            self._starting.update((entry.run_id, entry.image) for entry in plan.start)
        for entry in plan.start:
            logger.info(
                "starting run", extra={"run_id": entry.run_id, "rental_id": entry.rental_id}
            )
            self._ops.submit(entry.run_id, "start", lambda e=entry: self._start(driver, e))
        for run_id, grace in plan.stop:
            logger.info("stopping run", extra={"run_id": run_id, "grace_s": grace})
            self._live.setdefault(run_id, _Live()).stop_requested = True
            self._ops.submit(run_id, "stop", lambda r=run_id, g=grace: driver.stop(r, g))
        for run_id in plan.remove:
            logger.info("removing run", extra={"run_id": run_id})
            self._ops.submit(run_id, "remove", lambda r=run_id: driver.remove(r))
        if plan.waiting:
            logger.info(
                "runs wait for their GPUs to be freed", extra={"runs": ",".join(plan.waiting)}
            )

    def _start(self, driver: RuntimeDriver, entry: DesiredRun) -> tuple[ContainerState, float]:
        """Stage the run's files, then start it (in a worker thread); the state and when it
        was seen so. Staging is provisioning: nothing runs, nothing is billed until it is done.
        The run is in `_starting` from its submission (_reconcile) until its start ends."""
        try:
            self.spec_for(entry)  # a run that cannot be placed downloads nothing
            staged = stage_run(entry, cache=self._cache, stage_root=self._stage_root)
            state = driver.start(self.spec_for(entry, staged=staged))
        finally:
            with self._pull_lock:
                self._starting.pop(entry.run_id, None)
                self._pulls.pop(entry.run_id, None)
                # Started or failed, the next round tells the server at once (the last of a
                # batch at once, an earlier one within START_REPORT_GRACE_S).
                last = not self._starting
            if last:
                self._wake.set()
            else:
                grace = threading.Timer(START_REPORT_GRACE_S, self._wake.set)
                grace.daemon = True
                grace.start()
        self._image_cache.used(entry.image)
        self._images_pass(self._clock())  # what it pulled counts against the budget now
        return state, self._clock()

    # -- images --------------------------------------------------------------------------------

    def _allow_field(self) -> dict[str, Any]:
        """The allow-list the agent reports (the scheduler places only images it admits); the
        process runtime runs no image and says nothing (any image)."""
        if self.config.runtime != "docker":
            return {}
        return {"image_allow": list(allow_patterns(self.config.image_allow))}

    def _pull_progress(self, run_id: str, done: int, total: int) -> None:
        """From a start's worker thread: keep the pull's progress, and send it early (at most
        every PULL_REPORT_S)."""
        with self._pull_lock:
            self._pulls[run_id] = (done, total)
            now = time.monotonic()
            if now - self._pull_woken_at < PULL_REPORT_S:
                return
            self._pull_woken_at = now
        self._wake.set()

    def _pull_reports(self) -> list[PullProgress]:
        with self._pull_lock:
            pulls = dict(self._pulls)
        return [
            PullProgress(
                rental_id=self._live[run_id].rental_id,
                run_id=run_id,
                done_bytes=done,
                total_bytes=max(done, total),
            )
            for run_id, (done, total) in sorted(pulls.items())
            if run_id in self._live and self._live[run_id].rental_id
        ]

    def _images_pass(self, now: float) -> None:
        """Prune the images the agent pulled to their budget, then list what the node holds
        (the images its allow-list admits) for the next heartbeat."""
        driver = self._driver
        if driver is None or not hasattr(driver, "images_held"):
            return
        self._images_pass_at = now
        try:
            held = driver.images_held()
            with self._pull_lock:
                starting = set(self._starting.values())
            if self._image_cache.prune(
                held=held,
                in_use=driver.images_in_use() | starting,
                remove=driver.image_remove,
            ):
                held = driver.images_held()
        except RuntimeDriverError as exc:
            logger.warning("image cache pass failed", extra={"error": str(exc)})
            return
        patterns = allow_patterns(self.config.image_allow)
        images = sorted(
            {
                (ref, image.image_id, image.size_bytes)
                for image in held
                for ref in image.refs
                if image_allowed(patterns, ref)
            }
        )[:MAX_REPORTED_IMAGES]
        self._images = tuple(
            CachedImage(ref=ref, digest=digest, size_bytes=size) for ref, digest, size in images
        )

    def spec_for(self, entry: DesiredRun, *, staged: StagedRun | None = None) -> ContainerSpec:
        """The ContainerSpec of a desired run (ValueError if the entry cannot be run)."""
        assert self._credentials is not None
        if not _SAFE_ID.match(entry.rental_id):
            raise ValueError(f"rental id {entry.rental_id!r} cannot name a volume directory")
        volume_dir = os.path.join(self.config.volume_root, entry.rental_id)
        # Docker mounts the volume at /workspace; a host process sees the directory itself.
        # (GPUMARKET_RENTAL_ID and the GPU variables are added by the driver.)
        if self.config.runtime == "docker":
            checkpoints = "/workspace/checkpoints"
        else:
            checkpoints = os.path.join(volume_dir, "checkpoints")
        return ContainerSpec.place(
            entry,
            node_id=str(self._credentials.node_id),
            volume_dir=volume_dir,
            env={"HARNESS_CHECKPOINT_DIR": checkpoints},
            data_dir=staged.data_dir if staged else "",
            seed_dir=staged.seed_dir if staged else "",
        )

    def _harvest(self, now: float) -> None:
        """Record the outcome of finished operations."""
        for run_id, kind, future in self._ops.harvest():
            error = future.exception()
            live = self._live.setdefault(run_id, _Live())
            if error is None:
                if kind == "start":
                    live.start_error, live.start_failures, live.next_start_at = None, 0, 0.0
                    state, seen_at = future.result()
                    if state.status == ContainerStatus.RUNNING:
                        live.last_seen_running = seen_at
                continue
            logger.error(
                f"{kind} failed",
                extra={"run_id": run_id, "error": secrets_mask(repr(error), live.mask or ())},
            )
            if kind == "start":
                delay = backoff_delay(
                    live.start_failures, base_s=START_RETRY_BASE_S, max_s=START_RETRY_MAX_S
                )
                live.start_failures += 1
                live.next_start_at = now + delay
                if isinstance(error, PermanentRuntimeError | ValueError):
                    live.start_error = secrets_mask(str(error), live.mask or ())

    def _set_interval(self, value: Any) -> None:
        with contextlib.suppress(TypeError, ValueError):
            self.interval_s = min(MAX_INTERVAL_S, max(MIN_INTERVAL_S, float(value)))
