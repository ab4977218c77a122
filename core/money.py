"""What a rental's GPU time costs, in micro-dollars: the one definition, for Python and for SQL.

Cost = GPU-seconds x the locked price per GPU-hour x 1,000,000 / 3600. A charge rounds down to
a whole micro-dollar (the customer never pays for a fraction not used); a hold, a bound on what
a charge can reach, rounds up. Prices carry 4 decimals, so a whole hour's cost is exact and
only the division by 3600 rounds. Pure Python with no Django import: the advisor's pricing, the
billing services and every SQL statement that prices GPU time use these two functions.
"""

from __future__ import annotations

from decimal import ROUND_CEILING, ROUND_FLOOR, Decimal

MICROS_PER_USD = 1_000_000
SECONDS_PER_HOUR = 3600


def cost_micros(*, price_per_gpu_hour: Decimal, gpu_seconds: int, round_up: bool = False) -> int:
    """GPU-seconds at the price per GPU-hour, in micro-dollars: rounded down (a charge), or up
    (a hold)."""
    micros = price_per_gpu_hour * MICROS_PER_USD * gpu_seconds / SECONDS_PER_HOUR
    return int(micros.to_integral_value(ROUND_CEILING if round_up else ROUND_FLOOR))


def cost_micros_sql(*, price: str, gpu_seconds: str, round_up: bool = False) -> str:
    """The same in SQL, over two SQL expressions (a numeric price, whole GPU-seconds); the
    result is a numeric with no fraction. Every statement that prices GPU time builds it here."""
    if round_up:
        return f"ceil(({price}) * {MICROS_PER_USD} * ({gpu_seconds}) / {SECONDS_PER_HOUR})"
    return f"div(({gpu_seconds}) * ({price}) * {MICROS_PER_USD}, {SECONDS_PER_HOUR})"
