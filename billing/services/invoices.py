"""Monthly statements, issued from the ledger once a month is over.

A statement shows what was posted in the month (UTC): usage per rental, the money that came in
or went back, and the balance before and after, so opening + movements = closing holds by
construction. Usage is posted hourly and at every month boundary, so at most the last pass's
seconds of a month land on the next statement.
"""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta

from django.contrib.postgres.aggregates import StringAgg
from django.db import transaction
from django.db.models import F, OuterRef, Q, QuerySet, Subquery, Sum
from django.db.models.functions import Coalesce
from django.utils import timezone

from billing import conf
from billing.models import (
    Account,
    AccountKind,
    EntryKind,
    Invoice,
    InvoiceLine,
    LedgerEntry,
    UsageMeter,
)
from core.errors import ValidationFailed


def invoice_lines(*, account_id: int, begin: datetime, end: datetime) -> QuerySet:
    """The account's usage posted in [begin, end) per rental, oldest rental first: the amount,
    GPU-seconds, the rental's name, GPUs and rate, and the GPU models it ran on."""
    gpu_models = (
        UsageMeter.objects.filter(rental_id=OuterRef("rental_id"))
        .values("rental_id")
        .annotate(
            names=StringAgg(
                "node__gpu_model__name", ", ", distinct=True, order_by="node__gpu_model__name"
            )
        )
        .values("names")
    )
    return (
        LedgerEntry.objects.filter(
            account_id=account_id,
            kind=EntryKind.USAGE,
            created_at__gte=begin,
            created_at__lt=end,
        )
        .values(
            "rental_id",
            "rental__name",
            "rental__price_per_gpu_hour",
            "rental__created_at",
            gpus=F("rental__gpus_per_node") * F("rental__node_count"),
        )
        .annotate(
            amount=-Sum("amount_micros"),
            seconds=Coalesce(Sum("gpu_seconds"), 0),
            gpu_models=Subquery(gpu_models),
        )
        .order_by("rental__created_at", "rental_id")
    )


def month_start(day: date) -> date:
    return day.replace(day=1)


def month_after(day: date) -> date:
    return date(day.year + day.month // 12, day.month % 12 + 1, 1)


def _at(day: date) -> datetime:
    return datetime(day.year, day.month, day.day, tzinfo=UTC)


def invoice_issue(*, account_id: int, period_start: date) -> Invoice:
    """Issue (or return the already issued) statement of one customer for one month."""
    period_start = month_start(period_start)
    period_end = month_after(period_start)
    begin, end = _at(period_start), _at(period_end)
    if end > timezone.now():
        raise ValidationFailed("a month is invoiced once it is over", field="period_start")
    with transaction.atomic():
        account = Account.objects.select_for_update().get(pk=account_id)
        existing = Invoice.objects.filter(account=account, period_start=period_start).first()
        if existing is not None:
            return existing
        entries = LedgerEntry.objects.filter(account=account)
        opening = entries.filter(created_at__lt=begin).aggregate(s=Sum("amount_micros"))["s"] or 0
        in_period = entries.filter(created_at__gte=begin, created_at__lt=end).aggregate(
            usage=Sum("amount_micros", filter=Q(kind=EntryKind.USAGE)),
            other=Sum("amount_micros", filter=~Q(kind=EntryKind.USAGE)),
        )
        usage = -(in_period["usage"] or 0)
        payments = in_period["other"] or 0
        invoice = Invoice.objects.create(
            account=account,
            number=f"GM-{period_start:%Y%m}-{account.pk:06d}",
            period_start=period_start,
            period_end=period_end,
            currency=conf.currency(),
            opening_balance_micros=opening,
            usage_micros=usage,
            payments_micros=payments,
            closing_balance_micros=opening - usage + payments,
            issued_at=timezone.now(),
        )
        InvoiceLine.objects.bulk_create(
            InvoiceLine(
                invoice=invoice,
                rental_id=line["rental_id"],
                description=line["rental__name"] or f"rental {str(line['rental_id'])[:8]}",
                gpu_model=line["gpu_models"] or "",
                gpus=line["gpus"],
                gpu_seconds=line["seconds"],
                rate_per_gpu_hour=line["rental__price_per_gpu_hour"],
                amount_micros=line["amount"],
            )
            for line in invoice_lines(account_id=account.pk, begin=begin, end=end)
        )
    return invoice


def invoices_issue_due(*, today: date | None = None) -> int:
    """Issue last month's statements for every customer with ledger entries in it."""
    today = today or timezone.now().date()
    period_start = month_start(month_start(today) - timedelta(days=1))
    begin, end = _at(period_start), _at(month_after(period_start))
    account_ids = (
        LedgerEntry.objects.filter(
            account__kind=AccountKind.CUSTOMER, created_at__gte=begin, created_at__lt=end
        )
        .exclude(account__invoices__period_start=period_start)
        .values_list("account_id", flat=True)
        .distinct()
    )
    issued = 0
    for account_id in list(account_ids):
        invoice_issue(account_id=account_id, period_start=period_start)
        issued += 1
    return issued
