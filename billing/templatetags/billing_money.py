"""Display filters for amounts kept in micro-dollars and usage kept in GPU-seconds."""

from __future__ import annotations

from decimal import Decimal

from django import template

from billing import conf

register = template.Library()


@register.filter
def usd(micros: int | None) -> str:
    """Micro-dollars shown exactly: cents always, more digits only where the amount has them
    ($0.0042, -$0.012345). Rounding to cents would show rows of $0.00 under a total of $0.01
    and a charge of 4 micros as "$-0.00"; exact amounts add up on the page as in the ledger.
    The pages' JavaScript `usd` (web/base.html) formats the same way."""
    whole, fraction = divmod(abs(int(micros or 0)), conf.MICROS_PER_USD)
    digits = f"{fraction:06d}".rstrip("0").ljust(2, "0")
    return f"{'-' if (micros or 0) < 0 else ''}${whole:,}.{digits}"


@register.filter
def gpu_hours(seconds: int | None) -> str:
    return f"{Decimal(seconds or 0) / 3600:,.2f}"


@register.filter
def usd_plain(micros: int | None) -> str:
    """Micro-dollars as a plain amount a form field takes back (1234.50)."""
    return f"{(Decimal(micros or 0) / conf.MICROS_PER_USD).quantize(Decimal('0.01'))}"
