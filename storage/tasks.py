"""Thin Celery tasks of object storage: take ids, call one service."""

from __future__ import annotations

from celery import shared_task
from django.conf import settings

from storage import services as storage


@shared_task(
    name="storage.dataset_fetch",
    ignore_result=True,
    # A URL dataset can be big: the fetch gets the configured time, the hard limit a minute more.
    soft_time_limit=settings.STORAGE["FETCH_TIMEOUT_S"],
    time_limit=settings.STORAGE["FETCH_TIMEOUT_S"] + 60,
)
def dataset_fetch(dataset_id: str) -> None:
    storage.dataset_fetch(dataset_id=dataset_id)


@shared_task(
    name="storage.artifacts_expire", ignore_result=True, time_limit=900, soft_time_limit=840
)
def artifacts_expire() -> None:
    storage.artifacts_expire()


@shared_task(
    name="storage.dataset_uploads_abandon",
    ignore_result=True,
    time_limit=900,
    soft_time_limit=840,
)
def dataset_uploads_abandon() -> None:
    storage.dataset_uploads_abandon()
