"""Agent heartbeats: the agent reports actual state, the server answers with desired state
computed from the allocations. Every report is applied idempotently: a retried or replayed
heartbeat changes nothing it already changed."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import threading
import time
import uuid
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from datetime import UTC, datetime
from typing import Any

from django.conf import settings
from django.db import DatabaseError, IntegrityError, transaction
from django.db import connection as db_connection
from django.utils import timezone

from accounts.services import token_hash
from accounts.services.secrets import registry_credentials, secret_values
from agentprotocol import (
    JUPYTER_PORT,
    BenchmarkSpec,
    CachedImage,
    ContainerReport,
    ContainerStatus,
    DatasetMount,
    DesiredRun,
    HeartbeatAnswer,
    Network,
    ProtocolError,
    PullProgress,
    RegistryAuth,
    SecretValue,
    StagedFile,
    UsageReport,
)
from agentprotocol.untrusted import mask_terms, metric_line_parse, secrets_mask
from billing.services.metering import UsageReport as MeteredUsage
from billing.services.metering import usage_reports_apply
from core.errors import ValidationFailed
from core.metrics import BENCHMARKS_UNASKED
from core.wake import wake_channel, wake_enabled, wake_listeners
from marketplace import lifecycle
from marketplace.models import (
    Allocation,
    GpuHealth,
    GpuModel,
    Node,
    NodeEvent,
    NodeStatus,
    Rental,
    RentalStatus,
)
from marketplace.selectors import (
    measured_tflops_below_band,
    measured_tflops_plausible,
    rental_ssh_keys,
)
from provisioning import queries
from provisioning.models import ContainerRun, NodeBenchmark
from provisioning.services.gangs import barrier as gang_barrier
from provisioning.services.gangs import members_of as gang_members
from provisioning.services.gangs import others_still_running as gang_others_running
from provisioning.services.gangs import rendezvous_env
from provisioning.services.health import (
    OK,
    failed_gpu_indices,
    gpus_health_apply,
    gpus_health_restore,
    samples_clean,
    verdicts_by_index,
)
from provisioning.services.logs import log_rows
from provisioning.services.telemetry import telemetry_buffer
from storage import objectstore
from storage.selectors import rentals_dataset_files, rentals_resume_checkpoints

log = logging.getLogger(__name__)


SSH_PORT = 22  # where the sshd of a rental that asked for SSH listens in its container


_HEALTH = (GpuHealth.OK.value, GpuHealth.DEGRADED.value, GpuHealth.FAILED.value)


def heartbeat_interval_s() -> int:
    """How often agents report; the server says so in every answer."""
    return settings.GPUMARKET.get("HEARTBEAT_INTERVAL_S", 5)


_LISTED_NODES_TTL_S = 30.0
# [listed nodes, busy nodes, wake servers listening, when counted (monotonic)]
_listed_nodes: list[float] = [0.0, 0.0, 0.0, -_LISTED_NODES_TTL_S]


def _fleet_counts(*, recount: bool = True) -> tuple[int, int]:
    """The nodes that heartbeat (every status but OFFLINE) and those of them that hold GPUs
    for a container that should run, when a wake server listens, else (0, 0); counted at most
    every 30 s per process: the fleet's size changes slowly, and an idle heartbeat must stay
    one statement. Without `recount`, the last counts whatever their age."""
    listed, busy, listeners, when = _listed_nodes
    if recount and time.monotonic() - when >= _LISTED_NODES_TTL_S:
        listeners = wake_listeners()
        listed = busy = 0
        if listeners:
            listed = Node.objects.exclude(status=NodeStatus.OFFLINE).count()
            busy = (
                Allocation.objects.filter(
                    released_at__isnull=True,
                    during__contains=timezone.now(),
                    rental__status__in=_CONTAINER_WANTED,
                )
                .values("node_id")
                .distinct()
                .count()
            )
        _listed_nodes[:] = [listed, busy, listeners, time.monotonic()]
    return int(listed), int(busy)


def _scaled_interval(
    *, count: int, rate_key: str, ceiling_key: str, ceiling: int, recount: bool = True
) -> int:
    """Nomad's `max_heartbeats_per_second`: the nodes counted by `_fleet_counts()[count]`
    offer at most the setting `rate_key` heartbeats a second together, each never under
    HEARTBEAT_INTERVAL_S nor over the setting `ceiling_key`. Without a wake server (none
    configured, or none listening on its channel), the base interval: work would wait that
    long."""
    base = heartbeat_interval_s()
    rate = settings.GPUMARKET.get(rate_key, 0)
    if rate <= 0 or not wake_enabled():
        return base
    ceiling = max(base, settings.GPUMARKET.get(ceiling_key, ceiling))
    return min(ceiling, max(base, math.ceil(_fleet_counts(recount=recount)[count] / rate)))


def idle_heartbeat_interval_s() -> int:
    """The interval an idle node is asked for: with a wake server, work reaches an idle node
    at once and its heartbeat only says it is alive, so the whole idle fleet offers at most
    IDLE_HEARTBEATS_PER_S, never less often than every IDLE_HEARTBEAT_MAX_S."""
    return _scaled_interval(
        count=0, rate_key="IDLE_HEARTBEATS_PER_S", ceiling_key="IDLE_HEARTBEAT_MAX_S",
        ceiling=120,
    )  # fmt: skip


def busy_heartbeat_interval_s() -> int:
    """The interval a node holding GPUs is asked for: the busy nodes together offer at most
    BUSY_HEARTBEATS_PER_S, never less often than every BUSY_HEARTBEAT_MAX_S. A longer interval
    loses nothing billing needs (a usage report confirms its run up to its instant, whenever
    it arrives) and the agent sends a round at once when a run starts, exits or fails; only the
    live log, metric lines and telemetry arrive later. The same wake-server condition as the
    idle interval: a stop or a placement on the node's free GPUs reaches it through it."""
    return _scaled_interval(
        count=1, rate_key="BUSY_HEARTBEATS_PER_S", ceiling_key="BUSY_HEARTBEAT_MAX_S",
        ceiling=15,
    )  # fmt: skip


