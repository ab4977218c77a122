"""`/metrics` for Prometheus: request metrics, and the marketplace's state read from PostgreSQL
at scrape time (so every web process answers the same, whichever one is scraped).

The endpoint answers only a `Authorization: Bearer <METRICS_TOKEN>` request: 404 while no token is
configured (the endpoint does not exist), 401 for a missing or wrong one.
"""

from __future__ import annotations

import hmac
import os
import time
from datetime import timedelta

from django.conf import settings
from django.db.models import Count, Exists, F, Min, OuterRef, Q
from django.db.models.functions import Coalesce
from django.http import Http404, HttpRequest, HttpResponse
from django.utils import timezone
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    Histogram,
    generate_latest,
    multiprocess,
)
from prometheus_client.core import GaugeHistogramMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from billing.models import UsageMeter
from marketplace import queries
from marketplace.models import (
    Allocation,
    Gpu,
    Node,
    NodeStatus,
    Rental,
    RentalStatus,
)

# Anything else a client sends as a method is counted as "other": the label set stays bounded.
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
REQUEST_SECONDS = Histogram(
    "gpumarket_http_request_duration_seconds",
    "Django request latency by view name, method and status (its _count is the request count)",
    ["view", "method", "status"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)

# Disjoint age buckets of pending rentals: (label, lower bound in seconds).
PENDING_AGE_BUCKETS = (("0-10s", 0), ("10-60s", 10), ("1-5m", 60), ("5-60m", 300), ("1h+", 3600))
# Upper bounds (s) of the create-to-scheduled latency histogram.
SCHEDULE_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
SCHEDULE_LATENCY_WINDOW = timedelta(minutes=15)
# The latency query reads the newest events by primary key only, so a scrape stays cheap however
# long the event history grows (RentalEvent has no index on created_at).
SCHEDULE_LATENCY_MAX_EVENTS = 50_000


class MarketplaceCollector(Collector):
    """Gauges computed from PostgreSQL on each scrape, with a handful of aggregate queries."""

    def describe(self):
        # Registration asks for the names; answering from here keeps it off the database.
        yield GaugeMetricFamily("gpumarket_rentals_pending", "", labels=["age"])
        yield GaugeMetricFamily("gpumarket_gpus", "", labels=["state", "model", "region"])
        yield GaugeMetricFamily("gpumarket_nodes", "", labels=["status"])
        yield GaugeMetricFamily("gpumarket_node_heartbeat_lag_seconds", "", labels=["status"])
        yield GaugeMetricFamily("gpumarket_billing_lag_seconds", "")
        yield GaugeHistogramMetricFamily("gpumarket_rental_schedule_latency_seconds", "")

    def collect(self):
        now = timezone.now()
        yield from self._pending(now)
        yield from self._gpus(now)
        yield from self._nodes(now)
        yield self._billing_lag(now)
        yield self._schedule_latency(now)

    def _pending(self, now):
        family = GaugeMetricFamily(
            "gpumarket_rentals_pending", "Pending rentals by age since creation", labels=["age"]
        )
        bounds = [lower for _, lower in PENDING_AGE_BUCKETS] + [None]
        aggregates = {}
        for (label, lower), upper in zip(PENDING_AGE_BUCKETS, bounds[1:], strict=True):
            window = Q(created_at__lte=now - timedelta(seconds=lower))
            if upper is not None:
                window &= Q(created_at__gt=now - timedelta(seconds=upper))
            aggregates[label] = Count("id", filter=window)
        counts = Rental.objects.filter(status=RentalStatus.PENDING).aggregate(**aggregates)
        for label, _ in PENDING_AGE_BUCKETS:
            family.add_metric([label], counts[label])
        yield family

    def _gpus(self, now):
        """A GPU is allocated while an active allocation covers now (on whatever node), else free
        on an online node, else offline (its node is offline, in maintenance or draining)."""
        family = GaugeMetricFamily(
            "gpumarket_gpus", "GPUs by state, model and region", labels=["state", "model", "region"]
        )
        busy = Allocation.objects.filter(
            gpu=OuterRef("pk"), released_at__isnull=True, during__contains=now
        )
        rows = (
            Gpu.objects.annotate(busy=Exists(busy))
            .values("model__slug", "node__region", "node__status", "busy")
            .annotate(n=Count("id"))
            .order_by()
        )
        totals: dict[tuple[str, str, str], int] = {}
        for row in rows:
            if row["busy"]:
                state = "allocated"
            elif row["node__status"] == NodeStatus.ONLINE:
                state = "free"
            else:
                state = "offline"
            key = (state, row["model__slug"], row["node__region"])
            totals[key] = totals.get(key, 0) + row["n"]
        for key, n in sorted(totals.items()):
            family.add_metric(list(key), n)
        yield family

    def _nodes(self, now):
        count = GaugeMetricFamily("gpumarket_nodes", "Nodes by status", labels=["status"])
        lag = GaugeMetricFamily(
            "gpumarket_node_heartbeat_lag_seconds",
            "Seconds since the least recently seen node of each status last heartbeated",
            labels=["status"],
        )
        rows = Node.objects.values("status").annotate(n=Count("id"), oldest=Min("last_seen_at"))
        for row in rows.order_by("status"):
            count.add_metric([row["status"]], row["n"])
            if row["oldest"] is not None:
                lag.add_metric([row["status"]], (now - row["oldest"]).total_seconds())
        yield count
        yield lag

    def _billing_lag(self, now):
        """Age of the oldest usage not yet rated: since the last rating of a meter that has
        moved on since, or since its creation when it was never rated."""
        family = GaugeMetricFamily(
            "gpumarket_billing_lag_seconds", "Age of the oldest unrated usage (0 when none)"
        )
        oldest = UsageMeter.objects.filter(rated_version__lt=F("usage_version")).aggregate(
            t=Min(Coalesce("rated_at", "created_at"))
        )["t"]
        family.add_metric([], (now - oldest).total_seconds() if oldest else 0.0)
        return family

    def _schedule_latency(self, now):
        family = GaugeHistogramMetricFamily(
            "gpumarket_rental_schedule_latency_seconds",
            "Create to first SCHEDULED of the rentals scheduled in the last 15 minutes",
            labels=[],
        )
        cumulative, total, total_sum = queries.schedule_latencies(
            buckets=SCHEDULE_LATENCY_BUCKETS,
            last_events=SCHEDULE_LATENCY_MAX_EVENTS,
            status=RentalStatus.SCHEDULED,
            since=now - SCHEDULE_LATENCY_WINDOW,
        )
        buckets = [
            (str(float(b)), n) for b, n in zip(SCHEDULE_LATENCY_BUCKETS, cumulative, strict=True)
        ]
        buckets.append(("+Inf", total))
        family.add_metric([], buckets, float(total_sum))
        return family


_MARKETPLACE = MarketplaceCollector()


def _registry() -> CollectorRegistry:
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        # Every gunicorn and Celery process of this host writes its counters to that folder.
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        registry.register(_MARKETPLACE)
        return registry
    return REGISTRY


if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
    REGISTRY.register(_MARKETPLACE)


def metrics_view(request: HttpRequest) -> HttpResponse:
    token = settings.METRICS_TOKEN
    if not token:
        raise Http404
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.encode(), token.encode()):
        response = HttpResponse("metrics token required\n", status=401, content_type="text/plain")
        response["WWW-Authenticate"] = 'Bearer realm="metrics"'
        return response
    return HttpResponse(generate_latest(_registry()), content_type=CONTENT_TYPE_LATEST)


class RequestMetricsMiddleware:
    """Times every request and labels it with the resolved view name (never the raw path, whose
    ids would make one series per rental)."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        started = time.perf_counter()
        response = self.get_response(request)
        match = getattr(request, "resolver_match", None)
        view = (match.view_name or match._func_path) if match else "unresolved"
        REQUEST_SECONDS.labels(
            view=view,
            method=request.method if request.method in METHODS else "other",
            status=str(response.status_code),
        ).observe(time.perf_counter() - started)
        return response
