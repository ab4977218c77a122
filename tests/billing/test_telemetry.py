"""GPU telemetry: raw samples, exact per-minute rollups, retention, and the owner's view."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from django.utils import timezone

from billing.models import TelemetryMinute, TelemetrySample
from billing.services import telemetry_ingest, telemetry_prune
from billing.services.metering import COPY_THRESHOLD
from core.errors import ValidationFailed
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db

T0 = datetime(2026, 1, 5, 10, 0, tzinfo=UTC)


def _sample(gpu: int, ts, util: float, mem: int = 1000, power: float = 100.0, temp: float = 50.0):
    return {
        "gpu_index": gpu,
        "ts": ts,
        "util_pct": util,
        "mem_used_mb": mem,
        "power_w": power,
        "temp_c": temp,
    }


def _minute(node, gpu, minute) -> tuple:
    row = TelemetryMinute.objects.get(node=node, gpu_index=gpu, minute=minute)
    return (row.samples, row.util_sum, row.util_max, row.mem_max_mb, row.power_sum, row.temp_max)


def test_samples_are_stored_and_rolled_up_per_minute_exactly(make_node):
    node = make_node()
    samples = [
        _sample(0, T0 + timedelta(seconds=5), 10.0, mem=100, power=50.0, temp=40.0),
        _sample(0, (T0 + timedelta(seconds=35)).timestamp(), 30.0, mem=300, power=70.0, temp=45.0),
        _sample(0, T0 + timedelta(seconds=65), 90.0, mem=200, power=300.0, temp=70.0),
        _sample(1, T0 + timedelta(seconds=10), 55.5, mem=7, power=1.5, temp=-3.0),
    ]
    assert telemetry_ingest(node_id=node.pk, samples=samples) == 4
    assert TelemetrySample.objects.filter(node_id=node.pk).count() == 4
    assert _minute(node, 0, T0) == (2, 40.0, 30.0, 300, 120.0, 45.0)
    assert _minute(node, 0, T0 + timedelta(minutes=1)) == (1, 90.0, 90.0, 200, 300.0, 70.0)
    assert _minute(node, 1, T0) == (1, 55.5, 55.5, 7, 1.5, -3.0)


def test_late_and_repeated_batches_fold_into_their_minute(make_node):
    node = make_node()
    telemetry_ingest(node_id=node.pk, samples=[_sample(0, T0, 10.0)])
    telemetry_ingest(
        node_id=node.pk,
        samples=[_sample(0, T0 + timedelta(seconds=59), 70.0, mem=5000), _sample(0, T0, 10.0)],
    )
    assert _minute(node, 0, T0) == (3, 90.0, 70.0, 5000, 300.0, 50.0)


def test_a_large_batch_goes_through_copy_and_rolls_up_the_same(make_node):
    node = make_node()
    n = COPY_THRESHOLD + 400
    samples = [_sample(i % 8, T0 + timedelta(seconds=i // 8), float(i % 101)) for i in range(n)]
    assert telemetry_ingest(node_id=node.pk, samples=samples) == n
    assert TelemetrySample.objects.filter(node_id=node.pk).count() == n
    rows = TelemetryMinute.objects.filter(node=node)
    assert sum(r.samples for r in rows) == n
    assert sum(r.util_sum for r in rows) == sum(float(i % 101) for i in range(n))


def test_samples_without_a_rental_id_belong_to_the_rental_holding_the_gpu(make_node, book):
    make_node(gpus=8)
    booked = book(gpus=2, hours=2)
    gpu_indices = sorted(booked.rental.allocations.values_list("gpu__index", flat=True))
    now = timezone.now()
    telemetry_ingest(
        node_id=booked.node_ids[0],
        samples=[_sample(gpu_indices[0], now, 80.0), _sample(7, now, 0.0)],
    )
    minute = now.replace(second=0, microsecond=0)
    held = TelemetryMinute.objects.get(gpu_index=gpu_indices[0], minute=minute)
    free = TelemetryMinute.objects.get(gpu_index=7, minute=minute)
    assert (held.rental_id, free.rental_id) == (booked.rental.pk, None)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"gpu_index": -1}, "samples[1].gpu_index"),
        ({"util_pct": 101.0}, "samples[1].util_pct"),
        ({"util_pct": float("nan")}, "samples[1].util_pct"),
        ({"ts": "yesterday"}, "samples[1].ts"),
        ({"ts": 1e20}, "samples[1].ts"),
        ({"ts": -5.0}, "samples[1].ts"),
        ({"util_pct": True}, "samples[1].util_pct"),
        ({"ts": datetime(2026, 1, 1)}, "samples[1].ts"),
        ({"mem_used_mb": -5}, "samples[1].mem_used_mb"),
        ({"rental_id": "not-a-uuid"}, "samples[1].rental_id"),
    ],
)
def test_a_bad_sample_refuses_the_batch_naming_it(make_node, change, field):
    node = make_node()
    good = _sample(0, T0, 10.0)
    with pytest.raises(ValidationFailed) as err:
        telemetry_ingest(node_id=node.pk, samples=[good, good | change])
    assert err.value.field == field
    assert not TelemetrySample.objects.exists()
    assert not TelemetryMinute.objects.exists()


def test_retention_deletes_old_raw_samples_and_keeps_the_rollups(make_node):
    node = make_node()
    now = timezone.now()
    old, recent = now - timedelta(days=8), now - timedelta(days=1)
    telemetry_ingest(node_id=node.pk, samples=[_sample(0, old, 1.0), _sample(0, recent, 2.0)])
    assert telemetry_prune(now=now, days=7, batch=1) == 1
    assert list(TelemetrySample.objects.values_list("util_pct", flat=True)) == [2.0]
    assert TelemetryMinute.objects.count() == 2


def test_a_rental_telemetry_is_shown_to_its_owner_only(make_node, book, auth_api):
    make_node(gpus=8)
    booked = book(gpus=1, hours=2)
    (gpu,) = booked.rental.allocations.values_list("gpu__index", flat=True)
    now = timezone.now()
    telemetry_ingest(
        node_id=booked.node_ids[0],
        samples=[_sample(gpu, now, 40.0, power=200.0), _sample(gpu, now, 60.0, power=300.0)],
    )
    url = f"/api/v1/billing/rentals/{booked.rental.pk}/telemetry/"
    r = auth_api.get(url)
    assert r.status_code == 200
    (row,) = r.json()["results"]
    assert (row["gpu_index"], row["samples"], row["util_avg_pct"], row["power_avg_w"]) == (
        gpu,
        2,
        50.0,
        250.0,
    )
    assert auth_api.get(url, {"since": "2026-01-01T00:00:00Z"}).status_code == 400
    auth_api.force_authenticate(UserFactory())
    assert auth_api.get(url).status_code == 404
