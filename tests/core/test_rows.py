"""Rows written and read without the ORM's compiler (core.rows): the same rows as the ORM's,
and statements sent together that still run in order, each on a snapshot of its own."""

from __future__ import annotations

import threading
import time
import uuid
from datetime import timedelta

import pytest
from django.db import IntegrityError, connection, transaction
from django.db.models.functions import Now
from django.utils import timezone

from billing.models import Account, AccountKind, FundsHold
from core.rows import model_insert, models_insert, pipelined
from marketplace.models import Rental, RentalEvent
from tests.factories import personal_team

START = timezone.now()


def _columns(obj) -> dict:
    return {f.attname: getattr(obj, f.attname) for f in obj._meta.concrete_fields}


def _rental(user, **fields) -> Rental:
    values = {
        "customer": user,
        "team": personal_team(user),
        "status": "pending",
        "gpus_per_node": 2,
        "duration_s": 3600,
        "image": "img",
        "command": ["python", "-c", "print(1)"],
        "env": {"A": "1"},
        "ports": [22, 8888],
        "gpu_models": ["a100-sxm4-80gb"],
        "harness_config": {"epochs": 2},
        "start_at": START,
        "start_deadline": START + timedelta(hours=1),
    }
    values.update(fields)
    return Rental(**values)


@pytest.mark.django_db
def test_an_inserted_row_is_the_row_the_orm_writes(user):
    # Given two rentals asked for alike, one inserted here and one by the ORM's create
    ours = model_insert(_rental(user))
    theirs = Rental.objects.create(**{**_columns(_rental(user)), "id": uuid.uuid4()})

    # Then each column read back is what the ORM wrote for its twin, but for the ids and times
    # the row itself makes; the instance knows it is saved and has its auto_now times
    assert not ours._state.adding and ours._state.db == "default"
    read, twin = (
        _columns(Rental.objects.get(pk=ours.pk)),
        _columns(Rental.objects.get(pk=theirs.pk)),
    )
    made = {"id", "created_at", "updated_at"}
    assert {k: v for k, v in read.items() if k not in made} == {
        k: v for k, v in twin.items() if k not in made
    }
    assert read == _columns(ours)
    assert ours.created_at is not None and ours.updated_at is not None


@pytest.mark.django_db
def test_a_returned_primary_key_is_set_on_the_instance(user):
    rental = model_insert(_rental(user))
    event = model_insert(
        RentalEvent(rental=rental, to_status="pending", actor_kind="customer", reason="created")
    )
    assert isinstance(event.pk, int)
    assert _columns(RentalEvent.objects.get(pk=event.pk)) == _columns(event)


@pytest.mark.django_db
def test_an_expression_is_written_through_the_orm(user):
    # A value the database computes cannot be sent as a parameter: the ORM's compiler writes it
    rental = model_insert(_rental(user, started_at=Now()))
    assert Rental.objects.get(pk=rental.pk).started_at is not None


@pytest.mark.django_db
def test_an_instance_with_its_auto_key_set_is_refused_and_nothing_is_written(user):
    rental = model_insert(_rental(user))
    before = RentalEvent.objects.count()
    with pytest.raises(ValueError, match="already set"):
        model_insert(RentalEvent(id=10**9, rental=rental, to_status="pending", actor_kind="ops"))
    assert RentalEvent.objects.count() == before


@pytest.mark.django_db
def test_pipelined_statements_answer_in_order():
    rows = pipelined([("SELECT 1, 'a'", []), ("SELECT %s::int + 1", [41]), ("SELECT 3", [])])
    assert rows == [[(1, "a")], [(42,)], [(3,)]]


@pytest.mark.django_db
def test_a_failing_statement_raises_as_django_and_those_after_it_do_not_run(user):
    # Given a hold already written for a rental
    team = personal_team(user)
    account, _ = Account.objects.get_or_create(kind=AccountKind.CUSTOMER, team=team)
    rental = model_insert(_rental(user))
    FundsHold.objects.create(rental=rental, account=account, price_per_gpu_hour=1, amount_micros=1)
    duplicate = (
        "INSERT INTO billing_fundshold (rental_id, account_id, price_per_gpu_hour, amount_micros,"
        " created_at) VALUES (%s, %s, 1, 1, now())"
    )

    # When a pipeline writes a second hold for it, then a rental event
    with pytest.raises(IntegrityError), transaction.atomic():
        pipelined(
            [
                (duplicate, [rental.pk, account.pk]),
                (
                    "INSERT INTO marketplace_rentalevent (rental_id, from_status, to_status,"
                    " actor_kind, reason, created_at)"
                    " VALUES (%s, '', 'pending', 'ops', 'x', now())",
                    [rental.pk],
                ),
            ]
        )

    # Then Django's own IntegrityError is raised and neither statement wrote anything
    assert FundsHold.objects.count() == 1
    assert RentalEvent.objects.filter(rental=rental).count() == 0


