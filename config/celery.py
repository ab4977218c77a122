"""The Celery application shared by the web process, workers and beat."""

import logging
import os

from celery import Celery
from celery.signals import beat_init, worker_init, worker_ready

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings.base")

app = Celery("gpumarket")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()

log = logging.getLogger(__name__)


@worker_init.connect
@beat_init.connect
def _refuse_tasks_celery_would_not_send(sender=None, **kwargs) -> None:
    """A worker or beat with a task that Celery refuses to send would run, but silently without
    that periodic work: refuse to start instead."""
    from config.checks import celery_problems

    problems = celery_problems(app)
    if problems:
        raise SystemExit("refusing to start: " + "; ".join(problems))


@worker_ready.connect
def _place_pending_at_start(sender=None, **kwargs) -> None:
    """A worker that starts (or restarts after a crash) places whatever is pending at once,
    instead of waiting for beat: messages lost with the previous worker cost nothing."""
    try:
        app.send_task("scheduler.tick")
    except Exception:  # the broker is down: beat's next tick will do it
        log.exception("could not queue the start-up scheduler tick")
