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

# Celery's loggers of a task's life in a worker: "received" (worker.strategy), "succeeded",
# "retry", "raised" (app.trace).
TASK_LOGGERS = ("celery.worker.strategy", "celery.app.trace")
# What of a task's record stays: enough to find the task and, on failure, why it failed.
_TASK_FIELDS = ("id", "name", "runtime", "eta", "description", "exc", "internal", "hostname")
_FAILURE_ARGS_CHARS = 200


class TaskLogFilter(logging.Filter):
    """Keeps task log lines to the task's name, id and runtime (and, on failure, the exception
    with a short repr of its arguments): no argument payloads, no return values.

    Celery's received and succeeded lines carry the task's arguments and return value both in
    the message ("succeeded in 0.01s: {...}") and as the record's `data` extra, which the
    structured formatter prints whole: a periodic task returning a large dict printed it every
    few seconds. Installed on TASK_LOGGERS by the LOGGING setting."""

    def filter(self, record: logging.LogRecord) -> bool:
        context = getattr(record, "data", None)
        if not isinstance(context, dict) or "id" not in context:
            return True  # not a task line (or already trimmed)
        kept = {key: context[key] for key in _TASK_FIELDS if key in context}
        if record.levelno >= logging.WARNING:
            for key in ("args", "kwargs"):
                if key in context:
                    kept[key] = str(context[key])[:_FAILURE_ARGS_CHARS]
        record.data = kept
        if isinstance(record.msg, str) and "%(return_value)" in record.msg:
            record.msg = record.msg.replace(": %(return_value)s", "")
        if isinstance(record.args, dict):
            record.args = kept
        return True


@worker_init.connect
@beat_init.connect
def _refuse_tasks_celery_would_not_send(sender=None, **kwargs) -> None:
    """A worker or beat with a task that Celery refuses to send would run, but silently without
    that periodic work: refuse to start instead. So does one without the hooks the apps hand
    each other (marketplace.checks), which would fail every task that needs them."""
    from config.checks import celery_problems
    from marketplace.checks import hooks_are_registered

    problems = celery_problems(app) + [e.msg for e in hooks_are_registered(None)]
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
