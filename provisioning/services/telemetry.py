"""GPU telemetry from heartbeats: buffered in Redis, stored in bulk by a periodic task."""

from __future__ import annotations

import atexit
import json
import logging
import os
import threading
import time
from collections import deque
from datetime import UTC, datetime, timedelta

import redis
from django.db import IntegrityError
from django.db.backends.postgresql.psycopg_any import DateTimeTZRange

from billing.services import telemetry_ingest
from core.errors import ValidationFailed
from core.redis_clients import redis_clients
from marketplace.models import Allocation

log = logging.getLogger(__name__)

# Telemetry is buffered in Redis and stored in bulk by a periodic task: 200 agents a second then
# cost the database a few COPY batches, not 800 statements. A heartbeat does not push its samples
# itself: it leaves them in this process's outbox, and a thread pushes what has gathered in one
# RPUSH every OUTBOX_PUSH_S (a round trip per heartbeat was a tenth of its server time).
# Samples are best effort: those in the outbox of a process that is killed, and those in Redis
# when Redis is lost, are lost. Billing never reads them.
TELEMETRY_BUFFER_KEY = "provisioning:telemetry"
TELEMETRY_FLUSH_BATCH = 5000
OUTBOX_PUSH_S = 0.5
# What an outbox keeps while Redis cannot take it: about a minute of 400 busy agents' samples.
OUTBOX_MAX_ENTRIES = 25_000


class _Outbox:
    """This process's heartbeats' samples on their way to the Redis buffer.

    `put` costs a heartbeat one list append. A daemon thread, started by the first `put` in
    each process (a forked child starts empty, and starts its own), pushes everything gathered
    every OUTBOX_PUSH_S; when Redis refuses, the entries stay for the next push, the oldest
    dropped (and counted in the log) beyond OUTBOX_MAX_ENTRIES. The process pushes what is left
    when it exits."""

    def __init__(self) -> None:
        self._started()

    def _started(self) -> None:
        """Empty, with no thread yet; a forked child starts so too (its parent's entries are
        the parent's to push, and a lock the parent's thread held would never be let go)."""
        self._pid = 0  # the process whose thread pushes; 0 before the first `put`
        self._lock = threading.Lock()  # the entries
        self._pushing = threading.Lock()  # one push at a time; `discard` waits for it
        self._entries: deque[str] = deque()
        self._dropped = 0

    def put(self, entry: str) -> None:
        with self._lock:
            if self._pid != os.getpid():
                self._pid = os.getpid()
                threading.Thread(target=self._run, name="telemetry-outbox", daemon=True).start()
            self._entries.append(entry)
            self._trim()

    def _trim(self) -> None:
        while len(self._entries) > OUTBOX_MAX_ENTRIES:
            self._entries.popleft()
            self._dropped += 1

    def _run(self) -> None:
        while True:
            time.sleep(OUTBOX_PUSH_S)
            try:
                self.push()
            except Exception:  # the thread must go on pushing; what failed is in the log
                log.exception("telemetry outbox push failed")

    def push(self) -> int:
        """Push what has gathered in one RPUSH; returns how many entries went. Never raises:
        what Redis refused stays for the next push."""
        with self._pushing:
            with self._lock:
                if self._pid != os.getpid() or not self._entries:
                    return 0
                entries, self._entries = list(self._entries), deque()
                dropped, self._dropped = self._dropped, 0
            if dropped:
                log.warning("telemetry outbox full: %s heartbeats' samples dropped", dropped)
            clients = redis_clients()
            client = clients.hot()
            try:
                if client is None:
                    raise redis.ConnectionError("Redis is left alone after a failure")
                client.rpush(TELEMETRY_BUFFER_KEY, *entries)
            except redis.RedisError as exc:
                if client is not None:
                    clients.hot_failed(exc)
                with self._lock:
                    self._entries.extendleft(reversed(entries))
                    self._trim()
                return 0
            return len(entries)

    def discard(self) -> None:
        """Forget what has gathered, after any push under way (tests: one test's samples are
        not the next one's)."""
        with self._pushing, self._lock:
            self._entries.clear()
            self._dropped = 0


_outbox = _Outbox()
os.register_at_fork(after_in_child=_outbox._started)
atexit.register(_outbox.push)


def telemetry_buffer(*, node_id: int, samples: list[dict]) -> None:
    """Queue a heartbeat's GPU samples for the next flush, without a round trip: they reach
    Redis with the process's next push. Without Redis they wait in the outbox (bounded), and a
    heartbeat never fails for them, or a Redis outage would turn every node silent."""
    _outbox.put(json.dumps({"node": node_id, "samples": samples}))


def telemetry_outbox_push() -> int:
    """Push this process's gathered samples to the Redis buffer now; returns how many
    heartbeats' samples went."""
    return _outbox.push()


def telemetry_outbox_discard() -> None:
    """Forget this process's gathered samples (tests)."""
    _outbox.discard()


def telemetry_flush(*, batch: int = TELEMETRY_FLUSH_BATCH) -> int:
    """Store the buffered samples, node by node, in bulk; returns how many were stored. This
    process's own outbox is pushed first (the other processes push theirs every
    OUTBOX_PUSH_S)."""
    _outbox.push()
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
