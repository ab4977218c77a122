"""GPU telemetry from heartbeats: buffered in Redis, stored in bulk by a periodic task."""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime, timedelta

import redis
from django.db import IntegrityError
from django.db.backends.postgresql.psycopg_any import DateTimeTZRange

from billing.services import telemetry_ingest
from marketplace.errors import ValidationFailed
from marketplace.models import Allocation
from marketplace.redis_clients import redis_clients

log = logging.getLogger(__name__)

# Telemetry is buffered in Redis by the heartbeat (one round trip) and stored in bulk by a
# periodic task: 200 agents a second then cost the database a few COPY batches, not 800
# statements. Samples still in the buffer when Redis is lost are lost; billing never reads them.
TELEMETRY_BUFFER_KEY = "provisioning:telemetry"
TELEMETRY_FLUSH_BATCH = 5000


def telemetry_buffer(*, node_id: int, samples: list[dict]) -> None:
    """Queue a heartbeat's GPU samples for the next flush. Without Redis they are dropped (and
    logged): billing never reads them, and a heartbeat must not fail for them, or a Redis
    outage would turn every node silent."""
    clients = redis_clients()
    client = clients.hot()
    if client is None:
        return
    try:
        client.rpush(TELEMETRY_BUFFER_KEY, json.dumps({"node": node_id, "samples": samples}))
    except redis.RedisError as exc:
        clients.hot_failed(exc)


def telemetry_flush(*, batch: int = TELEMETRY_FLUSH_BATCH) -> int:
    """Store the buffered samples, node by node, in bulk; returns how many were stored."""
    stored = 0
    while True:
        pipe = redis_clients().background().pipeline(transaction=True)
        pipe.lrange(TELEMETRY_BUFFER_KEY, 0, batch - 1)
        pipe.ltrim(TELEMETRY_BUFFER_KEY, batch, -1)
        entries, _ = pipe.execute()
        by_node: dict[int, list[dict]] = {}
        for raw in entries:
            entry = json.loads(raw)
            by_node.setdefault(entry["node"], []).extend(entry["samples"])
        for node_id, samples in sorted(by_node.items()):
            _attribute(node_id=node_id, samples=samples)
            try:
                stored += telemetry_ingest(node_id=node_id, samples=samples)
            except ValidationFailed as exc:
                log.warning("telemetry refused node=%s: %s", node_id, exc.message)
            except IntegrityError:
                log.warning("telemetry of a node that no longer exists dropped node=%s", node_id)
        if len(entries) < batch:
            return stored


def _epoch(sample: object) -> float | None:
    ts = sample.get("ts") if isinstance(sample, dict) else None
    if type(ts) in (int, float) and 0 <= ts < 32503680000:  # before year 3000
        return float(ts)
    return None  # left for the ingest's validation to refuse


def _attribute(*, node_id: int, samples: list[dict]) -> None:
    """Name the rental each sample's GPU was allocated to at its time (the allocation on that
    node and GPU index whose range holds it, and not yet released then), so a rental's charts
    and rollups show its own GPUs only. A sample of a free GPU stays unattributed."""
    stamps = [ts for ts in map(_epoch, samples) if ts is not None]
    if not stamps:
        return
    low = datetime.fromtimestamp(min(stamps), UTC)
    high = datetime.fromtimestamp(max(stamps), UTC) + timedelta(seconds=1)
    held: dict[int, list[tuple[float, float, str]]] = {}
    for index, during, released_at, rental_id in Allocation.objects.filter(
        node_id=node_id, during__overlap=DateTimeTZRange(low, high, "[)")
    ).values_list("gpu__index", "during", "released_at", "rental_id"):
        start = during.lower.timestamp() if during.lower else float("-inf")
        end = during.upper.timestamp() if during.upper else float("inf")
        if released_at is not None:
            end = min(end, released_at.timestamp())
        held.setdefault(index, []).append((start, end, str(rental_id)))
    if not held:
        return
    for sample in samples:
        ts = _epoch(sample)
        if ts is None or sample.get("rental_id"):
            continue
        for start, end, rental_id in held.get(sample.get("gpu_index"), ()):
            if start <= ts < end:
                sample["rental_id"] = rental_id
                break