_recounting = threading.Lock()


def _recount_in_background() -> None:
    """Count the fleet on a thread of its own, one at a time per process, when the counts are
    stale: a process that has refused every heartbeat since it started (a storm at start-up)
    has never counted, and would tell the refused nodes the base interval."""
    if time.monotonic() - _listed_nodes[3] < _LISTED_NODES_TTL_S or not _recounting.acquire(
        blocking=False
    ):
        return

    def count() -> None:
        try:
            _fleet_counts()
        except Exception:
            log.warning("fleet count failed", exc_info=True)
            _listed_nodes[3] = time.monotonic() - _LISTED_NODES_TTL_S + 5  # again in 5 s
        finally:
            db_connection.close()
            _recounting.release()

    threading.Thread(target=count, name="fleet-count", daemon=True).start()


def fleet_heartbeat_interval_s() -> int:
    """The idle interval as this process last counted the fleet, counting nothing on the
    caller's thread (no statement, no Redis call; a stale count is renewed on a thread of its
    own): what a heartbeat refused before its work (provisioning.admission) is told."""
    if settings.GPUMARKET.get("IDLE_HEARTBEATS_PER_S", 0) > 0 and wake_enabled():
        _recount_in_background()
    return _scaled_interval(
        count=0, rate_key="IDLE_HEARTBEATS_PER_S", ceiling_key="IDLE_HEARTBEAT_MAX_S",
        ceiling=120, recount=False,
    )  # fmt: skip


def _dt(epoch: float | None) -> datetime | None:
    return None if epoch is None else datetime.fromtimestamp(epoch, tz=UTC)


_CONTAINER_WANTED = [str(s) for s in lifecycle.CONTAINER_WANTED]


def run_id_for(rental_id, node_id: int, placed_at: datetime) -> str:
    """One container run: a rental's placement on one node. A rental requeued and placed again
    on the same node gets a new run id, so the old run (stopped late by an agent that was cut
    off) is never taken for the new one, and its exit never ends the new placement."""
    return f"r{rental_id.hex}-n{node_id}-p{int(placed_at.timestamp())}"


def _cpu_and_memory(node: Node, gpus: int) -> tuple[float, int]:
    """CPU and memory in proportion to the share of the node's GPUs the rental takes."""
    share = gpus / node.gpu_count
    # torch alone needs about 1 GiB resident; below 2 GiB a training run is OOM-killed.
    return max(1.0, round(node.cpu_cores * share, 2)), max(2048, int(node.ram_gb * 1024 * share))


def _ports(rental: Rental) -> tuple[int, ...]:
    """The container ports to publish: the rental's own, sshd's when it asked for SSH and
    JupyterLab's when it asked for a notebook."""
    return _ports_of(rental.ports, ssh=rental.ssh, jupyter=rental.jupyter)


def _ports_of(own: Sequence[int], *, ssh: bool, jupyter: bool) -> tuple[int, ...]:
    ports = set(own)
    if ssh:
        ports.add(SSH_PORT)
    if jupyter:
        ports.add(JUPYTER_PORT)
    return tuple(sorted(ports))


def desired_state(*, node: Node, now: datetime) -> list[DesiredRun]:
    """The containers that should run on the node now, from its active allocations."""
    held = queries.gpus_held(node_id=node.pk, now=now, statuses=_CONTAINER_WANTED)
    return _desired_from(node=node, held=held)


def _desired_from(*, node: Node, held: list[tuple]) -> list[DesiredRun]:
    if not held:
        return []  # an idle node, the common case: one light query per heartbeat
    rentals = Rental.objects.in_bulk({rental_id for rental_id, _, _ in held})
    by_rental: dict = {}
    for rental_id, index, gpu_uuid in held:
        by_rental.setdefault(rental_id, (rentals[rental_id], []))[1].append((index, gpu_uuid))
    tensor_tflops, memory_gb = GpuModel.objects.values_list("tensor_tflops", "memory_gb").get(
        pk=node.gpu_model_id
    )
    ssh_keys = rental_ssh_keys(rental for rental, _ in by_rental.values())
    secret_fields = _secrets(rentals.values())
    staging = _staging(rentals.values())
    sync = objectstore.configured()
    gangs = gang_members(r.pk for r in rentals.values() if r.node_count > 1)
    desired = []
    for rental, gpus in by_rental.values():
        cpu, memory_mb = _cpu_and_memory(node, len(gpus))
        command = list(rental.command)
        env = {str(k): str(v) for k, v in rental.env.items()}
        # The processes a run starts (`--nproc auto`): one per GPU it has here, also where the
        # GPUs are simulated and the run trains on the CPU, so a planned layout gets its ranks.
        env["NPROC_PER_NODE"] = str(len(gpus))
        if rental.pk in gangs:
            # One job across the members: the platform's job description wins over the env
            # the customer set, or the members would not find each other.
            env.update(rendezvous_env(rental, gangs[rental.pk], node.pk))
        if rental.harness_config is not None:
            env["HARNESS_CONFIG_JSON"] = json.dumps(rental.harness_config)
            if not command:
                # One command whatever the GPU count: the planned layout over NPROC_PER_NODE.
                command = [
                    "python", "-m", "harness",
                    "--config-env", "HARNESS_CONFIG_JSON", "--nproc", "auto",
                ]  # fmt: skip
            env.setdefault("HARNESS_PEAK_TFLOPS", str(tensor_tflops))
            # The harness refuses at start, with the reason, a config that cannot fit.
            env.setdefault("HARNESS_GPU_MEMORY_GB", str(memory_gb))
        desired.append(
            DesiredRun(
                rental_id=str(rental.pk),
                run_id=run_id_for(rental.pk, node.pk, rental.scheduled_start),
                image=rental.image,
                command=tuple(command),
                env=env,
                gpu_indices=tuple(index for index, _ in gpus),
                gpu_uuids=tuple(gpu_uuid for _, gpu_uuid in gpus),
                cpu_limit=cpu,
                memory_limit_mb=memory_mb,
                ports=_ports(rental),
                ssh_authorized_keys=ssh_keys.get(rental.pk, ()),
                network=Network(rental.network),
                jupyter_token=rental.jupyter_token if rental.jupyter else "",
                # Every container has an output directory (/workspace); it is synced out when
                # there is object storage to sync it to (none configured: it stays on the node).
                sync_artifacts=sync,
                **staging.get(rental.pk, {}),
                **secret_fields.get(rental.pk, {}),
            )
        )
    return desired


