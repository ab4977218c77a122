"""Provisioning writes: joining nodes, agent heartbeats, the rental state changes they drive.

The agent reports actual state; the server answers with desired state computed from the
allocations. Every report is applied idempotently: a retried or replayed heartbeat changes
nothing it already changed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal

from django.conf import settings
from django.db import IntegrityError, connection, transaction
from django.db.models import Q
from django.utils import timezone

from agentprotocol import (
    ContainerReport,
    ContainerStatus,
    DesiredRun,
    GpuInfo,
    HeartbeatAnswer,
    UsageReport,
)
from billing.services import telemetry_ingest
from billing.services.metering import UsageReport as MeteredUsage
from billing.services.metering import usage_reports_apply
from marketplace import lifecycle
from marketplace.errors import ValidationFailed
from marketplace.models import (
    Allocation,
    GpuModel,
    Node,
    NodeEvent,
    NodeStatus,
    Provider,
    Rental,
    User,
)
from marketplace.services import GpuSpec, node_register, token_hash
from marketplace.services.accounts import token_mint
from provisioning.models import ContainerRun, JoinToken, NodeBenchmark, NodeCredential, RunMetric

log = logging.getLogger(__name__)


def heartbeat_interval_s() -> int:
    """How often agents report; the server says so in every answer."""
    return settings.GPUMARKET.get("HEARTBEAT_INTERVAL_S", 5)


def _dt(epoch: float | None) -> datetime | None:
    return None if epoch is None else datetime.fromtimestamp(epoch, tz=UTC)


def join_token_create(
    *,
    provider: Provider,
    created_by: User | None,
    region: str,
    price_per_gpu_hour: Decimal,
    min_bid_per_gpu_hour: Decimal,
    pool: str = "default",
    valid_for: timedelta = timedelta(days=1),
) -> tuple[JoinToken, str]:
    """A one-time join token for one new host; the secret is returned once."""
    if price_per_gpu_hour <= 0:
        raise ValidationFailed("price must be positive", field="price_per_gpu_hour")
    if not 0 < min_bid_per_gpu_hour <= price_per_gpu_hour:
        raise ValidationFailed(
            "minimum bid must be positive and at most the price", field="min_bid_per_gpu_hour"
        )
    prefix, raw = token_mint("gpj")
    token = JoinToken.objects.create(
        provider=provider,
        key_hash=token_hash(raw),
        prefix=prefix,
        region=region,
        pool=pool,
        price_per_gpu_hour=price_per_gpu_hour,
        min_bid_per_gpu_hour=min_bid_per_gpu_hour,
        created_by=created_by,
        expires_at=timezone.now() + valid_for,
    )
    return token, raw


def catalog_match(name: str, memory_mb: int) -> GpuModel | None:
    """The catalog card for an NVML device name ("NVIDIA H100 80GB HBM3") or a catalog slug.

    The family must appear in the name; among its cards the closest memory size wins (NVML
    reports a little less than the marketed size), then the form factor the name implies
    ("PCIe"; "SXM" or HBM3 memory otherwise), then the memory type.
    """
    exact = GpuModel.objects.filter(slug=name).first()
    if exact is not None:
        return exact
    lowered = name.lower()
    compact = lowered.replace("nvidia", "").replace("geforce", "").replace(" ", "").replace("-", "")
    memory_gb = memory_mb / 1024
    if "pcie" in compact:
        form = "pcie"
    elif "sxm" in compact or "hbm3" in compact:
        form = "sxm"
    else:
        form = ""
    best = None
    for model in GpuModel.objects.all():
        if model.family not in compact:
            continue
        model_form = "pcie" if model.form_factor.lower() == "pcie" else "sxm"
        score = (
            abs(model.memory_gb - memory_gb) // 4,
            0 if not form or form == model_form else 1,
            0 if model.memory_type.lower() in compact else 1,
            -len(model.family),
        )
        if best is None or score < best[0]:
            best = (score, model)
    if best is None or best[0][0] > max(1, memory_gb // 32):
        return None
    return best[1]


@dataclass(frozen=True, slots=True, kw_only=True)
class HostFacts:
    hostname: str
    cpu_cores: int
    ram_gb: int
    disk_gb: int
    driver_version: str = ""
    cuda_version: str = ""
    simulated: bool = False


def node_join(*, raw_join_token: str, host: HostFacts, gpus: list[GpuInfo]) -> tuple[Node, str]:
    """Turn a one-time join token into a listed node and a node token (stored hashed)."""
    if not gpus:
        raise ValidationFailed("a node needs at least one GPU", field="gpus")
    with transaction.atomic():
        token = (
            JoinToken.objects.select_for_update()
            .select_related("provider")
            .filter(key_hash=token_hash(raw_join_token))
            .first()
        )
        if token is None or token.used_at is not None or token.expires_at <= timezone.now():
            raise ValidationFailed("invalid, used or expired join token", field="join_token")
        models = {g.index: catalog_match(g.name, g.memory_mb) for g in gpus}
        unknown = sorted({g.name for g in gpus if models[g.index] is None})
        if unknown:
            raise ValidationFailed(f"GPU not in the catalog: {', '.join(unknown)}", field="gpus")
        node = node_register(
            provider=token.provider,
            hostname=host.hostname,
            region=token.region,
            pool=token.pool,
            cpu_cores=host.cpu_cores,
            ram_gb=host.ram_gb,
            disk_gb=host.disk_gb,
            price_per_gpu_hour=token.price_per_gpu_hour,
            min_bid_per_gpu_hour=token.min_bid_per_gpu_hour,
            gpus=[
                GpuSpec(
                    index=g.index,
                    uuid=g.uuid,
                    model_slug=models[g.index].slug,
                    topology_group=g.topology_group,
                )
                for g in gpus
            ],
            status=NodeStatus.ONLINE,
            simulated=host.simulated,
            nvlink=any(g.topology_group.startswith("nvl") for g in gpus),
            driver_version=host.driver_version,
            cuda_version=host.cuda_version,
        )
        node.last_seen_at = timezone.now()
        node.benchmark_requested = True  # measured, not declared: benchmark on join
        node.save(update_fields=["last_seen_at", "benchmark_requested"])
        _, raw = token_mint("gpn")
        NodeCredential.objects.create(node=node, key_hash=token_hash(raw))
        token.used_at = timezone.now()
        token.node = node
        token.save(update_fields=["used_at", "node"])
    return node, raw


def node_credential_revoke(*, node_id: int, actor: User | None) -> int:
    """Revoke the node's tokens: its agent gets 401 from now on."""
    return NodeCredential.objects.filter(node_id=node_id, revoked_at__isnull=True).update(
        revoked_at=timezone.now()
    )