@pytest.mark.django_db(transaction=True)
def test_a_read_sent_behind_a_lock_sees_what_the_locks_holder_committed(user):
    """The statements of a pipeline each take their own snapshot: a read sent together with a
    FOR UPDATE that waits sees the lock holder's commit, not the database as it was when the
    pipeline was sent (as a read inside the locking statement would)."""
    team = personal_team(user)
    account, _ = Account.objects.get_or_create(kind=AccountKind.CUSTOMER, team=team)
    locked = threading.Event()
    seen: list = []
    errors: list[BaseException] = []

    def holder():
        try:
            with transaction.atomic():
                Account.objects.select_for_update().get(pk=account.pk)
                locked.set()
                time.sleep(0.5)  # the other side's pipeline is sent and waits on the lock
                Account.objects.filter(pk=account.pk).update(balance_micros=123)
        except BaseException as exc:  # reported below
            errors.append(exc)
        finally:
            connection.close()

    def waiter():
        try:
            assert locked.wait(10)
            with transaction.atomic():
                seen.extend(
                    pipelined(
                        [
                            (
                                "SELECT id FROM billing_account WHERE id = %s FOR UPDATE",
                                [account.pk],
                            ),
                            (
                                "SELECT balance_micros FROM billing_account WHERE id = %s",
                                [account.pk],
                            ),
                        ]
                    )
                )
        except BaseException as exc:  # reported below
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=holder), threading.Thread(target=waiter)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errors == []
    assert seen == [[(account.pk,)], [(123,)]]


@pytest.mark.django_db
def test_a_column_left_to_its_database_default_is_written_by_the_prepared_insert(user):
    # Given a rental and an event that leave end_cause and cause to their db_default ("")
    from django.test.utils import CaptureQueriesContext

    rental = _rental(user)
    with CaptureQueriesContext(connection) as queries:
        model_insert(rental)
        event = model_insert(
            RentalEvent(rental=rental, to_status="pending", actor_kind="customer", reason="x")
        )
    # Then each went through its one prepared statement (no DEFAULT keyword: the ORM's
    # compiler writes that), with the value the column's default gives
    assert len(queries) == 2
    assert all("DEFAULT" not in q["sql"] for q in queries), [q["sql"] for q in queries]
    assert Rental.objects.get(pk=rental.pk).end_cause == "" == rental.end_cause
    assert RentalEvent.objects.get(pk=event.pk).cause == "" == event.cause


@pytest.mark.django_db
def test_rows_inserted_together_are_the_rows_inserted_one_by_one(user):
    # Given a rental and its event, inserted in one statement, and their twins one by one
    rental = _rental(user)
    event = RentalEvent(rental=rental, to_status="pending", actor_kind="customer", reason="x")
    models_insert(rental, event)
    twin = model_insert(_rental(user))
    twin_event = model_insert(
        RentalEvent(rental=twin, to_status="pending", actor_kind="customer", reason="x")
    )

    # Then both rows are stored as their twins are, and each instance has what the database
    # returned (the event's id, the columns left to their db_default) and knows it is saved
    made = {"id", "rental_id", "created_at", "updated_at"}
    for ours, theirs in ((rental, twin), (event, twin_event)):
        assert not ours._state.adding and ours._state.db == "default"
        read = _columns(type(ours).objects.get(pk=ours.pk))
        assert read == _columns(ours)
        assert {k: v for k, v in read.items() if k not in made} == {
            k: v for k, v in _columns(theirs).items() if k not in made
        }
    assert isinstance(event.pk, int) and event.rental_id == rental.pk


@pytest.mark.django_db
def test_a_failing_row_of_rows_inserted_together_writes_none_of_them(user):
    # Given a rental already stored
    stored = model_insert(_rental(user))
    rentals, events = Rental.objects.count(), RentalEvent.objects.count()

    # When a new event is inserted together with a rental under the stored one's key
    duplicate = _rental(user, id=stored.pk)
    event = RentalEvent(rental=duplicate, to_status="pending", actor_kind="customer")
    with pytest.raises(IntegrityError), transaction.atomic():
        models_insert(duplicate, event)

    # Then Django's IntegrityError is raised and neither row is written
    assert (Rental.objects.count(), RentalEvent.objects.count()) == (rentals, events)
