"""Thin periodic tasks of provisioning."""

from __future__ import annotations

from celery import shared_task

from provisioning import services


@shared_task(
    name="provisioning.mark_silent_nodes", ignore_result=True, time_limit=120, soft_time_limit=100
)
def mark_silent_nodes() -> None:
    services.nodes_mark_silent()


@shared_task(
    name="provisioning.end_booked_time", ignore_result=True, time_limit=120, soft_time_limit=100
)
def end_booked_time() -> None:
    services.rentals_end_booked_time()
    services.rentals_release_stopped()


@shared_task(
    name="provisioning.gangs_start_timeout", ignore_result=True, time_limit=120, soft_time_limit=100
)
def gangs_start_timeout() -> None:
    services.gangs_start_timeout()


@shared_task(
    name="provisioning.flush_telemetry", ignore_result=True, time_limit=120, soft_time_limit=100
)
def flush_telemetry() -> None:
    services.telemetry_flush()


@shared_task(
    name="provisioning.calibrate_advisor", ignore_result=True, time_limit=300, soft_time_limit=240
)
def calibrate_advisor() -> None:
    services.advisor_runs_calibrate()


@shared_task(
    name="provisioning.measure_reliability", ignore_result=True, time_limit=600, soft_time_limit=540
)
def measure_reliability() -> None:
    services.nodes_reliability_update()


@shared_task(
    name="provisioning.expire_run_logs", ignore_result=True, time_limit=600, soft_time_limit=540
)
def expire_run_logs() -> None:
    services.run_logs_expire()


@shared_task(
    name="provisioning.schedule_benchmarks", ignore_result=True, time_limit=120, soft_time_limit=100
)
def schedule_benchmarks() -> None:
    services.nodes_benchmark_schedule()
