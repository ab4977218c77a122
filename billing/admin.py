"""The ops console for money: read-only ledgers, and credits, refunds and payouts through forms
that require a reason and call the services (never a direct edit of a row).

Being staff lets one look; moving money takes the explicit permission of each action
(billing.adjust_account, billing.issue_refund, billing.create_payout, and
billing.change_payout_destination for where Connect payouts go). The ledger rows and the refund
and payout rows record who acted and why; the admin log records each action too."""

from __future__ import annotations

import uuid
from decimal import Decimal

from django import forms
from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponseRedirect
from django.shortcuts import get_object_or_404
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils.html import format_html, format_html_join

from billing import selectors, services
from billing.models import (
    Account,
    AccountKind,
    BalanceNotice,
    Invoice,
    InvoiceLine,
    LedgerEntry,
    MoneyOutStatus,
    Payout,
    PayoutMethod,
    Refund,
    StripeEvent,
    TopUp,
    TopUpStatus,
)
from billing.templatetags.billing_money import usd
from core.errors import DomainError


def _require_perm(request: HttpRequest, codename: str) -> None:
    """Refuse (403) a money action the user has no explicit permission for."""
    if not request.user.has_perm(f"billing.{codename}"):
        raise PermissionDenied(f"moving money needs the billing.{codename} permission")


class ReadOnlyAdmin(admin.ModelAdmin):
    """Rows written only by services: ops look, never add, change or delete."""

    def has_add_permission(self, request, obj=None) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False

    def has_delete_permission(self, request, obj=None) -> bool:
        return False


class AdjustForm(forms.Form):
    amount = forms.DecimalField(max_digits=16, decimal_places=6, help_text="USD; negative to debit")
    reason = forms.CharField(max_length=500, widget=forms.Textarea(attrs={"rows": 3}))
    key = forms.UUIDField(widget=forms.HiddenInput, initial=uuid.uuid4)

    def clean_amount(self) -> Decimal:
        if self.cleaned_data["amount"] == 0:
            raise forms.ValidationError("the amount must not be zero")
        return self.cleaned_data["amount"]