def _secrets(rentals) -> dict:
    """rental id -> the DesiredRun fields of its team secrets: their values and the image's
    pull credentials, decrypted here for the node that runs it. A secret deleted since the
    rental was made is left out (the run starts without it; a pull without its credentials
    fails as the customer's)."""
    using = [r for r in rentals if r.secrets or r.registry_secret]
    values = secret_values(
        pairs={
            (r.team_id, name)
            for r in using
            for name in [*(use["name"] for use in r.secrets), r.registry_secret]
            if name
        }
    )
    fields: dict = {}
    for rental in using:
        entry: dict = {
            "secrets": tuple(
                SecretValue(
                    name=use["name"],
                    value=values[(rental.team_id, use["name"])],
                    env=use.get("env", ""),
                    file=use.get("file", ""),
                )
                for use in rental.secrets
                if (rental.team_id, use["name"]) in values
            )
        }
        registry = values.get((rental.team_id, rental.registry_secret))
        if registry is not None:
            try:
                credentials = registry_credentials(registry, secret=rental.registry_secret)
            except ValidationFailed:
                credentials = None  # replaced by a value that is not credentials since
            if credentials is not None:
                entry["registry_auth"] = RegistryAuth(
                    secret=rental.registry_secret,
                    username=credentials.username,
                    password=credentials.password,
                )
        fields[rental.pk] = entry
    return fields


def rentals_mask_terms(rentals) -> dict:
    """rental id -> what to mask out of its runs' output (agentprotocol.untrusted.mask_terms):
    the values of its team secrets and its registry password; rentals with none are absent."""
    terms: dict = {}
    for rental_id, entry in _secrets(rentals).items():
        values = [s.value for s in entry["secrets"]]
        if "registry_auth" in entry:
            values.append(entry["registry_auth"].password)
        if found := mask_terms(values):
            terms[rental_id] = found
    return terms


def _staging(rentals) -> dict:
    """rental id -> the DesiredRun fields of what its agent stages before the start: its
    datasets, and the checkpoint it resumes from, as presigned GETs. Presigning is local (no
    request to the store); without object storage a run gets neither, and the rest of the
    desired state still goes out."""
    rentals = list(rentals)
    if not objectstore.configured():
        return {}
    datasets = rentals_dataset_files(r.pk for r in rentals)
    checkpoints = rentals_resume_checkpoints(rentals)
    staging: dict = {}
    for rental in rentals:
        fields: dict = {}
        if mounts := datasets.get(rental.pk):
            fields["datasets"] = tuple(
                DatasetMount(
                    dataset_id=str(dataset.pk),
                    name=dataset.name,
                    files=tuple(
                        StagedFile(
                            path=f.path,
                            url=objectstore.presign_get(f.key),
                            sha256=f.sha256,
                            size_bytes=f.size_bytes,
                        )
                        for f in files
                    ),
                )
                for dataset, files in mounts
            )
        if checkpoint := checkpoints.get(rental.pk):
            # Every file of it, to every member of a gang: each rank reads the shards it needs
            # (a resumed job's ranks may sit on other nodes than those that wrote them).
            fields["resume_files"] = tuple(
                StagedFile(
                    path=f.path,
                    url=objectstore.presign_get(f.key),
                    sha256=f.sha256,
                    size_bytes=f.size_bytes,
                )
                for f in checkpoint.files
            )
        if fields:
            staging[rental.pk] = fields
    return staging


def _plainly_running(reports: Sequence[ContainerReport]) -> dict[str, ContainerReport]:
    """run id -> its report, for the reports that say only "running": no exit, no text."""
    return {
        r.run_id: r
        for r in reports
        if r.status == ContainerStatus.RUNNING
        and r.exit_code is None
        and r.finished_at is None
        and not r.log_tail
        and not r.error
    }


def _steady_reports(*, runs: Sequence[list], reports: Sequence[ContainerReport]) -> set[str]:
    """The reported runs a report changes nothing of but its time: running, as their row says,
    for a RUNNING rental, with the same ports shown (`runs`: queries.BusyState.runs). Most
    reports of a busy node are these; they are marked in one statement instead of being locked
    and folded one by one."""
    running = _plainly_running(reports)
    steady = set()
    for run_id, _, steadily, published, ports, ssh, jupyter, _ in runs:
        report = running.get(run_id)
        if report is None or not steadily:
            continue
        # The same ports _apply_container would show: a port published since is a change.
        if report.published or published:
            wanted = set(_ports_of(ports, ssh=ssh, jupyter=jupyter))
            shown = [p.to_payload() for p in report.published if p.container_port in wanted]
            if shown != published:
                continue
        steady.add(run_id)
    return steady


