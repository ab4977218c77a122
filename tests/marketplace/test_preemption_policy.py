"""The preemption policy is read from the settings and chosen per rental at create: a preempted
interruptible rental that checkpoints is re-queued by default, one that does not ends."""

from __future__ import annotations

from decimal import Decimal

import pytest
from django.db import transaction
from django.utils import timezone

from marketplace import lifecycle
from marketplace.models import Rental, RentalStatus
from marketplace.services.rentals import RentalRequest, RuntimeSpec, rental_create
from scheduler.services import scheduler_cycle_run
from tests.factories import personal_team

pytestmark = pytest.mark.django_db


def _interruptible(user, *, runtime: RuntimeSpec, policy: str | None = None) -> Rental:
    rental = rental_create(
        customer=user,
        team=personal_team(user),
        request=RentalRequest(
            gpus_per_node=1, duration_s=3600, runtime=runtime, kind="interruptible",
            bid_per_gpu_hour=Decimal("2.00"), preemption_policy=policy,
        ),
    )  # fmt: skip
    return rental


def _preempt(rental: Rental) -> Rental:
    # The scheduler passes its global flag; the rental's own choice decides.
    with transaction.atomic():
        locked = Rental.objects.select_for_update().get(pk=rental.pk)
        assert lifecycle.rental_preempt(
            rental=locked, reason="outbid", at=timezone.now(), requeue=False
        )
    locked.refresh_from_db()
    return locked


HARNESS = RuntimeSpec(image="gpumarket/harness:dev")
PLAIN = RuntimeSpec(image="img", command=["sleep", "60"])


def test_by_default_a_rental_that_checkpoints_is_requeued_and_one_that_does_not_ends(
    make_node, user
):
    # Given two placed interruptible rentals: the harness (it checkpoints) and a plain command
    make_node(gpus=2, price="1.00")
    trains = _interruptible(user, runtime=HARNESS)
    sleeps = _interruptible(user, runtime=PLAIN)
    scheduler_cycle_run(pool=trains.pool)
    assert (trains.preemption_policy, sleeps.preemption_policy) == ("requeue", "end")
    # When both are preempted
    trains, sleeps = _preempt(trains), _preempt(sleeps)
    # Then the harness run waits to resume and the other ends, both by preemption
    assert trains.status == RentalStatus.PENDING
    assert trains.events.last().cause == "preemption"
    assert (sleeps.status, sleeps.end_cause) == (RentalStatus.PREEMPTED, "preemption")


def test_the_setting_and_the_customers_choice_decide(make_node, user, settings):
    make_node(gpus=2, price="1.00")
    settings.GPUMARKET = {**settings.GPUMARKET, "PREEMPTION_POLICY": "requeue"}
    # Given the setting says requeue, a plain run follows it unless its customer chose to end
    follows = _interruptible(user, runtime=PLAIN)
    chose = _interruptible(user, runtime=PLAIN, policy="end")
    scheduler_cycle_run(pool=follows.pool)
    assert (follows.preemption_policy, chose.preemption_policy) == ("requeue", "end")
    assert _preempt(follows).status == RentalStatus.PENDING
    assert _preempt(chose).status == RentalStatus.PREEMPTED


def test_an_unknown_policy_is_a_400_naming_the_field(auth_api):
    body = {
        "gpus_per_node": 1, "duration_s": 3600, "kind": "interruptible",
        "bid_per_gpu_hour": "2.00", "preemption_policy": "sometimes",
        "runtime": {"image": "gpumarket/harness:dev"},
    }  # fmt: skip
    r = auth_api.post("/api/v1/rentals/", body, format="json")
    assert r.status_code == 400
    assert "preemption_policy" in r.content.decode()
    assert not Rental.objects.exists()