class RefundForm(forms.Form):
    amount = forms.DecimalField(max_digits=16, decimal_places=2, min_value=Decimal("0.01"))
    topup = forms.ModelChoiceField(
        queryset=TopUp.objects.none(),
        required=False,
        help_text="refund to the card of this top-up; empty: money returned out of band",
    )
    reason = forms.CharField(max_length=500, widget=forms.Textarea(attrs={"rows": 3}))
    key = forms.UUIDField(widget=forms.HiddenInput, initial=uuid.uuid4)

    def __init__(self, *args, account: Account, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.fields["topup"].queryset = TopUp.objects.filter(
            account=account, status=TopUpStatus.SUCCEEDED
        )


class CeilingsForm(forms.Form):
    max_concurrent_gpus = forms.IntegerField(
        min_value=1, max_value=100_000, required=False,
        help_text="pending + placed + running GPUs; empty: the BILLING_MAX_CONCURRENT_GPUS setting",
    )  # fmt: skip
    max_rentals_per_minute = forms.IntegerField(
        min_value=1, max_value=100_000, required=False,
        help_text="empty: the BILLING_MAX_RENTALS_PER_MINUTE setting",
    )  # fmt: skip


class PayoutForm(forms.Form):
    amount = forms.DecimalField(
        max_digits=16,
        decimal_places=2,
        min_value=Decimal("0.01"),
        required=False,
        help_text="USD; empty: the whole balance",
    )
    reason = forms.CharField(max_length=500)
    key = forms.UUIDField(widget=forms.HiddenInput, initial=uuid.uuid4)


@admin.register(Account)
class AccountAdmin(admin.ModelAdmin):
    list_display = ["id", "kind", "owner", "balance", "low_balance_since", "depleted_since"]
    list_filter = ["kind"]
    search_fields = ["team__name", "team__memberships__user__username", "provider__name"]
    list_select_related = ["team", "provider"]
    fields = [
        "kind",
        "owner",
        "balance",
        "low_balance_since",
        "depleted_since",
        "budgets",
        "stripe_customer_id",
        "stripe_connect_account_id",
        "ops_actions",
        "recent_entries",
    ]
    # Only the provider's Connect account id is edited by hand, and only with the permission
    # to send payouts somewhere; money moves through the forms.
    readonly_fields = [f for f in fields if f != "stripe_connect_account_id"]

    def get_readonly_fields(self, request, obj=None):
        if request.user.has_perm("billing.change_payout_destination"):
            return self.readonly_fields
        return self.fields

    def has_add_permission(self, request, obj=None) -> bool:
        return False

    def has_delete_permission(self, request, obj=None) -> bool:
        return False

    @admin.display(description="owner")
    def owner(self, account: Account) -> str:
        if account.kind == AccountKind.CUSTOMER:
            return f"team {account.team.name} (#{account.team_id})"
        if account.kind == AccountKind.PROVIDER:
            return account.provider.name
        return "the platform"

    @admin.display(description="balance", ordering="balance_micros")
    def balance(self, account: Account) -> str:
        return f"{usd(account.balance_micros)} ({account.balance_micros} micros)"

    @admin.display(description="budgets and limits")
    def budgets(self, account: Account) -> str:
        if account.kind != AccountKind.CUSTOMER:
            return "-"
        limits = selectors.account_limits(account=account)
        budget = account.monthly_budget_micros
        return (
            f"monthly budget {usd(budget) if budget else 'none'};"
            f" GPUs at once {limits.max_concurrent_gpus or 'no limit'}"
            f" (ceiling {account.ops_max_concurrent_gpus or 'default'});"
            f" rentals per minute {limits.max_rentals_per_minute or 'no limit'}"
            f" (ceiling {account.ops_max_rentals_per_minute or 'default'})"
        )

    @admin.display(description="actions")
    def ops_actions(self, account: Account) -> str:
        links = [("billing_account_adjust", "Credit or debit")]
        if account.kind == AccountKind.CUSTOMER:
            links.append(("billing_account_refund", "Refund"))
            links.append(("billing_account_ceilings", "Limits"))
        if account.kind == AccountKind.PROVIDER:
            links.append(("billing_account_payout", "Pay out"))
        ledger = (
            reverse("admin:billing_ledgerentry_changelist") + f"?account__id__exact={account.pk}"
        )
        return format_html(
            '{} &middot; <a href="{}">Ledger</a>',
            format_html_join(
                " &middot; ",
                '<a href="{}">{}</a>',
                ((reverse(f"admin:{name}", args=[account.pk]), label) for name, label in links),
            ),
            ledger,
        )

    @admin.display(description="last 20 entries")
    def recent_entries(self, account: Account) -> str:
        rows = account.entries.order_by("-created_at", "-id")[:20]
        return format_html(
            "<table>{}</table>",
            format_html_join(
                "",
                "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
                (
                    (
                        e.created_at.strftime("%Y-%m-%d %H:%M:%S"),
                        e.kind,
                        usd(e.amount_micros),
                        e.memo,
                    )
                    for e in rows
                ),
            ),
        )

    def get_urls(self):
        own = [
            path(
                "<int:account_id>/adjust/",
                self.admin_site.admin_view(self.adjust_view),
                name="billing_account_adjust",
            ),
            path(
                "<int:account_id>/refund/",
                self.admin_site.admin_view(self.refund_view),
                name="billing_account_refund",
            ),
            path(
                "<int:account_id>/ceilings/",
                self.admin_site.admin_view(self.ceilings_view),
                name="billing_account_ceilings",
            ),
            path(
                "<int:account_id>/payout/",
                self.admin_site.admin_view(self.payout_view),
                name="billing_account_payout",
            ),
        ]
        return own + super().get_urls()

    def _form_page(self, request, account, form, title):
        return TemplateResponse(
            request,
            "admin/billing/ops_form.html",
            {
                **self.admin_site.each_context(request),
                "opts": self.model._meta,
                "original": account,
                "title": f"{title}: {self.owner(account)}",
                "account": account,
                "form": form,
            },
        )

    def _done(self, request, account, message):
        self.log_change(request, account, message)
        self.message_user(request, message, messages.SUCCESS)
        return HttpResponseRedirect(reverse("admin:billing_account_change", args=[account.pk]))

    def adjust_view(self, request: HttpRequest, account_id: int):
        _require_perm(request, "adjust_account")
        account = get_object_or_404(Account, pk=account_id)
        form = AdjustForm(request.POST or None)
        if request.method == "POST" and form.is_valid():
            try:
                entry = services.account_adjust(
                    account_id=account.pk,
                    amount_micros=services.micros_from_usd(form.cleaned_data["amount"]),
                    reason=form.cleaned_data["reason"],
                    actor=request.user,
                    key=str(form.cleaned_data["key"]),
                )
            except DomainError as exc:
                form.add_error(None, exc.message)
            else:
                note = "posted" if entry else "already posted (form submitted twice)"
                amount = usd(services.micros_from_usd(form.cleaned_data["amount"]))
                return self._done(
                    request,
                    account,
                    f"Adjustment of {amount} {note}: {form.cleaned_data['reason']}",
                )
        return self._form_page(request, account, form, "Credit or debit")

    def refund_view(self, request: HttpRequest, account_id: int):
        _require_perm(request, "issue_refund")
        account = get_object_or_404(Account, pk=account_id, kind=AccountKind.CUSTOMER)
        form = RefundForm(request.POST or None, account=account)
        if request.method == "POST" and form.is_valid():
            topup = form.cleaned_data["topup"]
            try:
                refund = services.refund_create(
                    account_id=account.pk,
                    amount_micros=services.micros_from_usd(form.cleaned_data["amount"]),
                    reason=form.cleaned_data["reason"],
                    actor=request.user,
                    topup_id=topup.pk if topup else None,
                    refund_id=form.cleaned_data["key"],
                )
            except DomainError as exc:
                form.add_error(None, exc.message)
            else:
                return self._done(
                    request,
                    account,
                    f"Refund of {usd(refund.amount_micros)} {refund.status}: {refund.reason}",
                )
        return self._form_page(request, account, form, "Refund")

    def ceilings_view(self, request: HttpRequest, account_id: int):
        """The account's ceilings on the limits its customer may set."""
        if not request.user.has_perm("billing.change_account"):
            raise PermissionDenied("setting limits needs the billing.change_account permission")
        account = get_object_or_404(Account, pk=account_id, kind=AccountKind.CUSTOMER)
        form = CeilingsForm(
            request.POST or None,
            initial={
                "max_concurrent_gpus": account.ops_max_concurrent_gpus,
                "max_rentals_per_minute": account.ops_max_rentals_per_minute,
            },
        )
        if request.method == "POST" and form.is_valid():
            try:
                services.account_ceilings_set(account_id=account.pk, **form.cleaned_data)
            except DomainError as exc:
                form.add_error(None, exc.message)
            else:
                limits = ", ".join(f"{k} {v or 'default'}" for k, v in form.cleaned_data.items())
                return self._done(request, account, f"Limits set: {limits}")
        return self._form_page(request, account, form, "Limits")

    def payout_view(self, request: HttpRequest, account_id: int):
        _require_perm(request, "create_payout")
        account = get_object_or_404(Account, pk=account_id, kind=AccountKind.PROVIDER)
        form = PayoutForm(request.POST or None)
        if request.method == "POST" and form.is_valid():
            amount = form.cleaned_data["amount"]
            try:
                payout = services.payout_create(
                    account_id=account.pk,
                    actor=request.user,
                    amount_micros=services.micros_from_usd(amount) if amount else None,
                    reason=form.cleaned_data["reason"],
                    payout_id=form.cleaned_data["key"],
                )
            except DomainError as exc:
                form.add_error(None, exc.message)
            else:
                return self._done(
                    request,
                    account,
                    f"Payout of {usd(payout.amount_micros)} {payout.status} ({payout.method}):"
                    f" {payout.reason}",
                )
        return self._form_page(request, account, form, "Pay out")


@admin.register(LedgerEntry)
class LedgerEntryAdmin(ReadOnlyAdmin):
    list_display = [
        "created_at",
        "account",
        "kind",
        "amount",
        "rental_id",
        "posting_seq",
        "gpu_seconds",
        "key",
        "memo",
        "actor",
    ]
    list_filter = ["kind", "account__kind"]
    search_fields = ["=key", "memo", "account__team__name", "account__provider__name"]
    list_select_related = ["account", "actor"]
    # The ledger grows by millions of rows: no COUNT(*) of the whole table on every page.
    show_full_result_count = False

    @admin.display(description="amount", ordering="amount_micros")
    def amount(self, entry: LedgerEntry) -> str:
        return usd(entry.amount_micros)


@admin.register(TopUp)
class TopUpAdmin(ReadOnlyAdmin):
    list_display = [
        "created_at",
        "account",
        "amount_cents",
        "currency",
        "status",
        "payment_intent_id",
    ]
    list_filter = ["status"]
    search_fields = ["=payment_intent_id", "account__team__name"]
    list_select_related = ["account"]


@admin.register(Refund)
class RefundAdmin(ReadOnlyAdmin):
    list_display = ["created_at", "account", "amount", "status", "topup", "reason", "actor"]
    list_filter = ["status"]
    list_select_related = ["account", "topup", "actor"]

    @admin.display(description="amount", ordering="amount_micros")
    def amount(self, refund: Refund) -> str:
        return usd(refund.amount_micros)


@admin.action(
    description="Mark manual payouts as paid (bank transfer made)",
    permissions=["create_payout"],
)
def payouts_mark_paid(modeladmin, request, queryset):
    _require_perm(request, "create_payout")
    done, refused = 0, []
    for payout in queryset.filter(method=PayoutMethod.MANUAL).order_by("pk"):
        try:
            services.payout_mark_paid(payout_id=payout.pk, actor=request.user)
            modeladmin.log_change(request, payout, "marked paid (bank transfer made)")
            done += 1
        except DomainError as exc:
            refused.append(exc.message)
    if done:
        modeladmin.message_user(request, f"{done} payout(s) marked paid", messages.SUCCESS)
    if refused:
        modeladmin.message_user(request, "; ".join(refused), messages.WARNING)


@admin.register(Payout)
class PayoutAdmin(ReadOnlyAdmin):
    list_display = [
        "created_at",
        "account",
        "amount",
        "method",
        "status",
        "stripe_transfer_id",
        "actor",
    ]
    list_filter = ["status", "method"]
    list_select_related = ["account", "actor"]
    actions = [payouts_mark_paid]

    @admin.display(description="amount", ordering="amount_micros")
    def amount(self, payout: Payout) -> str:
        return usd(payout.amount_micros)

    def has_change_permission(self, request, obj=None) -> bool:
        # The changelist action needs it; the form itself stays read-only (no editable field).
        return obj is None and self.has_create_payout_permission(request)

    def has_create_payout_permission(self, request) -> bool:
        return request.user.has_perm("billing.create_payout")

    def get_actions(self, request):
        actions = super().get_actions(request)
        if not Payout.objects.filter(status=MoneyOutStatus.PENDING).exists():
            actions.pop("payouts_mark_paid", None)
        return actions


@admin.register(StripeEvent)
class StripeEventAdmin(ReadOnlyAdmin):
    list_display = ["received_at", "event_id", "type", "suspicious", "outcome"]
    list_filter = ["suspicious", "type"]
    search_fields = ["=event_id"]


@admin.register(BalanceNotice)
class BalanceNoticeAdmin(ReadOnlyAdmin):
    list_display = [
        "created_at",
        "account",
        "kind",
        "available_micros",
        "hourly_burn_micros",
        "detail",
    ]
    list_filter = ["kind"]
    list_select_related = ["account"]


class InvoiceLineInline(admin.TabularInline):
    model = InvoiceLine
    extra = 0
    can_delete = False
    fields = [
        "rental",
        "description",
        "gpu_model",
        "gpus",
        "gpu_seconds",
        "rate_per_gpu_hour",
        "amount_micros",
    ]
    readonly_fields = fields

    def has_add_permission(self, request, obj=None) -> bool:
        return False


@admin.register(Invoice)
class InvoiceAdmin(ReadOnlyAdmin):
    list_display = [
        "number",
        "account",
        "period_start",
        "usage_micros",
        "closing_balance_micros",
        "issued_at",
    ]
    search_fields = ["=number", "account__team__name"]
    list_select_related = ["account"]
    inlines = [InvoiceLineInline]
