"""Monthly statements: what each customer was charged per rental, and the money moved."""

from __future__ import annotations

from django.db import models
from django.db.models import Q


class Invoice(models.Model):
    """A customer's statement for one calendar month (UTC), issued once the month is over."""

    account = models.ForeignKey(
        "billing.Account", on_delete=models.PROTECT, related_name="invoices"
    )
    number = models.CharField(max_length=40, unique=True)
    period_start = models.DateField()
    period_end = models.DateField(help_text="exclusive: the first day of the next month")
    currency = models.CharField(max_length=3)
    opening_balance_micros = models.BigIntegerField()
    usage_micros = models.BigIntegerField(help_text="usage charged in the period (positive)")
    payments_micros = models.BigIntegerField(help_text="top-ups, refunds and ops adjustments")
    closing_balance_micros = models.BigIntegerField()
    issued_at = models.DateTimeField()

    class Meta:
        ordering = ["-period_start", "-id"]
        constraints = [
            models.UniqueConstraint(
                fields=["account", "period_start"], name="invoice_one_per_month"
            ),
            models.CheckConstraint(
                condition=Q(period_end__gt=models.F("period_start")), name="invoice_period"
            ),
        ]

    def __str__(self) -> str:
        return self.number


class InvoiceLine(models.Model):
    """One rental's usage in the period: GPUs, model, seconds, locked rate, amount."""

    invoice = models.ForeignKey(Invoice, on_delete=models.CASCADE, related_name="lines")
    rental = models.ForeignKey(
        "marketplace.Rental", on_delete=models.PROTECT, related_name="invoice_lines"
    )
    description = models.CharField(max_length=200)
    gpu_model = models.CharField(max_length=200)
    gpus = models.PositiveIntegerField()
    gpu_seconds = models.BigIntegerField()
    rate_per_gpu_hour = models.DecimalField(max_digits=10, decimal_places=4)
    amount_micros = models.BigIntegerField()

    class Meta:
        ordering = ["invoice_id", "id"]
        constraints = [
            models.UniqueConstraint(fields=["invoice", "rental"], name="invoice_line_per_rental")
        ]

    def __str__(self) -> str:
        return f"{self.invoice_id}: {self.rental_id}"
