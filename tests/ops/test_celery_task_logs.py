"""A worker's task log lines carry the task's name, id and runtime, never its payloads."""

from __future__ import annotations

import io
import logging
import logging.config
import subprocess
import sys
import time
from pathlib import Path

import pytest
from celery import Celery
from celery.app.trace import build_tracer
from django.conf import settings

from config.celery import TASK_LOGGERS
from config.celery import app as project_app
from tests.e2e.conftest import ROOT, stack_env, wait_for  # noqa: F401 - stack_env is a fixture

PAYLOAD = "P" * 3000  # an argument or result no log line should carry


@pytest.fixture
def task_logs():
    """The project's LOGGING, task loggers at INFO (a worker's `-l info`), into a buffer."""
    logging.config.dictConfig(settings.LOGGING)
    buffer = io.StringIO()
    logging.getLogger().handlers[0].setStream(buffer)
    for name in TASK_LOGGERS:
        logging.getLogger(name).setLevel(logging.INFO)
    yield buffer
    logging.config.dictConfig(settings.LOGGING)
    for name in TASK_LOGGERS:
        logging.getLogger(name).setLevel(logging.NOTSET)


def _trace(fn, *args) -> None:
    """Run `fn` as a task through Celery's own tracer, as a worker process does."""
    app = Celery("tests", set_as_current=False)
    task = app.task(name="tests.payload", shared=False, ignore_result=True)(fn)
    tracer = build_tracer(task.name, task, app=app, hostname="test-worker")
    tracer("task-7", list(args), {}, {"id": "task-7", "hostname": "test-worker"})


def test_a_succeeded_line_names_the_task_without_its_arguments_or_result(task_logs):
    # given a task whose argument and result are large
    def echoes(payload):
        return {"echo": payload, "rows": list(range(500))}

    # when it runs through the tracer under the project's logging config
    _trace(echoes, PAYLOAD)
    # then its line says which task, which id and how long, and nothing of the payloads
    [line] = [x for x in task_logs.getvalue().splitlines() if "succeeded" in x]
    assert "Task tests.payload[task-7] succeeded in" in line
    # (the result's list would print "..., 498, 499]"; a bare "499" may be in the runtime's digits)
    assert "PPPP" not in line and "rows" not in line and "498, 499" not in line
    assert len(line) < 400


def test_a_failure_line_keeps_the_task_the_exception_and_a_short_argument(task_logs):
    # given a task that fails on its large argument
    def fails(payload):
        raise ValueError("bad input")

    # when it runs
    _trace(fails, PAYLOAD)
    # then the failure names the task, its id, the exception and its traceback; the argument
    # is cut short
    text = task_logs.getvalue()
    [line] = [x for x in text.splitlines() if "raised unexpected" in x]
    assert "Task tests.payload[task-7] raised unexpected: ValueError('bad input')" in line
    assert "Traceback" in text
    assert PAYLOAD not in text and "P" * 150 in text


def _worker_lines(log: Path, task_id: str) -> list[str]:
    return [x for x in log.read_text(errors="replace").splitlines() if task_id in x]


@pytest.mark.django_db(transaction=True)
def test_a_real_worker_logs_received_and_succeeded_without_payloads(stack_env, tmp_path):  # noqa: F811
    # given a real worker at `-l info`
    celery = str(Path(sys.executable).parent / "celery")
    log = tmp_path / "worker.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [celery, "-A", "config", "worker", "-P", "solo", "-l", "info", "-Q", "h3-task-logs",
             "--without-heartbeat", "--without-mingle", "--without-gossip"],
            env={**stack_env, "LOG_LEVEL": "INFO"}, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        wait_for(lambda: b"ready" in log.read_bytes(), 60, "the Celery worker")
        # when a task with a large argument runs, and another fails on one
        ok = project_app.send_task(
            "scheduler.cycle", kwargs={"pool": PAYLOAD}, queue="h3-task-logs"
        )
        bad = project_app.send_task("scheduler.tick", args=[PAYLOAD], queue="h3-task-logs")
        wait_for(lambda: any("succeeded" in x for x in _worker_lines(log, ok.id)), 60, "ok")
        wait_for(lambda: any("raised" in x for x in _worker_lines(log, bad.id)), 60, "failure")
        time.sleep(0.2)
    finally:
        proc.terminate()
        proc.wait(30)
    # then received and succeeded lines name the task and its id, without the argument
    ok_lines = _worker_lines(log, ok.id)
    assert any(f"Task scheduler.cycle[{ok.id}] received" in x for x in ok_lines), ok_lines
    assert any(f"Task scheduler.cycle[{ok.id}] succeeded in" in x for x in ok_lines), ok_lines
    assert all("PPPP" not in x for x in ok_lines), ok_lines
    # and the failure keeps the task, its id and the exception, the argument cut short
    bad_lines = _worker_lines(log, bad.id)
    [failure] = [x for x in bad_lines if "raised" in x]
    assert f"Task scheduler.tick[{bad.id}] raised unexpected: TypeError" in failure
    assert all(PAYLOAD not in x for x in bad_lines)
