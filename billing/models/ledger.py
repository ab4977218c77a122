"""The append-only ledger: every movement of money is a row; nothing is ever updated."""

from __future__ import annotations

from django.conf import settings
from django.db import models
from django.db.models import Q


class EntryKind(models.TextChoices):
    USAGE = "usage", "Usage charge"
    EARNING = "earning", "Provider earning"
    PLATFORM_FEE = "platform_fee", "Platform fee"
    TOPUP = "topup", "Card top-up"
    REFUND = "refund", "Refund"
    REFUND_REVERSAL = "refund_reversal", "Failed refund returned"
    ADJUSTMENT = "adjustment", "Ops credit or debit"
    PAYOUT = "payout", "Provider payout"
    PAYOUT_REVERSAL = "payout_reversal", "Failed or reversed payout returned"
    FAULT_CREDIT = "fault_credit", "Credit for GPU time a node fault lost"


# Postings made by the billing pass: keyed by (meter, posting_seq, kind).
RATING_KINDS = (EntryKind.USAGE, EntryKind.EARNING, EntryKind.PLATFORM_FEE, EntryKind.FAULT_CREDIT)


class LedgerEntry(models.Model):
    """One signed amount on one account (micro-dollars); a database trigger refuses updates and
    deletes, and a natural unique key makes every replayed posting a no-op."""

    # Foreign keys without their own index where a composite index below leads with them:
    # the billing pass appends a few hundred thousand rows at a time. No database foreign key
    # either: its per-row check cost more than the rows themselves (bench/metering.py, 300,000
    # entries: 5.8 s for the account's, 0.8 s for the actor's, always NULL there). Accounts are
    # never deleted (PROTECT, and the ledger is append-only); every writer takes the account
    # from its row, and the pass refuses a chunk whose entries name an account whose balance
    # it could not move.
    account = models.ForeignKey(
        "billing.Account",
        on_delete=models.PROTECT,
        related_name="entries",
        db_index=False,
        db_constraint=False,
    )
    kind = models.CharField(max_length=16, choices=EntryKind.choices)
    amount_micros = models.BigIntegerField()
    # Rating postings: the meter, its posting sequence, and the GPU-seconds the posting covers.
    # No database foreign key on these two: the pass writes them from the meter row it has
    # just read, meters and rentals are never deleted, and a per-row check on a few hundred
    # thousand rows per posting pass would cost more than the rest of the pass.
    rental = models.ForeignKey(
        "marketplace.Rental",
        null=True,
        blank=True,
        on_delete=models.DO_NOTHING,
        related_name="ledger_entries",
        db_index=False,
        db_constraint=False,
    )
    meter = models.ForeignKey(
        "billing.UsageMeter",
        null=True,
        blank=True,
        on_delete=models.DO_NOTHING,
        related_name="entries",
        db_index=False,
        db_constraint=False,
    )
    posting_seq = models.PositiveIntegerField(null=True, blank=True)
    gpu_seconds = models.BigIntegerField(null=True, blank=True)
    # Every other posting: an idempotency key such as "topup:pi_..." or "adjust:<uuid>".
    # NULL, not "", for rating postings: the unique key applies only to keyed postings.
    key = models.CharField(max_length=120, null=True, blank=True)  # noqa: DJ001
    memo = models.CharField(max_length=500, blank=True)
    actor = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="+",
        db_index=False,
        db_constraint=False,
    )
    created_at = models.DateTimeField()

    class Meta:
        ordering = ["-created_at", "-id"]
        verbose_name_plural = "ledger entries"
        constraints = [
            models.CheckConstraint(condition=~Q(amount_micros=0), name="entry_amount_nonzero"),
            models.CheckConstraint(
                condition=Q(meter__isnull=True, posting_seq__isnull=True, key__isnull=False)
                | Q(meter__isnull=False, posting_seq__isnull=False, key__isnull=True),
                name="entry_has_one_natural_key",
            ),
            models.CheckConstraint(
                condition=Q(kind__in=RATING_KINDS, meter__isnull=False)
                | (~Q(kind__in=RATING_KINDS) & Q(meter__isnull=True)),
                name="entry_rating_kinds_have_meter",
            ),
            models.CheckConstraint(
                condition=~Q(kind__in=["topup", "refund_reversal", "payout_reversal"])
                | Q(amount_micros__gt=0),
                name="entry_credits_positive",
            ),
            models.CheckConstraint(
                condition=~Q(kind__in=["refund", "payout"]) | Q(amount_micros__lt=0),
                name="entry_debits_negative",
            ),
            models.UniqueConstraint(
                fields=["meter", "posting_seq", "kind"],
                condition=Q(meter__isnull=False),
                name="entry_unique_rating_posting",
            ),
            models.UniqueConstraint(
                fields=["key"], condition=Q(key__isnull=False), name="entry_unique_key"
            ),
        ]
        indexes = [
            models.Index(fields=["account", "created_at"], name="entry_by_account"),
            models.Index(fields=["actor"], condition=Q(actor__isnull=False), name="entry_by_actor"),
        ]

    def __str__(self) -> str:
        return f"{self.kind} {self.amount_micros} on {self.account_id}"
