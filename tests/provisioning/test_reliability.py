"""Reliability is measured from a node's history; what the provider declared is only a prior."""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal

import pytest
from django.utils import timezone

from marketplace.models import (
    Allocation,
    Gpu,
    GpuHealthEvent,
    Node,
    NodeEvent,
    Rental,
    RentalEvent,
    RentalStatus,
)
from marketplace.services.rentals import RentalRequest, RuntimeSpec, rental_create
from provisioning.services import nodes_reliability_update
from provisioning.services.reliability import PRIOR_HOURS
from scheduler.services import scheduler_cycle_run
from tests.factories import personal_team

pytestmark = pytest.mark.django_db


def _listed_since(node: Node, days: int) -> None:
    Node.objects.filter(pk=node.pk).update(
        created_at=timezone.now() - timedelta(days=days), last_seen_at=timezone.now()
    )


def _rental_on(
    node: Node, user, *, failed_because: str | None, days_ago: float, cause: str = "node"
) -> None:
    """A rental handed to the node `days_ago`, that ended for `failed_because` (by `cause`) or
    finished."""
    at = timezone.now() - timedelta(days=days_ago)
    rental = Rental.objects.create(
        customer=user, team=personal_team(user),
        status=RentalStatus.FAILED if failed_because else RentalStatus.COMPLETED,
        gpus_per_node=1, start_at=at, start_deadline=at, duration_s=3600, image="img",
    )  # fmt: skip
    gpu = node.gpus.first()
    Allocation.objects.create(
        rental=rental, gpu=gpu, node=node, during=(at, at + timedelta(hours=1)),
        released_at=at + timedelta(minutes=30),
    )  # fmt: skip
    for to, reason in (
        (RentalStatus.PROVISIONING, f"starting on {node.hostname}"),
        (RentalStatus.FAILED if failed_because else RentalStatus.COMPLETED,
         failed_because or "finished"),
    ):  # fmt: skip
        event = RentalEvent.objects.create(
            rental=rental, to_status=to, actor_kind="agent", reason=reason,
            cause=(cause if failed_because else "customer") if to != "provisioning" else "",
        )  # fmt: skip
        RentalEvent.objects.filter(pk=event.pk).update(created_at=at + timedelta(minutes=30))


def test_a_new_node_keeps_its_declared_prior(make_node):
    node = make_node(reliability="0.9100")
    nodes_reliability_update()
    node.refresh_from_db()
    assert (node.reliability, node.reliability_declared) == (Decimal("0.9100"), Decimal("0.9100"))
    assert node.reliability_observed_hours < 0.01


def test_a_node_that_failed_its_rentals_ranks_below_a_clean_one(make_node, user):
    # Given two identical nodes listed for 20 days, always online, that ran 10 rentals each;
    # the flaky one lost 6 of them (silent, could not start, container vanished)
    clean = make_node(hostname="clean", gpus=1, reliability="0.95")
    flaky = make_node(hostname="flaky", gpus=1, reliability="0.99")
    for node in (clean, flaky):
        _listed_since(node, 20)
    reasons = [
        "node flaky went silent",
        "cannot start on flaky: image pull failed",
        "container disappeared from flaky",
    ] * 2
    for i in range(10):
        _rental_on(clean, user, failed_because=None, days_ago=1 + i)
        _rental_on(flaky, user, failed_because=reasons[i] if i < 6 else None, days_ago=1 + i)
    # A failure on another host does not count against the clean node
    _rental_on(clean, user, failed_because="cannot start on elsewhere: x", days_ago=2)
    # nor a failure of the customer's doing that names it
    _rental_on(
        clean, user, failed_because="cannot start on clean: bad image", days_ago=3,
        cause="customer",
    )  # fmt: skip
    # When reliability is measured
    assert nodes_reliability_update() == 2
    clean.refresh_from_db()
    flaky.refresh_from_db()
    # Then it follows the history, not the declaration: 480 h of record against a 72 h prior
    weight = 480 / (480 + PRIOR_HOURS)
    assert float(clean.reliability) == pytest.approx((1 - weight) * 0.95 + weight * 1.0, abs=1e-3)
    assert float(flaky.reliability) == pytest.approx((1 - weight) * 0.99 + weight * 0.4, abs=1e-3)
    assert clean.reliability_observed_hours == pytest.approx(480, abs=0.1)
    # And the scheduler, reading the node rows, places the next rental on the clean node
    rental = rental_create(
        customer=user,
        team=personal_team(user),
        request=RentalRequest(
            gpus_per_node=1, duration_s=3600, runtime=RuntimeSpec(image="gpumarket/harness:dev")
        ),
    )
    scheduler_cycle_run(pool=rental.pool)
    assert Allocation.objects.get(rental=rental).node_id == clean.pk


def test_downtime_lowers_reliability_and_maintenance_does_not(make_node):
    # Given two nodes listed 10 days: one offline for 5 of them, one in maintenance for 5
    down = make_node(hostname="down")
    resting = make_node(hostname="resting")
    now = timezone.now()
    for node, status in ((down, "offline"), (resting, "maintenance")):
        _listed_since(node, 10)
        for days, frm, to in ((8, "online", status), (3, status, "online")):
            event = NodeEvent.objects.create(node=node, from_status=frm, to_status=to)
            NodeEvent.objects.filter(pk=event.pk).update(created_at=now - timedelta(days=days))
    nodes_reliability_update(now=now)
    down.refresh_from_db()
    resting.refresh_from_db()
    weight = 240 / (240 + PRIOR_HOURS)
    assert float(down.reliability) == pytest.approx((1 - weight) * 0.95 + weight * 0.5, abs=1e-3)
    assert float(resting.reliability) == pytest.approx(
        0.95 * (72 / (120 + 72)) + (120 / 192), abs=1e-3
    )


