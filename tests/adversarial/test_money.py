"""Money under adversarial use: concurrent creates against one balance, on real PostgreSQL."""

from __future__ import annotations

import threading
from decimal import Decimal

import pytest
from django.db import connection

from accounts.services import invitation_accept, invitation_create, team_create
from billing.models import FundsHold
from billing.services import account_adjust, account_for_team
from core.errors import PaymentRequired
from marketplace.models import Rental
from marketplace.services.rentals import RentalRequest, RuntimeSpec, rental_create
from tests.factories import UserFactory, personal_team

pytestmark = pytest.mark.django_db(transaction=True)

CREATES = 20
# 1 GPU for 10 hours capped at $0.50 per GPU-hour: a hold of $5.00 per rental.
HOLD_MICROS = 5_000_000


@pytest.fixture(autouse=True)
def _funds_check_on(settings):
    settings.BILLING_FUNDS_CHECK = True


def _create_in_parallel(
    customer, *, team=None, also=None
) -> tuple[list[Rental], list[PaymentRequired]]:
    """CREATES threads, each on its own connection, released at once by a barrier; with `also`,
    every other create is that person's (two members of `team` racing each other)."""
    barrier = threading.Barrier(CREATES)
    created: list[Rental] = []
    refused: list[PaymentRequired] = []
    errors: list[BaseException] = []

    def run(who):
        try:
            barrier.wait(timeout=30)
            created.append(
                rental_create(
                    customer=who,
                    team=team or personal_team(who),
                    request=RentalRequest(
                        gpus_per_node=1,
                        duration_s=10 * 3600,
                        max_price_per_gpu_hour=Decimal("0.50"),
                        runtime=RuntimeSpec(image="gpumarket/harness:dev"),
                    ),
                )
            )
        except PaymentRequired as exc:
            refused.append(exc)
        except BaseException as exc:  # reported below
            errors.append(exc)
        finally:
            connection.close()

    people = [customer, also or customer]
    threads = [threading.Thread(target=run, args=(people[i % 2],)) for i in range(CREATES)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert errors == []
    return created, refused


@pytest.mark.parametrize(("credit", "affordable"), [("1.00", 0), ("16.00", 3)])
def test_parallel_creates_never_hold_more_than_the_balance(make_node, user, credit, affordable):
    # Given a customer with `credit` and nodes with plenty of free GPUs at $0.50
    for _ in range(3):
        make_node(gpus=8, price="0.50")
    account = account_for_team(team=personal_team(user))
    account_adjust(
        account_id=account.pk,
        amount_micros=int(Decimal(credit) * 1_000_000),
        reason="test credit",
        actor=None,
    )

    # When 20 creates of a $5.00 rental race each other
    created, refused = _create_in_parallel(user)

    # Then exactly the affordable number is accepted, every other one is a 402 naming the hold,
    # and the holds together never exceed the balance
    assert len(created) == affordable
    assert len(refused) == CREATES - affordable
    assert all("$5.00" in exc.message for exc in refused)
    assert Rental.objects.count() == affordable
    holds = list(FundsHold.objects.values_list("amount_micros", flat=True))
    assert holds == [HOLD_MICROS] * affordable
    account.refresh_from_db()
    assert sum(holds) <= account.balance_micros


def test_two_members_creating_in_parallel_never_hold_more_than_the_team_balance(make_node, user):
    # Given a team with $16.00 (three $5.00 holds) and two members, each with a personal
    # balance of their own that must not be touched
    for _ in range(3):
        make_node(gpus=8, price="0.50")
    team = team_create(owner=user, name="shared")
    colleague = UserFactory(email="colleague@example.invalid")
    sent = invitation_create(
        team=team, actor=user, email=colleague.email, base_url="http://testserver"
    )
    invitation_accept(user=colleague, team_id=team.pk, raw=sent.link.rstrip("/").rsplit("/", 1)[1])
    account = account_for_team(team=team)
    account_adjust(account_id=account.pk, amount_micros=16_000_000, reason="t", actor=None)
    for person in (user, colleague):
        own = account_for_team(team=personal_team(person))
        account_adjust(account_id=own.pk, amount_micros=100_000_000, reason="t", actor=None)

    # When both members race 20 creates for the team, ten each
    created, refused = _create_in_parallel(user, team=team, also=colleague)

    # Then exactly three are accepted, all held on the team's account, and the personal
    # balances back nothing
    assert len(created) == 3 and len(refused) == CREATES - 3
    assert all("$5.00" in exc.message for exc in refused)
    assert set(Rental.objects.values_list("team_id", flat=True)) == {team.pk}
    holds = list(FundsHold.objects.values_list("account_id", "amount_micros"))
    assert holds == [(account.pk, HOLD_MICROS)] * 3
    account.refresh_from_db()
    assert sum(amount for _, amount in holds) <= account.balance_micros