# The two reads of every heartbeat, in SQL: building them through the ORM cost more server time
# than running them (they were a third of a heartbeat).
_NODE_BY_TOKEN_SQL = """
SELECT n.* FROM marketplace_node n
JOIN provisioning_nodecredential c ON c.node_id = n.id
WHERE c.key_hash = %s AND c.revoked_at IS NULL
LIMIT 1
"""
_SEEN_SQL = "UPDATE marketplace_node SET last_seen_at = %s WHERE id = %s"
_HELD_SQL = """
SELECT a.rental_id, g.index, g.uuid
FROM marketplace_allocation a
JOIN marketplace_gpu g ON g.id = a.gpu_id
JOIN marketplace_rental r ON r.id = a.rental_id
WHERE a.node_id = %s AND a.released_at IS NULL AND a.during @> %s::timestamptz
  AND r.status = ANY(%s)
ORDER BY a.rental_id, g.index
"""


def node_authenticate(raw_token: str) -> Node | None:
    """The node of a valid, unrevoked node token; None otherwise."""
    return next(iter(Node.objects.raw(_NODE_BY_TOKEN_SQL, [token_hash(raw_token)])), None)


def run_id_for(rental_id, node_id: int) -> str:
    return f"r{rental_id.hex}-n{node_id}"


def _cpu_and_memory(node: Node, gpus: int) -> tuple[float, int]:
    """CPU and memory in proportion to the share of the node's GPUs the rental takes."""
    share = gpus / node.gpu_count
    # torch alone needs about 1 GiB resident; below 2 GiB a training run is OOM-killed.
    return max(1.0, round(node.cpu_cores * share, 2)), max(2048, int(node.ram_gb * 1024 * share))