def test_time_a_gpu_spent_failed_lowers_its_node_s_reliability(make_node):
    # Given two 4-GPU nodes listed 10 days, always online; one GPU of the faulty one failed 8
    # days ago and came back after a passing check 3 days ago (5 of its 40 GPU-days lost), and
    # another GPU of it failed 2 days ago and is still out (2 more GPU-days)
    steady = make_node(hostname="steady", gpus=4)
    faulty = make_node(hostname="faulty", gpus=4)
    now = timezone.now()
    for node in (steady, faulty):
        _listed_since(node, 10)
    first, second = faulty.gpus.order_by("index")[:2]
    for gpu, days, frm, to in ((first, 8, "ok", "failed"), (first, 3, "failed", "ok"),
                               (second, 2, "ok", "failed")):  # fmt: skip
        event = GpuHealthEvent.objects.create(
            gpu=gpu, node=faulty, from_health=frm, to_health=to, reason="Xid 79"
        )
        GpuHealthEvent.objects.filter(pk=event.pk).update(created_at=now - timedelta(days=days))
    Gpu.objects.filter(pk=second.pk).update(health="failed", health_since=now - timedelta(days=2))
    # When reliability is measured
    nodes_reliability_update(now=now)
    steady.refresh_from_db()
    faulty.refresh_from_db()
    # Then the faulty node's observed figure is its GPUs' healthy share: 33 of 40 GPU-days
    weight = 240 / (240 + PRIOR_HOURS)
    assert float(steady.reliability) == pytest.approx((1 - weight) * 0.95 + weight, abs=1e-3)
    assert float(faulty.reliability) == pytest.approx(
        (1 - weight) * 0.95 + weight * 33 / 40, abs=1e-3
    )


def _running_on(node: Node, user) -> Rental:
    """A rental placed on `node` by the scheduler and running there (server events)."""
    from django.db import transaction

    from marketplace import lifecycle

    rental = rental_create(
        customer=user,
        team=personal_team(user),
        request=RentalRequest(gpus_per_node=1, duration_s=3600, runtime=RuntimeSpec(image="img")),
    )
    scheduler_cycle_run(pool=rental.pool)
    with transaction.atomic():
        locked = Rental.objects.select_for_update().get(pk=rental.pk)
        lifecycle.rental_mark_provisioning(rental=locked, hostname=node.hostname)
    return locked


@pytest.mark.parametrize(
    ("error", "exit_code"),
    [
        ("image 'evil/img' is not allowed on this node (allowed: gpumarket/*)", None),
        ('404 Client Error: Not Found ("No such image: evil/img:latest")', None),
        ("pull access denied for evil/img, repository does not exist", None),
        ('OCI runtime create failed: exec: "nope": executable file not found in $PATH', None),
        ("", 137),
        ("", 1),
    ],
)
def test_a_customers_failing_image_or_command_leaves_the_nodes_reliability_unchanged(
    make_node, user, error, exit_code
):
    # Given a node with 10 days of clean history and its measured score
    from django.db import transaction

    from marketplace import lifecycle

    node = make_node(hostname="victim", reliability="0.9500")
    _listed_since(node, 10)
    nodes_reliability_update()
    node.refresh_from_db()
    before = node.reliability
    # When customers' rentals fail on it through their own image or command, ten times
    for _ in range(10):
        rental = _running_on(node, user)
        with transaction.atomic():
            locked = Rental.objects.select_for_update().get(pk=rental.pk)
            lifecycle.rental_mark_container_ended(
                rental=locked, hostname=node.hostname, exit_code=exit_code, error=error,
                ended_at=timezone.now(), log_tail="", at=timezone.now(),
            )  # fmt: skip
        locked.refresh_from_db()
        assert (locked.status, locked.end_cause) == (RentalStatus.FAILED, "customer")
    # Then the node's measured reliability is what it was
    nodes_reliability_update()
    node.refresh_from_db()
    assert node.reliability == before


def test_a_node_side_start_failure_counts_against_the_node(make_node, user):
    # Given a node with 10 days of clean history
    from django.db import transaction

    from marketplace import lifecycle

    node = make_node(hostname="broken", reliability="0.9500")
    _listed_since(node, 10)
    nodes_reliability_update()
    node.refresh_from_db()
    before = node.reliability
    # When its runtime cannot start a rental for a reason of its own
    rental = _running_on(node, user)
    with transaction.atomic():
        locked = Rental.objects.select_for_update().get(pk=rental.pk)
        lifecycle.rental_mark_container_ended(
            rental=locked, hostname=node.hostname, exit_code=None,
            error="cannot mount the workspace: mkfs.ext4 failed", ended_at=timezone.now(),
            log_tail="", at=timezone.now(),
        )  # fmt: skip
    locked.refresh_from_db()
    assert (locked.status, locked.end_cause) == (RentalStatus.FAILED, "node")
    # Then it counts against the node
    nodes_reliability_update()
    node.refresh_from_db()
    assert node.reliability < before
