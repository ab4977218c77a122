"""Thin Celery tasks around the scheduler services."""

from __future__ import annotations

from celery import shared_task

from scheduler import services


@shared_task(name="scheduler.cycle", ignore_result=True, time_limit=300, soft_time_limit=240)
def scheduler_cycle(pool: str = "default") -> None:
    """One placement cycle for one pool (skips when another worker holds the pool)."""
    services.scheduler_cycle_run(pool=pool)


@shared_task(name="scheduler.tick", ignore_result=True, time_limit=60)
def scheduler_tick() -> None:
    """Beat: a cycle for every pool with pending rentals, so deadlines and retries happen even
    when no new rental arrives."""
    for pool in services.pools_with_pending():
        scheduler_cycle.delay(pool)