def desired_state(*, node: Node, now: datetime) -> list[DesiredRun]:
    """The containers that should run on the node now, from its active allocations."""
    with connection.cursor() as cursor:
        cursor.execute(_HELD_SQL, [node.pk, now, [str(s) for s in lifecycle.CONTAINER_WANTED]])
        held = cursor.fetchall()
    if not held:
        return []  # an idle node, the common case: one light query per heartbeat
    rentals = Rental.objects.in_bulk({rental_id for rental_id, _, _ in held})
    by_rental: dict = {}
    for rental_id, index, gpu_uuid in held:
        by_rental.setdefault(rental_id, (rentals[rental_id], []))[1].append((index, gpu_uuid))
    tensor_tflops = GpuModel.objects.values_list("tensor_tflops", flat=True).get(
        pk=node.gpu_model_id
    )
    desired = []
    for rental, gpus in by_rental.values():
        cpu, memory_mb = _cpu_and_memory(node, len(gpus))
        command = list(rental.command)
        env = {str(k): str(v) for k, v in rental.env.items()}
        if rental.harness_config is not None:
            env["HARNESS_CONFIG_JSON"] = json.dumps(rental.harness_config)
            if not command:
                # One command whatever the GPU count: DDP over every GPU the container sees.
                command = [
                    "python", "-m", "harness",
                    "--config-env", "HARNESS_CONFIG_JSON", "--nproc", "auto",
                ]  # fmt: skip
            env.setdefault("HARNESS_PEAK_TFLOPS", str(tensor_tflops))
        desired.append(
            DesiredRun(
                rental_id=str(rental.pk),
                run_id=run_id_for(rental.pk, node.pk),
                image=rental.image,
                command=tuple(command),
                env=env,
                gpu_indices=tuple(index for index, _ in gpus),
                gpu_uuids=tuple(gpu_uuid for _, gpu_uuid in gpus),
                cpu_limit=cpu,
                memory_limit_mb=memory_mb,
                ports=tuple(rental.ports),
            )
        )
    return desired


def _apply_container(node: Node, report: ContainerReport, now: datetime) -> None:
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
    run.status = report.status
    run.exit_code = report.exit_code
    run.started_at = run.started_at or _dt(report.started_at)
    run.finished_at = _dt(report.finished_at) or run.finished_at
    if report.log_tail:
        run.log_tail = report.log_tail[-8192:]
    run.last_report_at = now
    run.save()
    if report.status in (ContainerStatus.RUNNING, ContainerStatus.EXITED):
        lifecycle.rental_mark_container_started(
            rental=rental, hostname=node.hostname, started_at=run.started_at or now
        )
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


def metrics_store(*, node: Node, lines: list[tuple[str, str, str]]) -> int:
    """Store forwarded harness JSON lines (rental_id, run_id, line); replays are no-ops."""
    run_rentals = dict(
        ContainerRun.objects.filter(node=node, run_id__in={r for _, r, _ in lines}).values_list(
            "run_id", "rental_id"
        )
    )
    rows = []
    for _, run_id, line in lines:
        rental_id = run_rentals.get(run_id)
        if rental_id is None:
            continue
        try:
            data = json.loads(line)
        except ValueError:
            continue  # a non-JSON stdout line is the program's own business
        if not isinstance(data, dict):
            continue
        step = data.get("step")
        rows.append(
            RunMetric(
                rental_id=rental_id,
                run_id=run_id,
                line_hash=hashlib.sha1(line.encode(), usedforsecurity=False).hexdigest(),
                event=str(data.get("event", ""))[:20],
                step=step if isinstance(step, int) else None,
                data=data,
            )
        )
    RunMetric.objects.bulk_create(rows, ignore_conflicts=True)
    return len(rows)


def benchmark_record(*, node: Node, result: dict) -> NodeBenchmark:
    tflops = result.get("matmul_tflops")
    if not isinstance(tflops, int | float) or tflops <= 0:
        raise ValidationFailed("benchmark needs a positive matmul_tflops", field="benchmark")
    with transaction.atomic():
        bench = NodeBenchmark.objects.create(
            node=node,
            precision=str(result.get("precision", ""))[:8],
            device_name=str(result.get("device_name", ""))[:120],
            matmul_tflops=float(tflops),
            mem_bandwidth_gbs=result.get("mem_bandwidth_gbs"),
            h2d_gbs=result.get("h2d_gbs"),
            train_samples_per_s=result.get("train_samples_per_s"),
            raw=result,
        )
        Node.objects.filter(pk=node.pk).update(
            measured_tflops=float(tflops), benchmark_requested=False
        )
    return bench


