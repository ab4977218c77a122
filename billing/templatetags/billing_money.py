"""Display filters for amounts kept in micro-dollars and usage kept in GPU-seconds."""

from __future__ import annotations

from decimal import ROUND_HALF_UP, Decimal

from django import template

from billing import conf

register = template.Library()


@register.filter
def usd(micros: int | None) -> str:
    """Micro-dollars as dollars and cents (display only; the ledger keeps every micro)."""
    value = Decimal(micros or 0) / conf.MICROS_PER_USD
    cents = value.quantize(Decimal("0.01"), rounding=ROUND_HALF_UP)
    return f"-${-cents:,.2f}" if cents < 0 else f"${cents:,.2f}"


@register.filter
def gpu_hours(seconds: int | None) -> str:
    return f"{Decimal(seconds or 0) / 3600:,.2f}"


@register.filter
def usd_plain(micros: int | None) -> str:
    """Micro-dollars as a plain amount a form field takes back (1234.50)."""
    return f"{(Decimal(micros or 0) / conf.MICROS_PER_USD).quantize(Decimal('0.01'))}"
