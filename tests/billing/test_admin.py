"""The ops console for money: read-only ledger, forms that require a reason and call services."""

from __future__ import annotations

import uuid

import pytest
from django.contrib.admin.models import LogEntry
from django.contrib.auth.models import Permission
from django.test import Client
from django.urls import reverse

from billing.models import Account, EntryKind, LedgerEntry, MoneyOutStatus, Payout, Refund
from billing.services import (
    account_adjust,
    account_for_provider,
    account_for_team,
    payout_create,
)
from tests.factories import UserFactory, personal_team

pytestmark = pytest.mark.django_db


@pytest.fixture
def ops():
    ops = UserFactory(is_staff=True, is_superuser=True)
    client = Client()
    client.force_login(ops)
    return client, ops


def test_a_credit_needs_a_reason_and_a_resubmitted_form_posts_once(ops, user):
    client, staff = ops
    account = account_for_team(team=personal_team(user))
    url = reverse("admin:billing_account_adjust", args=[account.pk])
    assert client.get(url).status_code == 200
    key = str(uuid.uuid4())
    r = client.post(url, {"amount": "25.50", "reason": "", "key": key})
    assert r.status_code == 200 and b"This field is required" in r.content
    assert not LedgerEntry.objects.exists()
    for _ in range(2):
        r = client.post(url, {"amount": "25.50", "reason": "outage goodwill", "key": key})
        assert r.status_code == 302
    entry = LedgerEntry.objects.get()
    assert (entry.kind, entry.amount_micros, entry.memo, entry.actor) == (
        EntryKind.ADJUSTMENT,
        25_500_000,
        "outage goodwill",
        staff,
    )
    account.refresh_from_db()
    assert account.balance_micros == 25_500_000


def test_the_ledger_is_read_only_in_the_admin(ops, user):
    client, _ = ops
    account = account_for_team(team=personal_team(user))
    account_adjust(account_id=account.pk, amount_micros=1, reason="x", actor=None)
    entry = LedgerEntry.objects.get()
    assert client.get(reverse("admin:billing_ledgerentry_changelist")).status_code == 200
    change = reverse("admin:billing_ledgerentry_change", args=[entry.pk])
    r = client.get(change)
    assert r.status_code == 200 and b'name="memo"' not in r.content
    assert client.post(change, {"memo": "rewritten"}).status_code == 403
    assert client.get(reverse("admin:billing_ledgerentry_add")).status_code == 403
    delete = reverse("admin:billing_ledgerentry_delete", args=[entry.pk])
    assert client.post(delete, {"post": "yes"}).status_code == 403
    entry.refresh_from_db()
    assert entry.memo == "x"


def test_an_out_of_band_refund_from_the_admin_requires_a_reason(ops, user):
    client, staff = ops
    account = account_for_team(team=personal_team(user))
    account_adjust(account_id=account.pk, amount_micros=10_000_000, reason="x", actor=None)
    url = reverse("admin:billing_account_refund", args=[account.pk])
    r = client.post(url, {"amount": "4.00", "reason": "  ", "key": str(uuid.uuid4())})
    assert r.status_code == 200
    assert not Refund.objects.exists()
    r = client.post(url, {"amount": "40.00", "reason": "closing", "key": str(uuid.uuid4())})
    assert b"only $10.00 is available" in r.content
    r = client.post(url, {"amount": "4.00", "reason": "closing", "key": str(uuid.uuid4())})
    assert r.status_code == 302
    refund = Refund.objects.get()
    assert (refund.amount_micros, refund.status, refund.actor) == (
        4_000_000,
        MoneyOutStatus.SUCCEEDED,
        staff,
    )
    account.refresh_from_db()
    assert account.balance_micros == 6_000_000


def test_a_provider_is_paid_out_and_ops_mark_the_bank_transfer_done(ops, provider):
    client, staff = ops
    account = account_for_provider(provider=provider)
    account_adjust(account_id=account.pk, amount_micros=7_654_321, reason="earned", actor=None)
    r = client.post(
        reverse("admin:billing_account_payout", args=[account.pk]),
        {"amount": "", "reason": "monthly", "key": str(uuid.uuid4())},
    )
    assert r.status_code == 302
    payout = Payout.objects.get()
    assert (payout.amount_micros, payout.status) == (7_650_000, MoneyOutStatus.PENDING)
    r = client.post(
        reverse("admin:billing_payout_changelist"),
        {"action": "payouts_mark_paid", "_selected_action": [payout.pk]},
        follow=True,
    )
    assert r.status_code == 200
    payout.refresh_from_db()
    assert (payout.status, payout.actor) == (MoneyOutStatus.SUCCEEDED, staff)
    account.refresh_from_db()
    assert account.balance_micros == 4321


def test_account_pages_render(ops, user, provider):
    client, _ = ops
    customer = account_for_team(team=personal_team(user))
    supplier = account_for_provider(provider=provider)
    for account in (customer, supplier):
        r = client.get(reverse("admin:billing_account_change", args=[account.pk]))
        assert r.status_code == 200
    assert client.get(reverse("admin:billing_account_changelist")).status_code == 200
    assert client.get(reverse("admin:billing_payout_changelist")).status_code == 200
    assert client.get(reverse("admin:billing_invoice_changelist")).status_code == 200