def node_heartbeat(
    *,
    node: Node,
    containers: list[ContainerReport],
    usage: list[UsageReport],
    telemetry: list[dict],
    metrics: list[tuple[str, str, str]],
    benchmark: dict | None = None,
) -> HeartbeatAnswer:
    """Apply one heartbeat and answer with the desired state."""
    now = timezone.now()
    if node.status == NodeStatus.OFFLINE:
        with transaction.atomic():
            locked = Node.objects.select_for_update().get(pk=node.pk)
            update: dict = {"last_seen_at": now}
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
    else:
        # The common case is one UPDATE: 200 agents a second must stay cheap.
        with connection.cursor() as cursor:
            cursor.execute(_SEEN_SQL, [now, node.pk])
    for report in sorted(containers, key=lambda c: c.run_id):
        with transaction.atomic():
            _apply_container(node, report, now)
    ack = _usage_apply(node=node, usage=usage) if usage else 0
    if telemetry:
        telemetry_buffer(node_id=node.pk, samples=telemetry)
    if metrics:
        metrics_store(node=node, lines=metrics)
    run_benchmark = node.benchmark_requested
    if benchmark:
        try:
            benchmark_record(node=node, result=benchmark)
            run_benchmark = False
        except ValidationFailed as exc:
            log.warning("benchmark refused node=%s: %s", node.pk, exc.message)
    desired = desired_state(node=node, now=now)
    if desired:
        _runs_request(node=node, desired=desired)
    return HeartbeatAnswer(
        desired=tuple(desired),
        ack_usage_seq=ack,
        heartbeat_interval_s=heartbeat_interval_s(),
        run_benchmark=run_benchmark,
    )


def _runs_request(*, node: Node, desired: list[DesiredRun]) -> None:
    """Record the runs handed to the agent; the first hand-over moves SCHEDULED->PROVISIONING."""
    for entry in desired:
        try:
            with transaction.atomic():
                _, created = ContainerRun.objects.get_or_create(
                    run_id=entry.run_id,
                    defaults={"rental_id": entry.rental_id, "node": node},
                )
                if not created:
                    continue
                rental = Rental.objects.select_for_update().get(pk=entry.rental_id)
                lifecycle.rental_mark_provisioning(rental=rental, hostname=node.hostname)
        except IntegrityError:
            continue  # a concurrent heartbeat recorded it first


def _usage_apply(*, node: Node, usage: list[UsageReport]) -> int:
    """Hand the heartbeat's usage reports to billing in one batch (idempotent there); returns
    the highest seq handled. A report billing refuses (a host clock far ahead, say) is logged
    and acknowledged: it must not block every later report of the node."""
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
    return reports[-1].seq


# Telemetry is buffered in Redis by the heartbeat (one round trip) and stored in bulk by a
# periodic task: 200 agents a second then cost the database a few COPY batches, not 800
# statements. Samples still in the buffer when Redis is lost are lost; billing never reads them.
TELEMETRY_BUFFER_KEY = "provisioning:telemetry"
TELEMETRY_FLUSH_BATCH = 5000


def redis_client():
    """The process's Redis client for background work (its pool is shared by threads)."""
    import redis

    global _REDIS
    if _REDIS is None:
        _REDIS = redis.Redis.from_url(
            settings.REDIS_URL, socket_timeout=2, socket_connect_timeout=2, retry_on_timeout=True
        )
    return _REDIS


_REDIS = None

# The heartbeat's own Redis calls (rate limit, telemetry buffer) must never hold a heartbeat up:
# short timeouts, no retry, and after a failure Redis is left alone for a few seconds, so a hung
# Redis costs a heartbeat at most one short timeout, then nothing.
HOT_REDIS_TIMEOUT_S = 0.1
HOT_REDIS_PAUSE_S = 5.0
_HOT_REDIS = None
_hot_paused_until = 0.0


