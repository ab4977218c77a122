"""The agent's own Prometheus metrics, served by `--metrics-port` (off by default; bound to
127.0.0.1 unless `--metrics-address` says otherwise, so a provider's scraper opts in)."""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from agentprotocol import ContainerStatus

# The agent's own registry: its port serves these and nothing else a shared process registered.
REGISTRY = CollectorRegistry()
CONTAINERS = Gauge(
    "gpumarket_agent_containers",
    "Managed runs by their runtime state",
    ["state"],
    registry=REGISTRY,
)
RECONCILE_SECONDS = Histogram(
    "gpumarket_agent_round_seconds",
    "One round: observe, spool, heartbeat and reconcile",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
    registry=REGISTRY,
)
SPOOL_DEPTH = Gauge(
    "gpumarket_agent_spool_depth", "Usage reports spooled and not acknowledged", registry=REGISTRY
)
NVML_ERRORS = Counter(
    "gpumarket_agent_telemetry_errors_total",
    "GPU telemetry (NVML) calls that failed or timed out",
    ["kind"],
    registry=REGISTRY,
)
STAGING_CACHE = Counter(
    "gpumarket_agent_staging_cache_total",
    "Staged files (datasets, resume checkpoints) found in the node's cache or downloaded",
    ["result"],
    registry=REGISTRY,
)
STAGING_BYTES = Counter(
    "gpumarket_agent_staging_downloaded_bytes_total",
    "Bytes downloaded from object storage to stage runs",
    registry=REGISTRY,
)
STAGING_SECONDS = Histogram(
    "gpumarket_agent_staging_seconds",
    "Staging one run's datasets and resume files before it starts",
    buckets=(0.01, 0.1, 0.5, 1, 5, 15, 60, 300, 1800),
    registry=REGISTRY,
)
SYNC_BYTES = Counter(
    "gpumarket_agent_sync_uploaded_bytes_total",
    "Bytes of runs' output directories uploaded to object storage",
    registry=REGISTRY,
)
SYNC_FILES = Counter(
    "gpumarket_agent_sync_files_total",
    "Output files committed as artifacts, by whether they had to be uploaded",
    ["result"],
    registry=REGISTRY,
)
SYNC_ERRORS = Counter(
    "gpumarket_agent_sync_errors_total",
    "Artifact syncs that failed (retried later), by kind",
    ["kind"],
    registry=REGISTRY,
)


def serve(*, port: int, address: str) -> None:
    start_http_server(port, addr=address, registry=REGISTRY)


def containers_observe(states: Iterable[ContainerStatus]) -> None:
    counts = Tally(states)
    for state in ContainerStatus:
        CONTAINERS.labels(state=state.value).set(counts.get(state, 0))
