"""Start-up checks of the Celery wiring: every periodic task must be one that Celery will send.

Celery refuses to send a task whose soft time limit is above its hard one, and beat only logs
that refusal at each tick, so a bad limit silently stops periodic work. The same check runs as a
Django system check (`manage.py check`, the test command) and when a worker or beat starts.
"""

from __future__ import annotations

import importlib
import importlib.util
from datetime import timedelta

from celery import Celery
from django.apps import apps
from django.core.checks import Error, register


def _import_task_modules() -> None:
    # Not app.loader.import_default_modules(): Celery's Django fixup runs the system checks from
    # there, which would call this again.
    for config in apps.get_app_configs():
        if importlib.util.find_spec(f"{config.name}.tasks") is not None:
            importlib.import_module(f"{config.name}.tasks")


def celery_problems(app: Celery) -> list[str]:
    """What would make Celery refuse one of the project's tasks or beat entries; [] when none."""
    _import_task_modules()
    problems: list[str] = []
    for name, entry in sorted(app.conf.beat_schedule.items()):
        if entry["task"] not in app.tasks:
            problems.append(f"beat entry {name!r} names no registered task {entry['task']!r}")
        schedule = entry["schedule"]
        seconds = schedule.total_seconds() if isinstance(schedule, timedelta) else schedule
        if isinstance(seconds, int | float) and seconds <= 0:
            problems.append(f"beat entry {name!r} has a schedule of {seconds} s")
    for task_name, task in sorted(app.tasks.items()):
        if task_name.startswith("celery."):
            continue
        hard, soft = task.time_limit, task.soft_time_limit
        if hard is None or soft is None:
            problems.append(f"task {task_name!r} must name time_limit and soft_time_limit")
        elif soft >= hard:
            problems.append(
                f"task {task_name!r}: soft_time_limit {soft} s must be below time_limit {hard} s"
            )
    return problems


@register()
def celery_tasks_apply(app_configs, **kwargs) -> list[Error]:
    from config.celery import app

    return [
        Error(problem, hint="fix the task's decorator or CELERY_BEAT_SCHEDULE", id="config.E001")
        for problem in celery_problems(app)
    ]