def hot_redis():
    """The heartbeat path's Redis client, or None while Redis is paused after a failure."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    global _HOT_REDIS
    if time.monotonic() < _hot_paused_until:
        return None
    if _HOT_REDIS is None:
        _HOT_REDIS = redis.Redis.from_url(
            settings.REDIS_URL,
            socket_timeout=HOT_REDIS_TIMEOUT_S,
            socket_connect_timeout=HOT_REDIS_TIMEOUT_S,
            retry=Retry(NoBackoff(), 0),
        )
    return _HOT_REDIS


def hot_redis_failed(exc: Exception) -> None:
    global _hot_paused_until
    _hot_paused_until = time.monotonic() + HOT_REDIS_PAUSE_S
    log.warning("Redis failed on the heartbeat path, left alone for %.0f s: %s",
                HOT_REDIS_PAUSE_S, exc)  # fmt: skip


def telemetry_buffer(*, node_id: int, samples: list[dict]) -> None:
    """Queue a heartbeat's GPU samples for the next flush. Without Redis they are dropped (and
    logged): billing never reads them, and a heartbeat must not fail for them, or a Redis
    outage would turn every node silent."""
    import redis

    client = hot_redis()
    if client is None:
        return
    try:
        client.rpush(TELEMETRY_BUFFER_KEY, json.dumps({"node": node_id, "samples": samples}))
    except redis.RedisError as exc:
        hot_redis_failed(exc)


def telemetry_flush(*, batch: int = TELEMETRY_FLUSH_BATCH) -> int:
    """Store the buffered samples, node by node, in bulk; returns how many were stored."""
    stored = 0
    while True:
        pipe = redis_client().pipeline(transaction=True)
        pipe.lrange(TELEMETRY_BUFFER_KEY, 0, batch - 1)
        pipe.ltrim(TELEMETRY_BUFFER_KEY, batch, -1)
        entries, _ = pipe.execute()
        by_node: dict[int, list[dict]] = {}
        for raw in entries:
            entry = json.loads(raw)
            by_node.setdefault(entry["node"], []).extend(entry["samples"])
        for node_id, samples in sorted(by_node.items()):
            try:
                stored += telemetry_ingest(node_id=node_id, samples=samples)
            except ValidationFailed as exc:
                log.warning("telemetry refused node=%s: %s", node_id, exc.message)
            except IntegrityError:
                log.warning("telemetry of a node that no longer exists dropped node=%s", node_id)
        if len(entries) < batch:
            return stored


def nodes_mark_silent(*, now: datetime | None = None) -> list[int]:
    """Nodes whose agent has been silent too long go OFFLINE; their rentals follow the policy:
    not yet started -> back to PENDING (re-queued elsewhere); started -> FAILED (their state is
    on the lost host) unless NODE_LOST_POLICY is "requeue"."""
    now = now or timezone.now()
    timeout = timedelta(seconds=settings.GPUMARKET["NODE_SILENCE_TIMEOUT_S"])
    policy = settings.GPUMARKET.get("NODE_LOST_POLICY", "fail")
    silent = list(
        Node.objects.filter(status__in=[NodeStatus.ONLINE, NodeStatus.DRAINING])
        .filter(Q(last_seen_at__lt=now - timeout) | Q(last_seen_at__isnull=True))
        .values_list("pk", flat=True)
    )
    for node_id in silent:
        with transaction.atomic():
            node = Node.objects.select_for_update().get(pk=node_id)
            if node.status not in (NodeStatus.ONLINE, NodeStatus.DRAINING):
                continue
            NodeEvent.objects.create(
                node=node,
                from_status=node.status,
                to_status=NodeStatus.OFFLINE,
                reason=f"no heartbeat for {int(timeout.total_seconds())} s",
            )
            node.status = NodeStatus.OFFLINE
            node.save(update_fields=["status"])
            rental_ids = (
                Allocation.objects.filter(node=node, released_at__isnull=True)
                .values_list("rental_id", flat=True)
                .distinct()
            )
            for rental in Rental.objects.select_for_update().filter(pk__in=list(rental_ids)):
                _node_lost(rental, node, now, policy)
    return silent


def _node_lost(rental: Rental, node: Node, now: datetime, policy: str) -> None:
    if lifecycle.rental_mark_node_lost(
        rental=rental, hostname=node.hostname, at=now, requeue=policy == "requeue"
    ):
        ContainerRun.objects.filter(rental=rental, node=node).delete()


def rentals_end_booked_time(*, now: datetime | None = None) -> int:
    """Running rentals whose booked window has ended are asked to stop (checkpoint, exit)."""
    now = now or timezone.now()
    ended = 0
    ids = list(
        Rental.objects.filter(status__in=lifecycle.BURNING, scheduled_end__lte=now).values_list(
            "pk", flat=True
        )
    )
    for rental_id in ids:
        with transaction.atomic():
            rental = Rental.objects.select_for_update().get(pk=rental_id)
            if lifecycle.rental_mark_booked_time_ended(rental=rental):
                ended += 1
    return ended
