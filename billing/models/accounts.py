"""Accounts: one per customer team, per provider and one for the platform, with a cached
balance."""

from __future__ import annotations

from django.db import models
from django.db.models import Q


class AccountKind(models.TextChoices):
    CUSTOMER = "customer", "Customer"
    PROVIDER = "provider", "Provider"
    PLATFORM = "platform", "Platform"


class Account(models.Model):
    """Who money belongs to; balance_micros is the sum of its ledger entries, kept in step by
    every posting in the same transaction so reads never sum the ledger."""

    kind = models.CharField(max_length=10, choices=AccountKind.choices)
    # A customer account belongs to a team: its members' rentals are held and charged here.
    team = models.ForeignKey(
        "accounts.Team",
        null=True,
        blank=True,
        on_delete=models.PROTECT,
        related_name="billing_accounts",
    )
    provider = models.ForeignKey(
        "marketplace.Provider",
        null=True,
        blank=True,
        on_delete=models.PROTECT,
        related_name="billing_accounts",
    )
    balance_micros = models.BigIntegerField(default=0)
    low_balance_since = models.DateTimeField(null=True, blank=True)
    depleted_since = models.DateTimeField(null=True, blank=True)
    stripe_customer_id = models.CharField(max_length=255, blank=True)
    stripe_connect_account_id = models.CharField(
        max_length=255, blank=True, help_text="Connect account that receives provider payouts"
    )
    created_at = models.DateTimeField(auto_now_add=True)

    # Budgets, set by the customer (billing.services.budgets): a monthly cap on usage charges
    # and the share of it at which running rentals are warned about.
    monthly_budget_micros = models.BigIntegerField(
        null=True, blank=True, help_text="cap on the month's usage charges; empty: none"
    )
    budget_warn_percent = models.PositiveSmallIntegerField(
        default=80,
        db_default=80,
        help_text="warn when the month's charges reach this share of the budget",
    )
    budget_warned_at = models.DateTimeField(null=True, blank=True)
    budget_reached_at = models.DateTimeField(null=True, blank=True)
    # Limits: the customer's own (at most the ceiling) and the ceiling ops set per account;
    # empty ceilings fall back to the BILLING_MAX_* settings.
    max_concurrent_gpus = models.PositiveIntegerField(null=True, blank=True)
    max_rentals_per_minute = models.PositiveIntegerField(null=True, blank=True)
    ops_max_concurrent_gpus = models.PositiveIntegerField(
        null=True, blank=True, help_text="ceiling on pending + placed + running GPUs"
    )
    ops_max_rentals_per_minute = models.PositiveIntegerField(
        null=True, blank=True, help_text="ceiling on rentals created per minute"
    )

    class Meta:
        ordering = ["id"]
        constraints = [
            models.CheckConstraint(
                condition=Q(monthly_budget_micros__isnull=True) | Q(monthly_budget_micros__gt=0),
                name="account_budget_positive",
            ),
            models.CheckConstraint(
                condition=Q(budget_warn_percent__gte=1, budget_warn_percent__lte=100),
                name="account_budget_warn_percent",
            ),
            models.CheckConstraint(
                condition=(Q(max_concurrent_gpus__isnull=True) | Q(max_concurrent_gpus__gte=1))
                & (Q(max_rentals_per_minute__isnull=True) | Q(max_rentals_per_minute__gte=1)),
                name="account_limits_positive",
            ),
            models.CheckConstraint(
                condition=Q(kind="customer", team__isnull=False, provider__isnull=True)
                | Q(kind="provider", team__isnull=True, provider__isnull=False)
                | Q(kind="platform", team__isnull=True, provider__isnull=True),
                name="account_owner_matches_kind",
            ),
            models.UniqueConstraint(
                fields=["team"], condition=Q(kind="customer"), name="account_one_per_team"
            ),
            models.UniqueConstraint(
                fields=["provider"], condition=Q(kind="provider"), name="account_one_per_provider"
            ),
            models.UniqueConstraint(
                fields=["kind"], condition=Q(kind="platform"), name="account_one_platform"
            ),
        ]
        # Money leaves or enters an account by hand only with one of these (the admin checks
        # them; is_staff alone is not enough).
        permissions = [
            ("adjust_account", "Can credit or debit an account"),
            ("issue_refund", "Can refund a customer"),
            ("create_payout", "Can pay a provider out and mark payouts paid"),
            ("change_payout_destination", "Can set the Connect account payouts go to"),
        ]

    def __str__(self) -> str:
        if self.kind == AccountKind.CUSTOMER:
            return f"team {self.team_id}"
        if self.kind == AccountKind.PROVIDER:
            return f"provider {self.provider_id}"
        return "platform"


class NoticeKind(models.TextChoices):
    LOW_BALANCE = "low_balance", "Low balance"
    DEPLETED = "depleted", "Balance exhausted: rentals stopped"
    RESTORED = "restored", "Balance restored"
    # Budgets: the month's charges crossed the warning share of the monthly budget; a budget
    # (the monthly one, or one rental's cap) was reached and rentals are being stopped.
    BUDGET_WARNING = "budget_warning", "Monthly budget nearly used"
    BUDGET_REACHED = "budget_reached", "Budget reached: rentals stopped"


class BalanceNotice(models.Model):
    """A warning shown to a customer (and kept for ops) when the balance runs low or out."""

    account = models.ForeignKey(Account, on_delete=models.PROTECT, related_name="notices")
    kind = models.CharField(max_length=20, choices=NoticeKind.choices)
    # The rental a notice is about (a per-rental budget reached); empty for account notices.
    rental = models.ForeignKey(
        "marketplace.Rental", null=True, blank=True, on_delete=models.PROTECT, related_name="+"
    )
    available_micros = models.BigIntegerField()
    hourly_burn_micros = models.BigIntegerField()
    detail = models.CharField(max_length=500, blank=True)
    created_at = models.DateTimeField()

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [models.Index(fields=["account", "-created_at"], name="notice_by_account")]

    def __str__(self) -> str:
        return f"{self.kind} {self.account_id}"


class FundsHold(models.Model):
    """What a rental may cost, held against its team's balance from its creation, so the
    same money cannot back two rentals. Never updated: how much of it still counts is computed
    from the rental's status, its locked price and its charges (selectors.team_held_micros),
    so nothing has to be released and nothing can drift."""

    rental = models.OneToOneField(
        "marketplace.Rental", primary_key=True, on_delete=models.PROTECT, related_name="funds_hold"
    )
    account = models.ForeignKey(Account, on_delete=models.PROTECT, related_name="holds")
    price_per_gpu_hour = models.DecimalField(
        max_digits=10, decimal_places=4, help_text="the rate the hold was computed at"
    )
    amount_micros = models.BigIntegerField()
    # The customer's hard cap on this rental's charge: the billing pass stops the rental before
    # its charge would cross it, and the hold is never more than it.
    max_charge_micros = models.BigIntegerField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created_at"]
        constraints = [
            models.CheckConstraint(condition=Q(amount_micros__gte=0), name="hold_not_negative"),
            models.CheckConstraint(
                condition=Q(max_charge_micros__isnull=True) | Q(max_charge_micros__gt=0),
                name="hold_cap_positive",
            ),
        ]

    def __str__(self) -> str:
        return f"hold {self.amount_micros} for {self.rental_id}"
