"""The hooks the apps above the marketplace hand it when they are ready fail closed: without
billing's funds hold no rental is created and the checks refuse to start; without the event
recorder no transition happens; without storage's datasets attach no rental naming a dataset is
created; and the batch placement calls the recorder like every other transition."""

from __future__ import annotations

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.core.management import call_command
from django.core.management.base import SystemCheckError

from marketplace import lifecycle
from marketplace.checks import hooks_are_registered
from marketplace.models import Rental, RentalEvent, RentalStatus
from marketplace.services import rentals
from scheduler.services import scheduler_cycle_run

pytestmark = pytest.mark.django_db


def test_with_every_app_ready_the_hooks_are_registered():
    assert hooks_are_registered(None) == []
    call_command("check", "--fail-level", "ERROR")


def test_without_billings_funds_hold_the_checks_refuse_to_start_and_nothing_is_rented(
    monkeypatch, make_node, rent
):
    make_node(gpus=2)
    monkeypatch.setattr(rentals, "_funds_hold", None)
    assert [e.id for e in hooks_are_registered(None)] == ["marketplace.E002"]
    with pytest.raises(SystemCheckError, match="funds hold is not registered"):
        call_command("check")
    with pytest.raises(ImproperlyConfigured):
        rent(1)
    assert not Rental.objects.exists() and not RentalEvent.objects.exists()


def test_without_storages_datasets_attach_the_checks_refuse_and_no_rental_reads_a_dataset(
    monkeypatch, make_node, rent
):
    # Given a node, and no datasets attach handed to the marketplace
    make_node(gpus=2)
    monkeypatch.setattr(rentals, "_datasets_attach", None)
    assert [e.id for e in hooks_are_registered(None)] == ["marketplace.E004"]
    with pytest.raises(SystemCheckError, match="datasets attach is not registered"):
        call_command("check")
    # When a rental names a dataset, then it is refused and nothing was written
    with pytest.raises(ImproperlyConfigured):
        rent(1, datasets=("corpus",))
    assert not Rental.objects.exists() and not RentalEvent.objects.exists()


def test_without_the_event_recorder_no_transition_is_made(monkeypatch, make_node, rent):
    make_node(gpus=2)
    rental = rent(1)
    monkeypatch.setattr(lifecycle, "_event_recorder", None)
    assert [e.id for e in hooks_are_registered(None)] == ["marketplace.E003"]
    with pytest.raises(ImproperlyConfigured):
        scheduler_cycle_run()  # refused inside its transaction: the rental stays as it was
    rental.refresh_from_db()
    assert rental.status == RentalStatus.PENDING
    assert list(RentalEvent.objects.values_list("to_status", flat=True)) == ["pending"]


def test_the_batch_placement_calls_the_recorder_for_each_placed_rental(
    monkeypatch, make_node, rent
):
    make_node(gpus=4)
    first, second = rent(1), rent(2)
    heard: list[tuple[str, str]] = []

    def recorder(*, events):
        heard.extend((str(rental.pk), event.to_status) for rental, event in events)

    monkeypatch.setattr(lifecycle, "_event_recorder", recorder)
    monkeypatch.setattr(lifecycle, "_recorded_statuses", frozenset({RentalStatus.SCHEDULED}))
    scheduler_cycle_run()
    assert sorted(heard) == sorted(
        [(str(first.pk), RentalStatus.SCHEDULED), (str(second.pk), RentalStatus.SCHEDULED)]
    )
