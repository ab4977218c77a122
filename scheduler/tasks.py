"""Thin Celery tasks around the scheduler services."""

from __future__ import annotations

import logging
import time

from celery import shared_task

from scheduler import services

log = logging.getLogger(__name__)


@shared_task(name="scheduler.cycle", ignore_result=True, time_limit=300, soft_time_limit=240)
def scheduler_cycle(pool: str = "default", requested_at: float | None = None) -> None:
    """One placement cycle for one pool. A burst of creates queues one task each; a task whose
    rentals a later snapshot already covered is dropped, and one that finds the pool locked
    leaves it to the running cycle's next round."""
    if requested_at is not None and services.last_snapshot_at(pool) > requested_at:
        return
    services.scheduler_cycle_run(pool=pool)


@shared_task(name="scheduler.tick", ignore_result=True, time_limit=60, soft_time_limit=50)
def scheduler_tick() -> None:
    """Beat: a cycle for every pool with pending rentals, so deadlines and retries happen even
    when no new rental arrives."""
    for pool in services.pools_with_pending():
        scheduler_cycle.delay(pool)


def scheduler_cycle_soon(pool: str) -> None:
    """Ask for a cycle now, after the caller's commit. Best effort: when the broker is down the
    request is logged and dropped, and beat's tick (or a worker's start) places the rental, so a
    committed create never turns into an error for the customer."""
    try:
        # The time is taken after commit: any cycle that snapshots later sees the new rows.
        scheduler_cycle.delay(pool, time.time())
    except Exception:
        log.warning("scheduler cycle not queued (broker unreachable); the tick will place it")
