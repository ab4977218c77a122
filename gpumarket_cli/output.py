"""How the commands lay out what a person reads: tables, durations, timestamps."""

from __future__ import annotations

# A call is one short process: what it does not use, it does not import (typing included).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any


def cell(value: Any) -> str:
    """A table cell: a float to four significant digits (--json keeps every digit)."""
    if isinstance(value, float):
        return f"{value:.4g}"
    return "" if value is None else str(value)


def table(rows: list[dict], columns: list[str]) -> str:
    cells = [[cell(r.get(c)) for c in columns] for r in rows]
    widths = [max([len(c), *(len(row[i]) for row in cells)]) for i, c in enumerate(columns)]
    lines = ["  ".join(c.upper().ljust(w) for c, w in zip(columns, widths, strict=True))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(line.rstrip() for line in lines)


def duration(hours: float) -> str:
    """Hours as a person reads them: 42 s, 6.4 min, 3.2 h, 12 d."""
    seconds = hours * 3600
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            value = seconds / size
            return f"{value:.1f} {unit}" if value < 10 else f"{value:,.0f} {unit}"
    return f"{seconds:.0f} s"


def when(stamp: str | None) -> str:
    """An API timestamp as `2026-12-06 03:10:39` (UTC), or `-`."""
    return stamp[:19].replace("T", " ") if stamp else "-"
