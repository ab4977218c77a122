"""Funds holds: a rental's booked cost is held from its creation, shrinks as it is charged,
follows the price locked at placement, and is released when the rental ends."""

from __future__ import annotations

from decimal import Decimal

import pytest
from django.db import transaction

from billing.models import FundsHold, LedgerEntry, Refund
from billing.selectors import account_summary
from billing.services import billing_pass_run, refund_create
from core.errors import Conflict, PaymentRequired
from marketplace.lifecycle import rental_cancel, rental_transition
from marketplace.models import Rental, RentalEvent, RentalStatus
from tests.billing.conftest import usd
from tests.factories import personal_team

pytestmark = pytest.mark.django_db


def test_a_pending_rental_holds_its_booked_time_at_its_price_cap(make_node, rent, fund, user):
    # Given $20 and a node at $0.80
    make_node(price="0.80")
    fund(user, "20.00")
    # When 2 GPUs are asked for 3 hours capped at $1.00 per GPU-hour
    rental = rent(2, duration_s=3 * 3600, max_price_per_gpu_hour="1.00")
    # Then $6.00 is held while it waits, and only $14.00 is left for anything else
    hold = FundsHold.objects.get(rental=rental)
    assert (hold.amount_micros, hold.price_per_gpu_hour) == (usd("6.00"), Decimal("1.0000"))
    summary = account_summary(team=personal_team(user))
    assert (summary.held_micros, summary.available_micros) == (usd("6.00"), usd("14.00"))
    # Two more fit ($2.00 left); a fourth is refused, naming the hold and what is available
    rent(2, duration_s=3 * 3600, max_price_per_gpu_hour="1.00")
    rent(2, duration_s=3 * 3600, max_price_per_gpu_hour="1.00")
    with pytest.raises(PaymentRequired, match=r"holds \$6.00 .* available balance is \$2.00"):
        rent(2, duration_s=3 * 3600, max_price_per_gpu_hour="1.00")
    assert Rental.objects.count() == FundsHold.objects.count() == 3
    # When one is cancelled its hold is released at once
    rental_cancel(team=personal_team(user), actor=user, rental_id=rental.pk)
    assert account_summary(team=personal_team(user)).available_micros == usd("8.00")


def test_without_a_cap_the_cheapest_node_that_fits_is_held(make_node, rent, fund, user):
    make_node(price="1.50")
    make_node(price="0.75")
    fund(user, "10.00")
    rental = rent(4, duration_s=2 * 3600)
    assert FundsHold.objects.get(rental=rental).amount_micros == usd("6.00")


def test_the_hold_follows_the_locked_price_shrinks_with_charges_and_ends_with_the_rental(
    make_node, book, user
):
    # Given a 1-GPU 2-hour rental placed and running at $3.60 ($0.001 per GPU-second)
    make_node(price="3.60")
    booked = book(gpus=1, hours=2, hours_ago=1)
    balance = account_summary(team=personal_team(user)).balance_micros
    assert account_summary(team=personal_team(user)).held_micros == usd("7.20")
    # When 600 s are confirmed and rated (not yet posted) and then posted
    booked.report(seq=1, confirmed_s=600)
    billing_pass_run(now=booked.at(3600))
    # Then the hold is what is left of the booking: available moves only by the hold
    summary = account_summary(team=personal_team(user))
    assert summary.held_micros == usd("7.20") - 600_000
    assert summary.available_micros == balance - usd("7.20")
    # When the rental completes, nothing is held and only the charge is gone
    with transaction.atomic():
        rental = Rental.objects.select_for_update().get(pk=booked.rental.pk)
        rental_transition(
            rental=rental, to_status=RentalStatus.COMPLETED, actor_kind=RentalEvent.Actor.AGENT
        )
    summary = account_summary(team=personal_team(user))
    assert summary.held_micros == 0
    assert summary.available_micros == balance - 600_000


def test_held_money_cannot_be_refunded(make_node, rent, fund, user):
    make_node(price="1.00")
    account = fund(user, "10.00")
    rent(1, duration_s=4 * 3600)
    before = (LedgerEntry.objects.count(), account.balance_micros)
    with pytest.raises(Conflict, match=r"only \$6.00 is available"):
        refund_create(account_id=account.pk, amount_micros=usd("6.01"), reason="x", actor=None)
    account.refresh_from_db()
    assert (LedgerEntry.objects.count(), account.balance_micros) == before
    assert not Refund.objects.exists()