def _masks(*, runs: Sequence[list], reports: HeartbeatReports) -> dict:
    """rental id -> the terms to mask out of what its runs on this node printed (their secret
    values): the agent is a third party, trusted to have masked nothing. Only rentals that name
    secrets and printed something in this heartbeat are read (`runs`:
    queries.BusyState.runs)."""
    with_secrets = {run_id: rental_id for run_id, rental_id, *_, secrets in runs if secrets}
    if not with_secrets:
        return {}
    # A running container's report carries no text: only tails, errors, lines and metrics.
    printed = {c.run_id for c in reports.containers if c.log_tail or c.error}
    printed |= {run_id for _, run_id, _ in reports.metrics}
    printed |= {run_id for run_id, _, _ in reports.logs}
    rental_ids = {with_secrets[run_id] for run_id in printed if run_id in with_secrets}
    if not rental_ids:
        return {}
    return rentals_mask_terms(Rental.objects.filter(pk__in=rental_ids))


def _apply_started(*, node: Node, reports: Sequence[ContainerReport], now: datetime) -> set[str]:
    """The first RUNNING reports of the node's single-node PROVISIONING rentals, the reports a
    launch brings: their runs read and locked together (run and rental rows, in rental order),
    written in one UPDATE, and their rentals moved by lifecycle.rentals_mark_running, instead of
    a savepoint, two locking reads and a transition each. Returns the run ids applied; every
    other report goes through _apply_container."""
    fresh = _plainly_running(reports)
    if not fresh:
        return set()
    runs = list(
        ContainerRun.objects.select_for_update(of=("self", "rental"))
        .select_related("rental__team", "rental__customer")
        .filter(
            node=node,
            run_id__in=sorted(fresh),
            rental__status=RentalStatus.PROVISIONING,
            rental__node_count=1,
        )
        .order_by("rental_id")
    )
    if not runs:
        return set()
    for run in runs:
        report = fresh[run.run_id]
        run.status = report.status
        run.started_at = run.started_at or _dt(report.started_at)
        # As _apply_container shows them: only the ports the rental asked for.
        wanted_ports = set(_ports(run.rental))
        run.published = [
            p.to_payload() for p in report.published if p.container_port in wanted_ports
        ]
    queries.runs_mark_started(
        status=ContainerStatus.RUNNING.value,
        now=now,
        runs=[(run.pk, run.started_at, run.published) for run in runs],
    )
    moved = lifecycle.rentals_mark_running(
        rentals=[run.rental for run in runs], hostname=node.hostname
    )
    return {run.run_id for run in runs if str(run.rental_id) in moved}


def _apply_container(
    node: Node, report: ContainerReport, now: datetime, masks: Mapping | None = None
) -> None:
    """Fold one reported container into its run row and the rental's state machine."""
    run = (
        ContainerRun.objects.select_for_update()
        .select_related("rental")
        .filter(run_id=report.run_id, node=node)
        .first()
    )
    if run is None:
        return  # not ours (or not yet requested): the desired state will tell the agent
    rental = Rental.objects.select_for_update().get(pk=run.rental_id)
    if terms := (masks or {}).get(rental.pk):
        report = dataclasses.replace(
            report,
            log_tail=secrets_mask(report.log_tail, terms),
            error=secrets_mask(report.error, terms),
        )
    run.status = report.status
    run.exit_code = report.exit_code
    run.started_at = run.started_at or _dt(report.started_at)
    run.finished_at = _dt(report.finished_at) or run.finished_at
    if report.log_tail:
        run.log_tail = report.log_tail[-8192:]
    # Only a running container is reachable; a port the rental did not ask for is not shown.
    wanted_ports = set(_ports(rental))
    run.published = [
        port.to_payload()
        for port in report.published
        if report.status == ContainerStatus.RUNNING and port.container_port in wanted_ports
    ]
    run.last_report_at = now
    run.save()
    gang = rental.node_count > 1
    if report.status in (ContainerStatus.RUNNING, ContainerStatus.EXITED):
        waiting_for = ""
        if gang:
            # RUNNING (and billed) from the moment the last member runs.
            state = gang_barrier(rental)
            if not state.open:
                waiting_for = f"{state.started} of {state.needed} members running"
        lifecycle.rental_mark_container_started(
            rental=rental, hostname=node.hostname, waiting_for=waiting_for
        )
    if (
        gang
        and report.status == ContainerStatus.EXITED
        and report.exit_code == 0
        and not report.error
        and rental.status == RentalStatus.RUNNING
        and gang_others_running(rental, node.pk)
    ):
        return  # this member finished its part: the rental ends when every member has
    if report.status in (ContainerStatus.EXITED, ContainerStatus.MISSING):
        lifecycle.rental_mark_container_ended(
            rental=rental,
            hostname=node.hostname,
            exit_code=report.exit_code,
            error=report.error,
            ended_at=run.finished_at or now,
            log_tail=run.log_tail,
            at=now,
        )


def metrics_store(
    *, node: Node, lines: list[tuple[str, str, str]], masks: Mapping | None = None
) -> int:
    """Store forwarded harness JSON lines (rental_id, run_id, line); replays are no-ops.

    Each line is checked again here (`metric_line_parse`: depth, NaN, ranges, control
    characters): the agent is not trusted to have done it. Returns how many were refused."""
    runs = dict(
        ContainerRun.objects.filter(node=node, run_id__in={r for _, r, _ in lines}).values_list(
            "run_id", "rental_id"
        )
    )
    rows, refused = metric_rows(lines=lines, runs=runs, masks=masks)
    queries.heartbeat_writes(
        node_id=node.pk, now=timezone.now(), steady=(), metrics=rows, logs=queries.Rows.logs()
    )
    return refused


