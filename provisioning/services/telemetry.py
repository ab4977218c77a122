"""GPU telemetry from heartbeats: buffered in Redis, stored in bulk by a periodic task."""

from __future__ import annotations

import json
import logging

import redis
from django.db import IntegrityError

from billing.services import telemetry_ingest
from marketplace.errors import ValidationFailed
from provisioning.redis_clients import redis_clients

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
            try:
                stored += telemetry_ingest(node_id=node_id, samples=samples)
            except ValidationFailed as exc:
                log.warning("telemetry refused node=%s: %s", node_id, exc.message)
            except IntegrityError:
                log.warning("telemetry of a node that no longer exists dropped node=%s", node_id)
        if len(entries) < batch:
            return stored
