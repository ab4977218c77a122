"""What the advisor plans is what runs: a plan booked from the advisor's answer runs on a real
node agent (simulated RTX 4090s, the Docker runtime, the harness image) with the planned model,
layout, batch and precision, read back from the config the running harness reports; and the
run's measured figures reach the advisor's calibration beside the estimate made at booking.
"""

from __future__ import annotations

import pytest

from advisor.models import AdvisorCheck
from marketplace.models import Node, NodeStatus, Rental, RentalStatus
from provisioning.models import RunMetric
from provisioning.services import advisor_runs_calibrate
from tests.e2e.conftest import wait_for

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.django_db(transaction=True),
    pytest.mark.usefixtures("funded_customer", "no_leftover_containers"),
]

CARD = "rtx4090-24gb"
# The harness's CPU-sized preset; tokens for about 25 steps.
QUERY = {"model": "tiny", "tokens_b": 0.0001, "checkpointing": "selective", "region": "e2e"}


def _event(rental_id: str, name: str) -> dict | None:
    row = RunMetric.objects.filter(rental_id=rental_id, event=name).order_by("id").first()
    return row.data if row else None


def test_a_booked_plan_runs_the_planned_model_and_layout_and_calibrates_the_advisor(
    auth_api, celery_worker, start_agent
):
    start_agent()
    wait_for(
        lambda: Node.objects.filter(region="e2e", status=NodeStatus.ONLINE).exists(),
        120,
        "the host to join",
    )

    # The customer asks the advisor and books its two-GPU plan in one step.
    answer = auth_api.post("/api/v1/advisor/", QUERY, format="json")
    assert answer.status_code == 200, answer.content
    plan = next(p for p in answer.json()["plans"] if p["card"] == CARD and p["gpus"] == 2)
    booked = auth_api.post("/api/v1/advisor/book/", {**QUERY, "plan": plan["id"]}, format="json")
    assert booked.status_code == 201, booked.content
    rental = Rental.objects.get(pk=booked.json()["id"])
    planned = rental.harness_config
    assert planned["model"] == {"name": "transformer", "preset": "tiny"}
    assert planned["layout"]["recompute"] == "selective"
    print(f"booked {plan['id']}: {planned}")

    # It runs, and the harness reports the config it trains: the plan's.
    wait_for(lambda: _event(rental.pk, "start"), 240, "the harness's start event")
    start = _event(rental.pk, "start")
    ran = start["config"]
    assert ran["model"]["preset"] == "tiny" and ran["model"]["name"] == "transformer"
    for key, value in planned["layout"].items():
        assert ran["layout"][key] == value, key
    assert ran["train"]["steps"] == planned["train"]["steps"]
    assert ran["train"]["precision"] == planned["train"]["precision"]
    assert ran["data"]["seq_len"] == planned["data"]["seq_len"]
    assert ran["data"]["batch_size"] == planned["data"]["batch_size"]
    assert start["world_size"] == plan["gpus"] == 2
    layout = plan["layout"]
    assert start["layout"]["dp"] * start["layout"]["tp"] * start["layout"]["pp"] == 2
    assert (start["layout"]["tp"], start["layout"]["pp"]) == (layout["tp"], layout["pp"])
    assert start["layout"]["recompute"] == "selective"

    # It trains its planned steps and completes; its figures reach the calibration.
    wait_for(
        lambda: Rental.objects.get(pk=rental.pk).status == RentalStatus.COMPLETED,
        420,
        "the planned run to complete",
    )
    assert _event(rental.pk, "summary") is not None
    assert advisor_runs_calibrate() == 1
    check = AdvisorCheck.objects.get(rental=rental)
    assert check.card == CARD and check.gpus == 2
    assert check.measured_step_s > 0 and check.estimated_step_s > 0
    assert check.measured_tokens_per_s > 0
    # The host is simulated (it trains on its CPU): the check is kept and shown, and moves
    # neither the card's prior nor the advisor's accuracy.
    assert check.simulated and check.prior_after == check.prior_before
    assert auth_api.get("/api/v1/advisor/accuracy/").json()["runs"] == 0
    print(
        f"step time measured {check.measured_step_s:.3f} s against {check.estimated_step_s:.4f} s"
        " estimated for the card (the simulated host trains on its CPU)"
    )