def _staff(*codenames: str):
    """A staff user (not superuser) that may view billing rows and edit accounts (the form),
    and holds only the money permissions in `codenames`."""
    staff = UserFactory(is_staff=True)
    views = ["view_account", "change_account", "view_payout", "view_ledgerentry"]
    staff.user_permissions.set(
        Permission.objects.filter(
            content_type__app_label="billing", codename__in=[*views, *codenames]
        )
    )
    client = Client()
    client.force_login(staff)
    return client, staff


def _money_state() -> tuple:
    return (
        list(
            Account.objects.order_by("pk").values_list(
                "pk", "balance_micros", "stripe_connect_account_id"
            )
        ),
        LedgerEntry.objects.count(),
        Refund.objects.count(),
        list(Payout.objects.order_by("pk").values_list("pk", "status", "actor_id")),
    )


def test_staff_without_the_money_permissions_are_refused_and_nothing_moves(user, provider):
    # Given a funded customer, a provider with earnings and a pending manual payout
    customer = account_for_team(team=personal_team(user))
    supplier = account_for_provider(provider=provider)
    account_adjust(account_id=customer.pk, amount_micros=10_000_000, reason="x", actor=None)
    account_adjust(account_id=supplier.pk, amount_micros=9_000_000, reason="x", actor=None)
    payout = payout_create(
        account_id=supplier.pk, actor=None, reason="monthly", amount_micros=1_000_000
    )
    # And a staff user who may look at billing but holds none of the money permissions
    client, _ = _staff()
    before = _money_state()
    assert (
        client.get(reverse("admin:billing_account_change", args=[customer.pk])).status_code == 200
    )
    # When they try every money action
    key = str(uuid.uuid4())
    answers = [
        client.get(reverse("admin:billing_account_adjust", args=[customer.pk])).status_code,
        client.post(
            reverse("admin:billing_account_adjust", args=[customer.pk]),
            {"amount": "500", "reason": "because", "key": key},
        ).status_code,
        client.post(
            reverse("admin:billing_account_refund", args=[customer.pk]),
            {"amount": "5.00", "reason": "because", "key": key},
        ).status_code,
        client.post(
            reverse("admin:billing_account_payout", args=[supplier.pk]),
            {"amount": "", "reason": "because", "key": key},
        ).status_code,
    ]
    client.post(
        reverse("admin:billing_payout_changelist"),
        {"action": "payouts_mark_paid", "_selected_action": [payout.pk]},
    )
    client.post(
        reverse("admin:billing_account_change", args=[supplier.pk]),
        {"stripe_connect_account_id": "acct_someone_else"},
    )
    # Then each is a 403 and no balance, ledger row, refund, payout or destination changed
    assert answers == [403, 403, 403, 403]
    assert _money_state() == before


@pytest.mark.parametrize(
    ("perm", "url", "form", "check"),
    [
        ("adjust_account", "admin:billing_account_adjust", {"amount": "2.50"}, "adjust"),
        ("issue_refund", "admin:billing_account_refund", {"amount": "2.50"}, "refund"),
    ],
)
def test_a_money_action_with_its_permission_is_audited_with_actor_and_reason(
    user, perm, url, form, check
):
    customer = account_for_team(team=personal_team(user))
    account_adjust(account_id=customer.pk, amount_micros=10_000_000, reason="x", actor=None)
    client, staff = _staff(perm)
    # A missing reason is refused with nothing written
    r = client.post(
        reverse(url, args=[customer.pk]), {**form, "reason": "", "key": str(uuid.uuid4())}
    )
    assert r.status_code == 200
    assert LedgerEntry.objects.count() == 1
    r = client.post(
        reverse(url, args=[customer.pk]),
        {**form, "reason": "ticket 42", "key": str(uuid.uuid4())},
    )
    assert r.status_code == 302
    entry = LedgerEntry.objects.order_by("-id").first()
    assert (entry.actor, entry.memo, abs(entry.amount_micros)) == (staff, "ticket 42", 2_500_000)
    if check == "refund":
        assert Refund.objects.get().actor == staff
    log = LogEntry.objects.get(user=staff)
    assert log.object_id == str(customer.pk) and "ticket 42" in log.get_change_message()


def test_a_payout_with_its_permission_needs_a_reason_and_is_audited(provider):
    account = account_for_provider(provider=provider)
    account_adjust(account_id=account.pk, amount_micros=3_000_000, reason="earned", actor=None)
    client, staff = _staff("create_payout")
    url = reverse("admin:billing_account_payout", args=[account.pk])
    r = client.post(url, {"amount": "", "reason": " ", "key": str(uuid.uuid4())})
    assert r.status_code == 200 and not Payout.objects.exists()
    r = client.post(url, {"amount": "", "reason": "march earnings", "key": str(uuid.uuid4())})
    assert r.status_code == 302
    payout = Payout.objects.get()
    entry = LedgerEntry.objects.get(kind=EntryKind.PAYOUT)
    assert (payout.actor, payout.reason) == (staff, "march earnings")
    assert (entry.actor, entry.memo) == (staff, "march earnings")
    client.post(
        reverse("admin:billing_payout_changelist"),
        {"action": "payouts_mark_paid", "_selected_action": [payout.pk]},
    )
    payout.refresh_from_db()
    assert payout.status == MoneyOutStatus.SUCCEEDED
    assert LogEntry.objects.filter(user=staff).count() == 2
