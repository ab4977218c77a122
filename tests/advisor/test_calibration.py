"""Calibration by a real run: the harness trains on CPU, its JSON-line metrics are stored as the
agent would forward them, and the advisor compares them with its estimate and learns."""

import io
import json
import statistics
from datetime import timedelta

import pytest
from django.db.backends.postgresql.psycopg_any import DateTimeTZRange
from django.utils import timezone

from advisor.models import AdvisorCheck, AdvisorPrior
from harness.config import load_config_dict
from harness.metrics import JsonLines
from harness.trainer import Trainer
from marketplace.models import Allocation, Node, Rental
from provisioning.models import ContainerRun, RunMetric
from provisioning.services import advisor_runs_calibrate, metrics_store, run_id_for

pytestmark = pytest.mark.django_db

CARD = "a100-sxm4-80gb"
# What the customer asks; the harness then trains a small GPT (what the booked config runs).
QUERY = {"model": "gpt2-124m", "tokens_b": 1}
HARNESS = {
    "model": {"name": "gpt", "layers": 2, "width": 64, "heads": 2},
    "data": {"name": "text", "seq_len": 64, "batch_size": 8},
    "train": {"steps": 6, "log_every": 2, "device": "cpu", "precision": "fp32"},
    "checkpoint": {"enabled": False},
}


def _harness_lines() -> list[str]:
    out = io.StringIO()
    Trainer(load_config_dict(HARNESS), emit=JsonLines(out)).run()
    return out.getvalue().splitlines()


def _estimate_hours(api) -> float:
    body = {**QUERY, "card": CARD, "gpus": 1}
    return api.post("/api/v1/advisor/estimate/", body, format="json").json()["hours"]


def test_a_cpu_harness_run_moves_the_next_estimate_toward_the_measurement(auth_api, make_node):
    node = make_node(card=CARD, gpus=1)
    before = _estimate_hours(auth_api)
    booked = auth_api.post(
        "/api/v1/advisor/book/",
        {
            **QUERY,
            "card": CARD,
            "runtime": {"image": "gpumarket/harness:dev", "harness_config": HARNESS},
        },
        format="json",
    )
    assert booked.status_code == 201, booked.content
    rental = Rental.objects.get(pk=booked.json()["id"])
    assert rental.advisor_estimate["card"] == CARD

    # Given the run's metrics as the agent forwards them (the real harness, on CPU)
    run = ContainerRun.objects.create(
        rental=rental, node=node, run_id=run_id_for(rental.pk, node.pk, timezone.now())
    )
    lines = _harness_lines()
    refused = metrics_store(node=node, lines=[(str(rental.pk), run.run_id, line) for line in lines])
    assert refused == 0
    assert RunMetric.objects.filter(rental=rental).count() == len(lines)

    # When the calibration pass runs (twice: the second finds nothing new)
    assert advisor_runs_calibrate() == 1
    assert advisor_runs_calibrate() == 0

    # Then the measured step sits beside the estimate, and the card's prior moved toward it
    check = AdvisorCheck.objects.get(rental=rental)
    summary = json.loads(lines[-1])
    # The measurement is the median step rate after the warm-up interval, in tokens.
    steps = [json.loads(line) for line in lines if json.loads(line)["event"] == "step"]
    seq_len = HARNESS["data"].get("seq_len", 128)
    median_rate = statistics.median(e["samples_per_s"] for e in steps[1:])
    assert check.measured_tokens_per_s == pytest.approx(median_rate * seq_len)
    assert summary["event"] == "summary" and check.measured_peak_gb > 0
    # A CPU is far slower than an A100's estimate: the prior drops, never below its floor.
    assert check.measured_step_s > check.estimated_step_s
    prior = AdvisorPrior.objects.get(card__slug=CARD)
    assert prior.runs == 1 and check.prior_after == prior.mfu < check.prior_before
    after = _estimate_hours(auth_api)
    assert after > before

    accuracy = auth_api.get("/api/v1/advisor/accuracy/").json()
    assert accuracy["runs"] == 1
    assert accuracy["median"] == pytest.approx(
        check.measured_step_s / check.estimated_step_s, rel=1e-3
    )
    answer = auth_api.post("/api/v1/advisor/", QUERY, format="json").json()
    assert answer["accuracy"] == accuracy


