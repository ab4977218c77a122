"""Every write of billing: typed, keyword-only functions, each owning its transaction."""

from billing.services.budgets import (
    account_budgets_set,
    account_ceilings_set,
    budgets_enforce,
)
from billing.services.invoices import invoice_issue, invoices_issue_due
from billing.services.ledger import (
    account_adjust,
    account_for_customer,
    account_for_provider,
    account_platform,
    funds_hold_create,
    hold_micros,
    ledger_post,
    micros_from_usd,
)
from billing.services.metering import (
    UsageBatchResult,
    UsageReport,
    telemetry_ingest,
    telemetry_prune,
    usage_report_apply,
    usage_reports_apply,
)
from billing.services.onboarding import (
    customer_onboard,
    provider_onboard,
    provider_payouts_start,
)
from billing.services.payments import (
    TopUpStarted,
    payments_retry_pending,
    payout_create,
    payout_mark_paid,
    payout_reverse,
    payout_submit,
    refund_create,
    refund_fail,
    refund_submit,
    stripe_customer_ensure,
    stripe_webhook_receive,
    topup_create,
    topup_fail,
    topup_settle,
)
from billing.services.rating import BillingPassResult, billing_pass_run

__all__ = [
    "BillingPassResult",
    "TopUpStarted",
    "UsageBatchResult",
    "UsageReport",
    "account_adjust",
    "account_budgets_set",
    "account_ceilings_set",
    "account_for_customer",
    "account_for_provider",
    "account_platform",
    "billing_pass_run",
    "budgets_enforce",
    "customer_onboard",
    "funds_hold_create",
    "hold_micros",
    "invoice_issue",
    "invoices_issue_due",
    "ledger_post",
    "micros_from_usd",
    "payments_retry_pending",
    "payout_create",
    "payout_mark_paid",
    "payout_reverse",
    "payout_submit",
    "provider_onboard",
    "provider_payouts_start",
    "refund_create",
    "refund_fail",
    "refund_submit",
    "stripe_customer_ensure",
    "stripe_webhook_receive",
    "telemetry_ingest",
    "telemetry_prune",
    "topup_create",
    "topup_fail",
    "topup_settle",
    "usage_report_apply",
    "usage_reports_apply",
]
