"""Process-level Prometheus instruments the apps below `config` increment.

They live here, in the lowest app, so billing and the scheduler's binding can record without
importing `config`. Under gunicorn or Celery with PROMETHEUS_MULTIPROC_DIR set, prometheus-client
keeps them in shared files and `/metrics` aggregates every process of that host; without it each
process counts for itself.
"""

from __future__ import annotations

from prometheus_client import Counter, Histogram

STRIPE_ERRORS = Counter(
    "gpumarket_stripe_errors_total",
    "Stripe API calls that failed, by operation and whether a retry may succeed",
    ["operation", "kind"],
)
STORAGE_ERRORS = Counter(
    "gpumarket_storage_errors_total",
    "Object storage requests that failed, by operation",
    ["operation"],
)
SCHEDULER_CYCLE_SECONDS = Histogram(
    "gpumarket_scheduler_cycle_seconds",
    "Wall time of one scheduler cycle, by pool",
    ["pool"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
SCHEDULER_PLACEMENTS = Counter(
    "gpumarket_scheduler_placements_total",
    "Rentals placed by scheduler cycles, by pool",
    ["pool"],
)

HEARTBEATS_REFUSED = Counter(
    "gpumarket_agent_heartbeats_refused_total",
    "Agent heartbeats answered 503 before any work: the web process already served its bound"
    " of them (AGENT_HEARTBEATS_IN_FLIGHT)",
)
BENCHMARKS_UNASKED = Counter(
    "gpumarket_benchmarks_unasked_total",
    "Benchmark results a node sent that the server had not asked for (dropped, not stored)",
)


def scheduler_cycle_observe(*, pool: str, seconds: float, placements: int) -> None:
    """Called where a scheduler cycle ends."""
    SCHEDULER_CYCLE_SECONDS.labels(pool=pool).observe(seconds)
    SCHEDULER_PLACEMENTS.labels(pool=pool).inc(placements)
