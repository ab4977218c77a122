"""Billing settings with their defaults; each can be overridden in Django settings.

Money is kept in integer micro-dollars (1 USD = 1,000,000 micros): a price of 4 decimals per
GPU-hour times whole GPU-seconds divided by 3600 then floors to a whole micro, and Stripe cents
are exactly 10,000 micros, so every conversion is integer arithmetic.
"""

from __future__ import annotations

from django.conf import settings

MICROS_PER_USD = 1_000_000
MICROS_PER_CENT = 10_000
BPS = 10_000


def _get(name: str, default):
    return getattr(settings, name, default)


def platform_fee_bps() -> int:
    """The platform's share of every charge, in basis points (2000 = 20 %)."""
    return int(_get("BILLING_PLATFORM_FEE_BPS", 2000))


def posting_interval_s() -> int:
    """How often a running meter's accrued charge is posted to the ledger."""
    return int(_get("BILLING_POSTING_INTERVAL_S", 3600))


def chunk_timeout_ms() -> int:
    """The longest one chunk of the billing pass may run (a statement timeout, below the
    connection's own): a chunk that runs out is rolled back and rated again in halves."""
    return int(_get("BILLING_CHUNK_TIMEOUT_MS", 20_000))


def low_balance_hours() -> int:
    """Warn when the available balance covers less than this many hours of running rentals."""
    return int(_get("BILLING_LOW_BALANCE_HOURS", 1))


def funds_check_enabled() -> bool:
    return bool(_get("BILLING_FUNDS_CHECK", True))


def max_concurrent_gpus() -> int:
    """Default ceiling on an account's pending, placed and running GPUs; 0: no limit."""
    return int(_get("BILLING_MAX_CONCURRENT_GPUS", 64))


def max_rentals_per_minute() -> int:
    """Default ceiling on the rentals an account creates in any 60 s; 0: no limit."""
    return int(_get("BILLING_MAX_RENTALS_PER_MINUTE", 30))


def billing_pass_interval_s() -> int:
    """How often the billing pass runs (beat's schedule of `billing.pass`): the time a budget
    check can lag behind the usage it judges."""
    schedule = _get("CELERY_BEAT_SCHEDULE", {}).get("billing-pass")
    if schedule is not None:
        return max(1, int(schedule["schedule"].total_seconds()))
    return 60


def clock_skew_s() -> int:
    """How far ahead of the server clock an agent's confirmation may be."""
    return int(_get("BILLING_CLOCK_SKEW_S", 120))


def telemetry_retention_days() -> int:
    """Raw telemetry samples older than this are deleted; per-minute rollups are kept."""
    return int(_get("BILLING_TELEMETRY_RETENTION_DAYS", 7))


def currency() -> str:
    return str(_get("BILLING_CURRENCY", "usd"))


def topup_limits_cents() -> tuple[int, int]:
    return int(_get("BILLING_TOPUP_MIN_CENTS", 500)), int(
        _get("BILLING_TOPUP_MAX_CENTS", 1_000_000)
    )


def stripe_max_network_retries() -> int:
    return int(_get("STRIPE_MAX_NETWORK_RETRIES", 2))