def test_metrics_of_a_run_not_booked_by_the_advisor_are_not_compared(auth_api, make_node):
    node = make_node(card=CARD, gpus=1)
    r = auth_api.post(
        "/api/v1/rentals/",
        {"gpus_per_node": 1, "duration_s": 600, "runtime": {"image": "gpumarket/harness:dev"}},
        format="json",
    )
    assert r.status_code == 201, r.content
    rental = Rental.objects.get(pk=r.json()["id"])
    run = ContainerRun.objects.create(
        rental=rental, node=node, run_id=run_id_for(rental.pk, node.pk, timezone.now())
    )
    summary = json.dumps({"event": "summary", "steps": 1})
    metrics_store(node=node, lines=[(str(rental.pk), run.run_id, summary)])
    assert advisor_runs_calibrate() == 0
    assert not AdvisorCheck.objects.exists() and not AdvisorPrior.objects.exists()


def test_the_booked_plan_runs_as_planned_and_its_measurement_reaches_the_calibration(
    auth_api, make_node
):
    # Given a plan for the harness's tiny preset booked without a runtime of the customer's
    node = make_node(card=CARD, gpus=1)
    query = {"model": "tiny", "tokens_b": 0.001, "card": CARD}
    booked = auth_api.post("/api/v1/advisor/book/", query, format="json")
    assert booked.status_code == 201, booked.content
    rental = Rental.objects.get(pk=booked.json()["id"])
    planned = rental.harness_config
    assert planned["model"] == {"name": "transformer", "preset": "tiny"}

    # When the harness runs that config (shortened, on CPU) and its metrics are stored
    # (bf16 is the plan's precision; a CPU runs fp32 faster)
    train = {**planned["train"], "steps": 6, "log_every": 2, "device": "cpu", "precision": "fp32"}
    config = {**planned, "train": train, "checkpoint": {"enabled": False}}
    out = io.StringIO()
    Trainer(load_config_dict(config), emit=JsonLines(out)).run()
    lines = out.getvalue().splitlines()
    start = json.loads(lines[0])
    # Then the run reports the planned model and layout
    assert start["config"]["model"]["layers"] == 4 and start["config"]["model"]["hidden"] == 32
    for key in ("dp", "tp", "pp", "shard", "recompute", "micro_batch", "grad_accum"):
        assert start["layout"][key] == planned["layout"][key], key
    run = ContainerRun.objects.create(
        rental=rental, node=node, run_id=run_id_for(rental.pk, node.pk, timezone.now())
    )
    metrics_store(node=node, lines=[(str(rental.pk), run.run_id, line) for line in lines])
    # And its measurement is compared with the estimate for that model and layout
    assert advisor_runs_calibrate() == 1
    check = AdvisorCheck.objects.get(rental=rental)
    assert check.measured_step_s > 0 and check.estimated_step_s > 0


def test_a_run_on_a_simulated_host_is_shown_but_moves_no_prior(auth_api, make_node):
    # Given a plan booked and placed on a simulated host (it trains on its CPU)
    node = make_node(card=CARD, gpus=1)
    Node.objects.filter(pk=node.pk).update(simulated=True)
    booked = auth_api.post("/api/v1/advisor/book/", {**QUERY, "card": CARD}, format="json")
    assert booked.status_code == 201, booked.content
    rental = Rental.objects.get(pk=booked.json()["id"])
    gpu = node.gpus.first()
    now = timezone.now()
    Allocation.objects.create(
        rental=rental, gpu=gpu, node=node, during=DateTimeTZRange(now, now + timedelta(hours=1))
    )
    run = ContainerRun.objects.create(
        rental=rental, node=node, run_id=run_id_for(rental.pk, node.pk, timezone.now())
    )
    lines = _harness_lines()
    metrics_store(node=node, lines=[(str(rental.pk), run.run_id, line) for line in lines])
    # When the calibration pass runs
    assert advisor_runs_calibrate() == 1
    # Then the measurement is kept beside the estimate, marked simulated; the card's prior and
    # the advisor's accuracy are those of real hosts only
    check = AdvisorCheck.objects.get(rental=rental)
    assert check.simulated and check.measured_step_s > check.estimated_step_s
    assert check.prior_after == check.prior_before
    prior = AdvisorPrior.objects.get(card__slug=CARD)
    assert prior.runs == 0 and prior.mfu == check.prior_before
    assert auth_api.get("/api/v1/advisor/accuracy/").json()["runs"] == 0
