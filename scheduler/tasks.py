"""Thin Celery tasks around the scheduler services."""

from __future__ import annotations

from celery import shared_task

from marketplace import lifecycle
from scheduler import services


@shared_task(name="scheduler.cycle", ignore_result=True, time_limit=300, soft_time_limit=240)
def scheduler_cycle(pool: str = "default", requested_at: float | None = None) -> None:
    """One placement cycle for one pool. A burst of creates queues a task now and then (see
    lifecycle.CYCLE_QUEUED_KEY); a task whose rentals a later snapshot already covered is
    dropped, and one that finds the pool locked leaves it to the running cycle, which runs
    rounds back to back while work arrives."""
    # Creates that found this request queued sent none of their own: a later snapshot that
    # covers the request's time does not cover them.
    relied_on = lifecycle.cycle_request_begin(pool)
    covered = requested_at is not None and services.last_snapshot_at(pool) > requested_at
    if covered and not relied_on:
        return
    if services.scheduler_cycle_run(pool=pool).more:
        # Work is still arriving: the pool goes back in the queue behind other pools' cycles.
        scheduler_cycle.delay(pool)


@shared_task(name="scheduler.tick", ignore_result=True, time_limit=60, soft_time_limit=50)
def scheduler_tick() -> None:
    """Beat: a cycle for every pool with pending rentals, so deadlines and retries happen even
    when no new rental arrives."""
    for pool in services.pools_with_pending():
        scheduler_cycle.delay(pool)