def metric_rows(
    *, lines: Sequence[tuple[str, str, str]], runs: Mapping[str, Any], masks: Mapping | None
) -> tuple[queries.Rows, int]:
    """The rows of forwarded metric lines (rental_id, run_id, line) for queries.heartbeat_writes,
    and how many lines were refused. `runs`: run id -> rental id of the node's runs; a line of
    another run is left out, `masks` as in _masks."""
    rows, refused = queries.Rows.metrics(), 0
    sha1 = hashlib.sha1
    for _, run_id, line in lines:
        rental_id = runs.get(run_id)
        if rental_id is None:
            continue
        if masks and (terms := masks.get(rental_id)):
            line = secrets_mask(line, terms)
        try:
            data = metric_line_parse(line)
        except ProtocolError:
            refused += 1
            continue
        step = data.get("step")
        rows.add(
            rental_id,
            run_id,
            sha1(line.encode(), usedforsecurity=False).hexdigest(),
            str(data.get("event", ""))[:20],
            step if isinstance(step, int) else None,
            json.dumps(data),
        )
    return rows, refused


def benchmark_spec(*, gpu_indices: Sequence[int]) -> BenchmarkSpec:
    """The platform's benchmark, as settings pin it (image and command; nothing the host
    configures): on the node's FAILED GPUs when it has any (the check that may bring them
    back), else on its first GPU."""
    return BenchmarkSpec(
        image=settings.GPUMARKET["BENCHMARK_IMAGE"],
        command=tuple(settings.GPUMARKET["BENCHMARK_COMMAND"]),
        gpu_indices=tuple(gpu_indices),
    )


def benchmark_record(
    *, node: Node, result: Mapping[str, Any], clean: frozenset[int] = frozenset()
) -> NodeBenchmark:
    """Record a validated benchmark (provisioning.api.serializers.BenchmarkSerializer) the
    server asked for. A rate outside the plausible band for the node's card is kept, flagged,
    and not listed; one below the band flags the node (shown, ranked down) until a later
    result is back in it. A plausible result within the band is the passing check of the node's
    FAILED GPUs that reported `clean` in the same heartbeat: they are back in placement.

    A result marked simulated (nodeagent.telemetry.simulated: a figure for the card, not a
    measurement) is believed only from a node that joined as simulated, which is flagged as
    such wherever it is shown; from a real node it is refused whatever its figure."""
    tflops = float(result["matmul_tflops"])
    claims_simulated = result.get("raw", {}).get("simulated") is True
    model = GpuModel.objects.get(pk=node.gpu_model_id)
    plausible = measured_tflops_plausible(model=model, tflops=tflops) and (
        node.simulated or not claims_simulated
    )
    with transaction.atomic():
        bench = NodeBenchmark.objects.create(
            node=node,
            precision=result.get("precision", ""),
            device_name=result.get("device_name", ""),
            matmul_tflops=tflops,
            mem_bandwidth_gbs=result.get("mem_bandwidth_gbs"),
            h2d_gbs=result.get("h2d_gbs"),
            train_samples_per_s=result.get("train_samples_per_s"),
            raw=result.get("raw", {}),
            plausible=plausible,
        )
        update: dict[str, Any] = {"benchmark_requested": False}
        if plausible:
            # Only a believed figure moves the flag: an absurd one must not clear it.
            below = measured_tflops_below_band(
                model=model, tflops=tflops, precision=result.get("precision", "")
            )
            update.update(measured_tflops=tflops, benchmark_below_band=below)
            if not below:  # the check passes in the card's band only
                gpus_health_restore(
                    node=node, clean=clean, now=bench.measured_at,
                    reason=f"check passed: {tflops:g} TFLOPS",
                )  # fmt: skip
        else:
            log.warning(
                "implausible benchmark node=%s: %s TFLOPS on %s (simulated: result %s, node %s)",
                node.pk,
                tflops,
                node.gpu_model_id,
                claims_simulated,
                node.simulated,
            )
        Node.objects.filter(pk=node.pk).update(**update)
    return bench


@dataclass(frozen=True)
class HeartbeatReports:
    """What one heartbeat carries, as the HTTP edge checked it. `dropped` counts the elements
    the edge already refused."""

    containers: list[ContainerReport] = field(default_factory=list)
    usage: list[UsageReport] = field(default_factory=list)
    metrics: list[tuple[str, str, str]] = field(default_factory=list)
    logs: list[tuple[str, int, str]] = field(default_factory=list)
    benchmark: Mapping[str, Any] | None = None
    telemetry: list[dict] = field(default_factory=list)
    pulls: list[PullProgress] = field(default_factory=list)
    # Sent only when changed; None: unchanged (an empty list is news: nothing accepted / held).
    image_allow: tuple[str, ...] | None = None
    images: list[CachedImage] | None = None
    dropped: Mapping[str, int] = field(default_factory=dict)

    def idle(self) -> bool:
        """Nothing to apply but telemetry: every other report kind (a field added later
        included) is empty."""
        return not any(
            getattr(self, f.name) is not None
            if f.name in _SENT_WHEN_CHANGED
            else getattr(self, f.name)
            for f in fields(self)
            if f.name not in ("telemetry", "dropped")
        )


_SENT_WHEN_CHANGED = frozenset({"image_allow", "images"})


def node_heartbeat_by_token(
    *, raw_token: str, reports: HeartbeatReports, desired_digest: str = ""
) -> tuple[int, HeartbeatAnswer] | None:
    """Authenticate a heartbeat's node token and apply the heartbeat (node_heartbeat); None,
    and nothing changed, when the token is unknown or revoked.

    A heartbeat with no report but telemetry, the common case, is one statement: the token
    names the node, the node is marked seen and its held GPUs are read together. Only a node
    that holds GPUs, or is coming back from OFFLINE, is read whole and takes the full path."""
    key_hash = token_hash(raw_token)
    if reports.idle():
        now = timezone.now()
        interval = idle_heartbeat_interval_s()
        row = queries.idle_heartbeat(
            key_hash=key_hash,
            now=now,
            # Stored only when longer than the base: the sweep then waits three of them.
            interval_s=interval if interval > heartbeat_interval_s() else 0,
            offline=NodeStatus.OFFLINE.value,
            statuses=_CONTAINER_WANTED,
            health=_HEALTH,
        )
        if row is None:
            return None
        node_id, seen, run_benchmark, holds, degraded, failed = row
        if seen and not holds and not degraded and samples_clean(reports.telemetry):
            return node_id, _answer(node_id=node_id, reports=reports, desired=[], ack=0,
                                    counts=Counter(reports.dropped), now=now,
                                    run_benchmark=run_benchmark, failed=failed,
                                    interval=interval)  # fmt: skip
    applied = _heartbeat_apply(
        node=None, key_hash=key_hash, reports=reports, desired_digest=desired_digest
    )
    return None if applied is None else (applied[0].pk, applied[1])


