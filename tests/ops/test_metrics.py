"""`/metrics` scraped through the real view on real PostgreSQL, checked against the database."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from marketplace.models import NodeStatus, Rental, RentalStatus
from scheduler.services import scheduler_cycle_run

pytestmark = pytest.mark.django_db

TOKEN = "metrics-test-token"


@pytest.fixture
def metrics_token(settings):
    settings.METRICS_TOKEN = TOKEN
    return TOKEN


def scrape(client) -> dict[tuple[str, tuple], float]:
    response = client.get("/metrics", HTTP_AUTHORIZATION=f"Bearer {TOKEN}")
    assert response.status_code == 200, response.content
    samples = {}
    for family in text_string_to_metric_families(response.content.decode()):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def labelled(samples, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_without_a_configured_token_there_is_no_endpoint(client, settings):
    settings.METRICS_TOKEN = ""
    assert client.get("/metrics", HTTP_AUTHORIZATION="Bearer anything").status_code == 404


def test_a_missing_or_wrong_token_is_refused(client, metrics_token):
    assert client.get("/metrics").status_code == 401
    wrong = client.get("/metrics", HTTP_AUTHORIZATION="Bearer not-the-token")
    assert wrong.status_code == 401
    assert b"gpumarket" not in wrong.content


def test_scraped_values_match_the_database(client, metrics_token, make_node, rent):
    make_node(card="a100-sxm4-80gb", gpus=8, region="eu-west")
    make_node(card="a100-sxm4-80gb", gpus=4, region="us-east")
    make_node(card="h100-sxm5-80gb", gpus=8, region="eu-west", status=NodeStatus.OFFLINE)
    placed = rent(2, gpu_models=("a100-sxm4-80gb",), region="eu-west")
    scheduler_cycle_run()
    # Created after the cycle: both stay pending until the next one (the H100s are offline).
    rent(1, gpu_models=("h100-sxm5-80gb",))
    rent(1, gpu_models=("a100-sxm4-80gb",))

    samples = scrape(client)
    placed.refresh_from_db()
    assert placed.status == RentalStatus.SCHEDULED
    pending_db = Rental.objects.filter(status=RentalStatus.PENDING).count()
    assert pending_db == 2
    pending = [v for (n, _), v in samples.items() if n == "gpumarket_rentals_pending"]
    assert sum(pending) == pending_db
    assert labelled(samples, "gpumarket_rentals_pending", age="0-10s") == pending_db

    a100, h100 = "a100-sxm4-80gb", "h100-sxm5-80gb"
    assert labelled(samples, "gpumarket_gpus", state="free", model=a100, region="eu-west") == 6
    assert labelled(samples, "gpumarket_gpus", state="allocated", model=a100, region="eu-west") == 2
    assert labelled(samples, "gpumarket_gpus", state="free", model=a100, region="us-east") == 4
    assert labelled(samples, "gpumarket_gpus", state="offline", model=h100, region="eu-west") == 8
    assert labelled(samples, "gpumarket_gpus", state="free", model=h100, region="eu-west") == 0

    assert labelled(samples, "gpumarket_nodes", status="online") == 2
    # The cycle above counted itself (the counters are the process's, so at least this one).
    assert labelled(samples, "gpumarket_scheduler_placements_total", pool="default") >= 1
    assert labelled(samples, "gpumarket_scheduler_cycle_seconds_count", pool="default") >= 1
    assert labelled(samples, "gpumarket_nodes", status="offline") == 1
    # One rental went from created to SCHEDULED inside the window.
    assert labelled(samples, "gpumarket_rental_schedule_latency_seconds_gcount") == 1
    assert labelled(samples, "gpumarket_billing_lag_seconds") == 0


def test_requests_are_counted_by_view_name_and_status(client, metrics_token):
    before = labelled(
        scrape(client),
        "gpumarket_http_request_duration_seconds_count",
        view="healthz",
        method="GET",
        status="200",
    )
    client.get("/healthz")
    client.generic("BREW", "/healthz")
    after = scrape(client)
    count = "gpumarket_http_request_duration_seconds_count"
    assert labelled(after, count, view="healthz", method="GET", status="200") == before + 1
    # A made-up method does not become a label value of its own.
    assert not any(dict(labels).get("method") == "BREW" for (_, labels) in after)
