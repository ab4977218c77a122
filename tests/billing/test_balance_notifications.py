"""Billing's low-balance notices are told through notifications, in the pass's transaction."""

from __future__ import annotations

import pytest

from billing.models import BalanceNotice, NoticeKind
from billing.services import account_adjust, account_for_team, billing_pass_run
from notifications.models import Delivery, Notification
from notifications.services import notification_settings_update
from tests.billing.conftest import usd
from tests.factories import personal_team

pytestmark = pytest.mark.django_db


def test_a_low_balance_and_then_an_exhausted_one_are_each_told_once(make_node, book, fund, user):
    # Given an 8 h rental at $1.00/h booked with $8, then $3 taken back (as in the rating test)
    make_node(price="1.00")
    fund(user, "8.00")
    booked = book(gpus=1, hours=8, hours_ago=7)
    account_adjust(
        account_id=account_for_team(team=personal_team(user)).pk,
        amount_micros=-usd("3.00"),
        reason="chargeback",
        actor=None,
    )
    # When usage leaves less than an hour, and the pass runs twice
    booked.report(seq=2, confirmed_s=int(4.2 * 3600))
    billing_pass_run()
    billing_pass_run()
    # Then one balance.low notification, for the notice, with an email to the customer
    low = Notification.objects.get(kind="balance.low")
    notice = BalanceNotice.objects.get(kind=NoticeKind.LOW_BALANCE)
    assert low.source_key == f"balance-notice:{notice.pk}"
    assert (low.team, low.payload["balance"]["detail"]) == (personal_team(user), notice.detail)
    assert low.payload["balance"]["available_micros"] == notice.available_micros
    assert list(low.deliveries.values_list("channel", "recipient")) == [("email", user.email)]
    # When usage exceeds the balance: the depleted notice is told too, once
    booked.report(seq=3, confirmed_s=int(5.5 * 3600))
    billing_pass_run()
    billing_pass_run()
    assert Notification.objects.filter(kind="balance.low").count() == 2
    depleted = BalanceNotice.objects.get(kind=NoticeKind.DEPLETED)
    assert Notification.objects.filter(source_key=f"balance-notice:{depleted.pk}").exists()


def test_a_customer_who_switched_balance_low_off_is_not_told(make_node, book, fund, user):
    # Given balance.low switched off for email (the only channel)
    notification_settings_update(team=personal_team(user), email_kinds=["rental.failed"])
    make_node(price="1.00")
    fund(user, "8.00")
    booked = book(gpus=1, hours=8, hours_ago=7)
    account_adjust(
        account_id=account_for_team(team=personal_team(user)).pk,
        amount_micros=-usd("3.00"),
        reason="chargeback",
        actor=None,
    )
    # When the balance runs low
    booked.report(seq=2, confirmed_s=int(4.2 * 3600))
    billing_pass_run()
    # Then billing recorded its notice, and nothing is told
    assert BalanceNotice.objects.filter(kind=NoticeKind.LOW_BALANCE).count() == 1
    assert not Notification.objects.filter(kind="balance.low").exists()
    assert not Delivery.objects.exists()