# How long a desired state's digest stands at most (capped at a third of the presigned URLs'
# expiry): inputs it does not version (the catalog's card figures, a dataset's files, a gang
# member's address, this code) reach the agent within this time.
DESIRED_REFRESH_S = 300.0
# Changed when the desired state built from the same inputs changes: every digest changes.
_DESIRED_FORMAT = "1"


def desired_digest_for(
    *, node: Node, held: Sequence[tuple], versions: Mapping, now: datetime
) -> str:
    """What names the desired state of `node` built from `held` (queries.gpus_held) and the
    held rentals' `versions` (queries.gpus_held_versions) at `now`: equal digests, equal desired
    states. "" for an empty state (nothing to name)."""
    if not held:
        return ""
    refresh = DESIRED_REFRESH_S
    if objectstore.configured():
        refresh = min(refresh, objectstore.expiry_s() / 3)
    # Each node on its own phase: the fleet's digests do not all turn over at one instant.
    bucket = int((now.timestamp() + node.pk * 7.919 % refresh) // refresh)
    key = repr((
        _DESIRED_FORMAT, node.pk, node.cpu_cores, node.ram_gb, node.gpu_count,
        node.gpu_model_id, objectstore.configured(), bucket, held, sorted(versions.items()),
    ))  # fmt: skip
    return hashlib.blake2b(key.encode(), digest_size=16).hexdigest()


def node_heartbeat(
    *, node: Node, reports: HeartbeatReports, desired_digest: str = ""
) -> HeartbeatAnswer:
    """Apply one heartbeat, all of it or nothing, and answer with the desired state.

    An element that passed the HTTP edge and still cannot be applied (a database refusal) is
    rolled back to its savepoint, counted with the edge's `dropped` and logged: one bad report
    never fails the others, and never the answer.

    A busy node's steady heartbeat is three statements: the reads (queries.busy_heartbeat;
    through node_heartbeat_by_token, with the token's check and the node's row), the usage,
    the writes (queries.heartbeat_writes). The desired
    state is built only when its digest differs from the one the agent holds
    (`desired_digest`, desired_digest_for); else the answer says it is unchanged."""
    applied = _heartbeat_apply(
        node=node, key_hash="", reports=reports, desired_digest=desired_digest
    )
    assert applied is not None  # the node was given: no token to refuse
    return applied[1]


def _heartbeat_apply(
    *, node: Node | None, key_hash: str, reports: HeartbeatReports, desired_digest: str
) -> tuple[Node, HeartbeatAnswer] | None:
    """node_heartbeat of `node`, or without one of the node whose unrevoked token has
    `key_hash`, the token checked and the node read by the heartbeat's first statement (None,
    and nothing changed, for an unknown or revoked token)."""
    now = timezone.now()
    counts: Counter[str] = Counter(reports.dropped)
    reported = {c.run_id for c in reports.containers}
    reported |= {run_id for _, run_id, _ in reports.metrics}
    reported |= {run_id for run_id, _, _ in reports.logs}
    # A node on this path holds GPUs, or has just stopped holding them (its last runs' exits):
    # the busy interval, stored as it is told (the silent-node sweep waits three of them).
    interval = busy_heartbeat_interval_s()
    stored = interval if interval > heartbeat_interval_s() else 0
    with transaction.atomic():
        read = queries.BusyRead(
            now=now,
            interval_s=stored,
            offline=NodeStatus.OFFLINE.value,
            running=ContainerStatus.RUNNING.value,
            run_ids=sorted(reported),
            statuses=_CONTAINER_WANTED,
            health=_HEALTH,
        )
        if node is None:
            by_token = queries.busy_heartbeat_by_token(key_hash=key_hash, read=read)
            if by_token is None:
                return None
            node, state = by_token
        else:
            state = queries.busy_heartbeat(node_id=node.pk, read=read)
        run_benchmark = node.benchmark_requested
        if not state.seen:
            _node_back(node=node, now=now, interval_s=stored)
        # What may have changed the GPUs the node holds, or their rentals: re-read below.
        changed = False
        failed = state.failed
        verdicts: dict = {}
        if state.degraded or not samples_clean(reports.telemetry):
            verdicts = verdicts_by_index(reports.telemetry)
            if gpus_health_apply(node=node, verdicts=verdicts, now=now):
                run_benchmark = changed = True  # the check of the GPUs that failed
            failed = None
        steady = _steady_reports(runs=state.runs, reports=reports.containers)
        masks = _masks(runs=state.runs, reports=reports)
        changing = [c for c in reports.containers if c.run_id not in steady]
        started: set[str] = set()
        if any(c.status == ContainerStatus.RUNNING for c in changing):
            try:
                with transaction.atomic():
                    started = _apply_started(node=node, reports=changing, now=now)
            except DatabaseError as exc:
                # Each is then applied on its own, below.
                log.warning("started runs not applied together node=%s: %s", node.pk, exc)
        for report in sorted(changing, key=lambda c: c.run_id):
            if report.run_id in started:
                continue
            try:
                with transaction.atomic():
                    _apply_container(node, report, now, masks)
            except DatabaseError as exc:
                counts["containers"] += 1
                log.warning(
                    "container report dropped node=%s run=%s: %s", node.pk, report.run_id, exc
                )
        # Runs moved to RUNNING by _apply_started change nothing a node runs (`moved` below).
        if any(report.run_id not in started for report in changing):
            changed = True
        ack = 0
        if reports.usage:
            ack, refused = _usage_apply(node=node, usage=reports.usage)
            counts["usage"] += refused
        if reports.pulls:
            _pulls_apply(node=node, pulls=reports.pulls, now=now)
        if reports.image_allow is not None or reports.images is not None:
            _node_images_apply(node=node, image_allow=reports.image_allow, images=reports.images)
        if steady or reports.metrics or reports.logs:
            runs = {run_id: uuid.UUID(rental_id) for run_id, rental_id, *_ in state.runs}
            metric_rows_, refused = metric_rows(lines=reports.metrics, runs=runs, masks=masks)
            counts["metrics"] += refused
            log_rows_, refused = log_rows(lines=reports.logs, runs=runs, masks=masks)
            counts["logs"] += refused
            queries.heartbeat_writes(
                node_id=node.pk, now=now, steady=sorted(steady), metrics=metric_rows_,
                logs=log_rows_,
            )  # fmt: skip
        if reports.benchmark and not node.benchmark_requested:
            # A result nobody asked for (a node re-sending old figures, or making them up)
            # is not stored: one row per request, never one per heartbeat.
            counts["benchmark"] += 1
            BENCHMARKS_UNASKED.inc()
            log.warning("benchmark not asked for dropped node=%s", node.pk)
        elif reports.benchmark:
            verdicts = verdicts or verdicts_by_index(reports.telemetry)
            clean = frozenset(index for index, verdict in verdicts.items() if verdict is OK)
            benchmark_record(node=node, result=reports.benchmark, clean=clean)
            run_benchmark = False
        held, versions, recorded = state.held, state.versions, state.runs_recorded
        digest = desired_digest_for(node=node, held=held, versions=versions, now=now)
        moved = {uuid.UUID(c.rental_id) for c in changing if c.run_id in started}
        kept = False
        if changed or moved:
            # Whether the agent holds the desired state the reads above name.
            current = recorded and digest == desired_digest
            before = (held, versions)
            held, versions, recorded = queries.gpus_held_versions(
                node_id=node.pk, now=now, statuses=_CONTAINER_WANTED
            )
            kept = not changed and current and _moved_only(before, (held, versions), moved)
            digest = desired_digest_for(node=node, held=held, versions=versions, now=now)
        unchanged = bool(digest) and recorded and (kept or digest == desired_digest)
        desired = [] if unchanged else _desired_from(node=node, held=held)
        if desired:
            handed = _runs_request(node=node, desired=desired)
            if handed:
                after = queries.gpus_held_versions(
                    node_id=node.pk, now=now, statuses=_CONTAINER_WANTED
                )
                if after[2] and _moved_only((held, versions), after[:2], handed):
                    # The state just built, named as the next heartbeat will read it.
                    digest = desired_digest_for(node=node, held=after[0], versions=after[1],
                                                now=now)  # fmt: skip
    if run_benchmark and failed is None:
        failed = failed_gpu_indices(node_id=node.pk)
    return node, _answer(node_id=node.pk, reports=reports, desired=desired, ack=ack,
                         counts=counts, now=now, run_benchmark=run_benchmark,
                         failed=failed or (), digest=digest, unchanged=unchanged,
                         interval=interval)  # fmt: skip


def _moved_only(before: tuple, after: tuple, moved: set) -> bool:
    """Whether (held, versions) read `after` this heartbeat moved the rentals `moved` (a
    hand-over to PROVISIONING, a start to RUNNING: edges that change nothing a node runs)
    name the same desired state as those read `before`: the same GPUs held, each rental's
    version the same but for the row version of one moved here (its keys', secrets' and
    gang's parts unchanged). Else the next heartbeat builds the state again, as after any
    other change."""
    (held_before, versions_before), (held_after, versions_after) = before, after
    if held_before != held_after or versions_before.keys() != versions_after.keys():
        return False
    for rental_id, version in versions_after.items():
        old = versions_before[rental_id]
        if version != old and (
            rental_id not in moved or version.partition("|")[2] != old.partition("|")[2]
        ):
            return False
    return True


def _answer(
    *,
    node_id: int,
    reports: HeartbeatReports,
    desired: list[DesiredRun],
    ack: int,
    counts: Counter[str],
    now: datetime,
    run_benchmark: bool,
    failed: Sequence[int],
    digest: str = "",
    unchanged: bool = False,
    interval: int | None = None,
) -> HeartbeatAnswer:
    if reports.telemetry:
        # Redis is not in the transaction: buffered once the rest is applied.
        telemetry_buffer(node_id=node_id, samples=reports.telemetry)
    return HeartbeatAnswer(
        desired=tuple(desired),
        ack_usage_seq=ack,
        heartbeat_interval_s=interval or heartbeat_interval_s(),
        run_benchmark=run_benchmark,
        dropped={kind: n for kind, n in sorted(counts.items()) if n},
        benchmark=benchmark_spec(gpu_indices=failed) if run_benchmark else None,
        desired_digest=digest,
        desired_unchanged=unchanged,
        # Issued as of `now`, taken before the desired state was read (core.wake).
        wake=wake_channel(node_id=node_id, issued_at=now.timestamp()),
    )


def _node_back(*, node: Node, now: datetime, interval_s: int) -> None:
    """A node that was OFFLINE heartbeats again: ONLINE, under its row lock, with the event."""
    locked = Node.objects.select_for_update().get(pk=node.pk)
    update: dict = {"last_seen_at": now, "heartbeat_interval_s": interval_s}
    if locked.status == NodeStatus.OFFLINE:
        # Only an OFFLINE node comes back: a status set meanwhile (maintenance by its
        # provider, say) is not overwritten.
        NodeEvent.objects.create(
            node=locked,
            from_status=NodeStatus.OFFLINE,
            to_status=NodeStatus.ONLINE,
            reason="agent heartbeat",
        )
        update["status"] = NodeStatus.ONLINE
    Node.objects.filter(pk=node.pk).update(**update)


def _pulls_apply(*, node: Node, pulls: list[PullProgress], now: datetime) -> None:
    """Keep each pull's progress on its run (shown while the rental is provisioning). Only a
    run of this node that has not started takes it: a late report never overwrites a start."""
    for pull in pulls:
        ContainerRun.objects.filter(
            node=node, run_id=pull.run_id, status=ContainerRun.Status.REQUESTED
        ).update(
            pull_progress={
                "done_bytes": pull.done_bytes,
                "total_bytes": max(pull.total_bytes, pull.done_bytes),
                "at": now.timestamp(),
            }
        )


def _node_images_apply(
    *, node: Node, image_allow: tuple[str, ...] | None, images: list[CachedImage] | None
) -> None:
    """What the agent accepts and holds, for the scheduler (sent only when it changed)."""
    update: dict[str, Any] = {}
    if image_allow is not None:
        update["image_allow"] = sorted(set(image_allow))
    if images is not None:
        update["images"] = sorted(
            (image.to_payload() for image in images), key=lambda item: item["ref"]
        )
    Node.objects.filter(pk=node.pk).update(**update)


def _runs_request(*, node: Node, desired: list[DesiredRun]) -> set[uuid.UUID]:
    """Record the runs handed to the agent; the first hand-over moves SCHEDULED->PROVISIONING.
    The runs recorded before (every heartbeat hands them over again) are read in one go; the
    new runs of single-node rentals are recorded together (_runs_request_alone), a gang
    member's one by one (its rank is stored with it). Returns the rentals whose runs it
    recorded."""
    known = set(
        ContainerRun.objects.filter(run_id__in=[e.run_id for e in desired]).values_list(
            "run_id", flat=True
        )
    )
    new = [entry for entry in desired if entry.run_id not in known]
    if not new:
        return set()
    together: set[str] = set()
    try:
        with transaction.atomic():
            together = _runs_request_alone(node=node, entries=new)
    except DatabaseError as exc:
        # Each is then recorded on its own, below.
        log.warning("handed-over runs not recorded together node=%s: %s", node.pk, exc)
    handed = {uuid.UUID(entry.rental_id) for entry in new if entry.run_id in together}
    for entry in new:
        if entry.run_id in together:
            continue
        try:
            with transaction.atomic():
                run, created = ContainerRun.objects.get_or_create(
                    run_id=entry.run_id,
                    defaults={"rental_id": entry.rental_id, "node": node},
                )
                if not created:
                    continue
                rental = Rental.objects.select_for_update().get(pk=entry.rental_id)
                if rental.node_count > 1:
                    # The rank the server gave this member (rendezvous_env), which names where
                    # its output is stored.
                    run.node_rank = int(entry.env["NODE_RANK"])
                    run.save(update_fields=["node_rank"])
                lifecycle.rental_mark_provisioning(rental=rental, hostname=node.hostname)
            handed.add(rental.pk)
        except IntegrityError:
            continue  # a concurrent heartbeat recorded it first
    return handed


def _runs_request_alone(*, node: Node, entries: list[DesiredRun]) -> set[str]:
    """The new runs of single-node rentals, as a launch hands them over: their rentals locked
    in one read (pk order), the runs inserted in one statement, the rentals moved by
    lifecycle.rentals_mark_provisioning; returns the run ids now recorded. A run refused by a
    constraint (its rental has an older run on this node) is left out, as get_or_create's
    IntegrityError leaves it."""
    rentals = list(
        Rental.objects.select_for_update()
        .filter(pk__in={entry.rental_id for entry in entries}, node_count=1)
        .order_by("pk")
    )
    alone = {str(rental.pk) for rental in rentals}
    wanted = {entry.run_id: entry.rental_id for entry in entries if entry.rental_id in alone}
    if not wanted:
        return set()
    ContainerRun.objects.bulk_create(
        [ContainerRun(run_id=run_id, rental_id=rental_id, node=node)
         for run_id, rental_id in wanted.items()],
        ignore_conflicts=True,
    )  # fmt: skip
    recorded = dict(
        ContainerRun.objects.filter(node=node, run_id__in=list(wanted)).values_list(
            "run_id", "rental_id"
        )
    )
    with_run = {str(rental_id) for rental_id in recorded.values()}
    lifecycle.rentals_mark_provisioning(
        rentals=[rental for rental in rentals if str(rental.pk) in with_run],
        hostname=node.hostname,
    )
    return set(recorded)


def _usage_apply(*, node: Node, usage: list[UsageReport]) -> tuple[int, int]:
    """Hand the heartbeat's usage reports to billing in one batch (idempotent there); returns
    the highest seq handled and how many billing refused. A refused report (a host clock far
    ahead, say) is logged and acknowledged: it must not block every later report of the node."""
    reports = sorted(usage, key=lambda r: r.seq)
    result = usage_reports_apply(
        node_id=node.pk,
        reports=[
            MeteredUsage(
                rental_id=uuid.UUID(r.rental_id),
                run_id=r.run_id,
                seq=r.seq,
                gpu_count=r.gpu_count,
                started_at=_dt(r.started_at),
                confirmed_at=_dt(r.confirmed_at),
                final=r.final,
            )
            for r in reports
        ],
    )
    for index, field_name, why in result.rejected:
        log.warning(
            "usage report refused node=%s seq=%s %s: %s",
            node.pk,
            reports[index].seq,
            field_name,
            why,
        )
    return reports[-1].seq, len(result.rejected)
