"""Limits and budgets under concurrent creates: 20 threads, each on its own PostgreSQL
connection, released at once by a barrier, never take an account past a limit."""

from __future__ import annotations

import threading
from decimal import Decimal

import pytest
from django.db import connection
from django.db.models import F, Sum

from billing.errors import BudgetExceeded, LimitExceeded, RateLimited
from billing.models import FundsHold
from billing.services import account_budgets_set, account_ceilings_set, account_for_customer
from marketplace.models import Rental
from marketplace.services.rentals import RentalRequest, RuntimeSpec, rental_create
from tests.billing.conftest import usd
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db(transaction=True)

CREATES = 20


def _create_in_parallel(customer, *, gpus=lambda i: 1, **request):
    """CREATES creates of `customer` at once; returns (created, refused) and fails on any other
    error."""
    barrier = threading.Barrier(CREATES)
    created: list[Rental] = []
    refused: list[Exception] = []
    errors: list[BaseException] = []

    def run(i: int):
        try:
            barrier.wait(timeout=30)
            created.append(
                rental_create(
                    customer=customer,
                    request=RentalRequest(
                        gpus_per_node=gpus(i),
                        duration_s=3600,
                        max_price_per_gpu_hour=Decimal("0.50"),
                        runtime=RuntimeSpec(image="gpumarket/harness:dev"),
                        **request,
                    ),
                )
            )
        except (LimitExceeded, BudgetExceeded) as exc:
            refused.append(exc)
        except BaseException as exc:  # reported below
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(CREATES)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert errors == []
    return created, refused


@pytest.fixture
def customer(fund, make_node):
    for _ in range(6):
        make_node(gpus=8, price="0.50")
    user = UserFactory()
    fund(user, "1000.00")
    return user


def _gpus(customer) -> int:
    return (
        Rental.objects.filter(customer=customer).aggregate(
            n=Sum(F("gpus_per_node") * F("node_count"))
        )["n"]
        or 0
    )


def test_parallel_creates_never_exceed_the_concurrent_gpu_limit(customer):
    # Given an account limited to 7 GPUs at once
    account = account_for_customer(user=customer)
    account_ceilings_set(account_id=account.pk, max_concurrent_gpus=7, max_rentals_per_minute=None)

    # When 20 creates of 1, 2 or 3 GPUs race each other
    created, refused = _create_in_parallel(customer, gpus=lambda i: 1 + i % 3)

    # Then the rentals stored hold at most 7 GPUs, each refusal is a 409 naming the limit, and
    # no refused create left a rental or a hold behind
    assert len(created) + len(refused) == CREATES
    assert all(type(exc) is LimitExceeded for exc in refused)
    assert {exc.field for exc in refused} == {"max_concurrent_gpus"}
    assert {exc.status for exc in refused} == {409}
    assert sum(r.gpu_count for r in created) == _gpus(customer) <= 7
    assert Rental.objects.filter(customer=customer).count() == len(created)
    assert FundsHold.objects.count() == len(created)
    # Every refusal saw the GPUs of the rentals committed before it: none would have fitted
    # beside what it saw (it names what was in use)
    for exc in refused:
        in_use = int(exc.message.split(": ")[1].split(" in use")[0])
        asked = int(exc.message.rsplit(" ", 1)[1])
        assert in_use + asked > 7


def test_parallel_creates_never_exceed_the_rentals_per_minute_limit(customer):
    # Given an account limited to 7 rentals created per minute
    account = account_for_customer(user=customer)
    account_budgets_set(account_id=account.pk, actor=customer, max_rentals_per_minute=7)

    # When 20 creates race each other
    created, refused = _create_in_parallel(customer)

    # Then exactly 7 are created and 13 are refused as 429 naming the limit, with a retry time
    assert len(created) == 7
    assert len(refused) == CREATES - 7
    assert all(isinstance(exc, RateLimited) for exc in refused)
    assert {exc.field for exc in refused} == {"max_rentals_per_minute"}
    assert {exc.status for exc in refused} == {429}
    assert all(1 <= exc.retry_after_s <= 60 for exc in refused)
    assert Rental.objects.filter(customer=customer).count() == 7


def test_parallel_creates_never_pass_the_monthly_budget(customer):
    # Given a monthly budget of $2.00 and rentals that each hold $0.50 (1 GPU-hour at $0.50)
    account = account_for_customer(user=customer)
    account_budgets_set(account_id=account.pk, actor=customer, monthly_budget=Decimal("2.00"))

    # When 20 creates race each other
    created, refused = _create_in_parallel(customer)

    # Then 4 are created, holding exactly the budget, and 16 are refused naming it
    assert len(created) == 4
    assert all(type(exc) is BudgetExceeded and exc.field == "monthly_budget" for exc in refused)
    holds = FundsHold.objects.filter(account=account).aggregate(s=Sum("amount_micros"))["s"]
    assert holds == usd("2.00")


def test_one_accounts_limit_leaves_another_account_alone(customer, fund):
    # Given one account at its GPU limit
    account = account_for_customer(user=customer)
    account_ceilings_set(account_id=account.pk, max_concurrent_gpus=2, max_rentals_per_minute=None)
    other = UserFactory()
    fund(other, "100.00")
    created, _ = _create_in_parallel(customer)
    assert len(created) == 2
    # When another customer rents 20 GPUs at once, then it is not refused
    created, refused = _create_in_parallel(other)
    assert (len(created), refused) == (20, [])
