"""Hand each finished harness run of an advisor-booked rental to the advisor's calibration: the
run's JSON-line metrics (stored here, as RunMetric rows) beside the estimate made at booking."""

from __future__ import annotations

from datetime import timedelta

from django.utils import timezone

from advisor.calibration import advisor_check_record
from marketplace.models import Rental
from provisioning.models import RunMetric

# A run whose summary is older than this without a usable comparison is not looked at again.
CALIBRATION_WINDOW = timedelta(days=7)


def advisor_runs_calibrate(*, limit: int = 50) -> int:
    """Compare the latest finished runs with their estimates; returns how many were recorded.
    Idempotent: a rental is compared once."""
    summaries = (
        RunMetric.objects.filter(
            event="summary",
            received_at__gte=timezone.now() - CALIBRATION_WINDOW,
            rental__advisor_estimate__isnull=False,
            rental__advisor_check__isnull=True,
        )
        .order_by("rental_id", "-id")
        .distinct("rental_id")
        .values_list("rental_id", "run_id")[:limit]
    )
    recorded = 0
    for rental_id, run_id in summaries:
        rental = Rental.objects.get(pk=rental_id)
        events = list(
            RunMetric.objects.filter(rental_id=rental_id, run_id=run_id)
            .order_by("id")
            .values_list("data", flat=True)
        )
        if advisor_check_record(rental=rental, events=events) is not None:
            recorded += 1
    return recorded
