"""The live log and the per-GPU series: lines and samples in through the agent API, out through
the customer API, scoped to the rental's owner."""

import time

import pytest
from rest_framework.test import APIClient

from provisioning.models import RunLogLine
from provisioning.services import run_logs_expire, telemetry_flush
from tests.provisioning.test_agent_api import _beat, _schedule, agent  # noqa: F401

pytestmark = pytest.mark.django_db


def _running(agent, rent, gpus=2):  # noqa: F811
    rental = _schedule(rent, gpus)
    [desired] = _beat(agent).json()["desired"]
    run = {"rental_id": str(rental.pk), "run_id": desired["run_id"], "started_at": time.time()}
    assert _beat(agent, containers=[{**run, "status": "running"}]).status_code == 200
    return rental, run


def _owner(rental):
    client = APIClient()
    client.force_authenticate(rental.customer)
    return client


def _lines(run, numbers, text="line {}"):
    return [{**run, "line_no": n, "line": text.format(n)} for n in numbers]


def test_output_lines_are_kept_once_in_order_and_followed_by_id(agent, rent):  # noqa: F811
    rental, run = _running(agent, rent)
    run = {k: run[k] for k in ("rental_id", "run_id")}
    assert _beat(agent, logs=_lines(run, range(0, 5))).json()["dropped"] == {}
    # A retried heartbeat and an agent restart send lines again: each is kept once.
    _beat(agent, logs=_lines(run, range(3, 8)))
    assert list(
        RunLogLine.objects.filter(rental=rental).order_by("id").values_list("line_no", flat=True)
    ) == list(range(8))
    owner = _owner(rental)
    page = owner.get(f"/api/v1/rentals/{rental.pk}/logs/").json()
    assert [row["line"] for row in page["results"]] == [f"line {n}" for n in range(8)]
    last = page["results"][4]["id"]
    after = owner.get(f"/api/v1/rentals/{rental.pk}/logs/", {"after": last}).json()
    assert [row["line_no"] for row in after["results"]] == [5, 6, 7]
    tail = owner.get(f"/api/v1/rentals/{rental.pk}/logs/", {"tail": 2}).json()
    assert [row["line_no"] for row in tail["results"]] == [6, 7]


def test_lines_for_a_run_not_on_this_node_are_dropped_and_counted(agent, rent):  # noqa: F811
    rental, _ = _running(agent, rent)
    foreign = {"rental_id": str(rental.pk), "run_id": "not-a-run-of-this-node"}
    answer = _beat(agent, logs=_lines(foreign, range(3))).json()
    assert answer["dropped"] == {"logs": 3}
    assert not RunLogLine.objects.exists()


def test_a_bad_log_element_is_dropped_and_the_rest_applied(agent, rent):  # noqa: F811
    _, run = _running(agent, rent)
    run = {k: run[k] for k in ("rental_id", "run_id")}
    good = _lines(run, [0])
    bad = [{**run, "line_no": -1, "line": "x"}, {**run, "line_no": "one", "line": "x"}]
    answer = _beat(agent, logs=[*good, *bad]).json()
    assert answer["dropped"] == {"logs": 2}
    assert list(RunLogLine.objects.values_list("line_no", "line")) == [(0, "line 0")]
    # Control characters the container printed never reach the log as such.
    _beat(agent, logs=[{**run, "line_no": 1, "line": "a\x00b\x1b[31mc"}])
    stored = RunLogLine.objects.get(line_no=1).line
    assert "\x00" not in stored and "\x1b" not in stored


def test_another_accounts_rental_log_and_series_are_404_and_bad_queries_400(agent, rent):  # noqa: F811
    rental, _ = _running(agent, rent)
    stranger = APIClient()
    stranger.force_authenticate(agent.node.provider.owner)
    for path in ("logs", "billing/gpu-series"):
        url = (
            f"/api/v1/billing/rentals/{rental.pk}/gpu-series/"
            if path.startswith("billing")
            else f"/api/v1/rentals/{rental.pk}/logs/"
        )
        assert stranger.get(url).status_code == 404
    owner = _owner(rental)
    for query in ({"after": -1}, {"after": "abc"}, {"after": 2**64}, {"tail": 0}):
        r = owner.get(f"/api/v1/rentals/{rental.pk}/logs/", query)
        assert r.status_code == 400 and next(iter(query)) in r.json(), (query, r.content)
    r = owner.get(f"/api/v1/billing/rentals/{rental.pk}/gpu-series/", {"since": "yesterday"})
    assert r.status_code == 400 and "since" in r.json()


def test_log_lines_past_the_retention_are_deleted(agent, rent, settings):  # noqa: F811
    from datetime import timedelta

    from django.utils import timezone

    _, run = _running(agent, rent)
    run = {k: run[k] for k in ("rental_id", "run_id")}
    _beat(agent, logs=_lines(run, range(3)))
    RunLogLine.objects.filter(line_no__lt=2).update(
        received_at=timezone.now() - timedelta(days=settings.GPUMARKET["LOG_RETENTION_DAYS"] + 1)
    )
    assert run_logs_expire() == 2
    assert list(RunLogLine.objects.values_list("line_no", flat=True)) == [2]


def test_the_gpu_series_has_a_line_per_gpu_from_the_samples_the_agent_sent(agent, rent):  # noqa: F811
    from core.redis_clients import redis_clients
    from provisioning.services import TELEMETRY_BUFFER_KEY

    # Samples another test left in the shared buffer are not this test's.
    redis_clients().background().delete(TELEMETRY_BUFFER_KEY)
    rental, _ = _running(agent, rent, gpus=2)
    start = rental.allocations.first().during.lower.timestamp()
    time.sleep(0.1)
    now = time.time()
    # A sample from before the allocation is not the rental's.
    _beat(agent, telemetry=[{"gpu_index": 0, "ts": start - 5, "util_pct": 1.0, "mem_used_mb": 7,
                             "power_w": 1.0, "temp_c": 1.0}])  # fmt: skip
    for t in range(3):
        samples = [
            {"gpu_index": g, "ts": start + (now - start) * t / 3, "util_pct": 90.0 + g,
             "mem_used_mb": 1000 * t, "power_w": 300.0, "temp_c": 60.0 + t}
            for g in (0, 1, 2)  # GPU 2 is not the rental's
        ]  # fmt: skip
        _beat(agent, telemetry=samples)
    telemetry_flush()
    owner = _owner(rental)
    answer = owner.get(f"/api/v1/billing/rentals/{rental.pk}/gpu-series/").json()
    assert answer["resolution"] == "raw"
    assert [(s["node"], s["gpu_index"]) for s in answer["series"]] == [
        ("gpu-host-1", 0),
        ("gpu-host-1", 1),
    ]
    for s in answer["series"]:
        assert [p[2] for p in s["points"]] == [0, 1000, 2000]  # memory, in order
        assert {p[1] for p in s["points"]} == {90.0 + s["gpu_index"]}
    # A window longer than the raw limit is drawn from the minute rollups.
    since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now - 6 * 3600))
    long = owner.get(f"/api/v1/billing/rentals/{rental.pk}/gpu-series/", {"since": since}).json()
    assert long["resolution"] == "minute"
    assert [s["gpu_index"] for s in long["series"]] == [0, 1]
    assert all(len(s["points"]) >= 1 for s in long["series"])
