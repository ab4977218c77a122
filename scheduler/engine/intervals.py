"""Time ranges on one GPU: what holds it when, and sweeps over range boundaries.

A GPU's capacity is a list of `Interval`s sorted by start. Every check the planner makes is a
range check against such a list, which is how a GPU is never given to two overlapping intervals.
The sweep helpers (`covered`, `merge`, `latest_start`) work on closed ranges of start times and
serve the search for a blocked request's earliest start.
"""

from __future__ import annotations

from enum import IntEnum
from math import inf, nextafter
from operator import itemgetter
from typing import NamedTuple, TypeAlias

from scheduler.engine.types import RentalId


class Tag(IntEnum):
    """What holds a GPU over an interval. Only `SPOT` intervals can be preempted."""

    PLAN = 0
    """A placement made earlier in this plan."""
    HOLD = 1
    """A backfill reservation made earlier in this plan."""
    FIXED = 2
    """An existing allocation that cannot be preempted."""
    SPOT = 3
    """An existing allocation of an interruptible rental."""


Interval: TypeAlias = tuple[float, float, RentalId, int]
"""(start, end, rental id, tag as its int value; compare it with `==`): [start, end) held by a
rental. Lists are sorted by start only, so ids are never compared.

A plain tuple of atomic values, read by unpacking or `interval_start`: a cycle keeps one per held
GPU range, and CPython's garbage collector stops tracking exact tuples of atomic values, but not
tuple subclasses (a NamedTuple) nor tuples holding an enum member, which cost the bench cluster an
extra full collection per cycle.
"""

interval_start = itemgetter(0)
"""The start of an interval; the sort key of a GPU's interval list."""


class Edge(IntEnum):
    """Which end of a closed range an event marks; opens sort first, so touching ranges meet."""

    OPEN = 0
    CLOSE = 1


class Event(NamedTuple):
    at: float
    edge: Edge


def is_free(intervals: list[Interval], t0: float, t1: float) -> bool:
    """Whether no interval of the list overlaps [t0, t1)."""
    # A plain loop: this runs for every GPU of every node a future window visits, and a
    # generator costs more than the check itself.
    for start, end, _, _ in intervals:  # noqa: SIM110
        if start < t1 and end > t0:
            return False
    return True


def latest_start(start: float, duration: float) -> float:
    """The latest t with t + duration <= start, exact under float rounding."""
    t = start - duration
    while t + duration > start:
        t = nextafter(t, -inf)
    return t


def covered(events: list[Event], need: int) -> list[tuple[float, float]]:
    """Closed ranges covered by at least `need` of the closed ranges given as open/close events."""
    events.sort()
    out = []
    count = 0
    opened = 0.0
    opening = Edge.OPEN
    for at, edge in events:
        if edge is opening:
            count += 1
            if count == need:
                opened = at
        else:
            if count == need:
                out.append((opened, at))
            count -= 1
    return out


def merge(ranges: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of closed (lo, hi) ranges as disjoint ranges, in order."""
    ranges.sort()
    out: list[tuple[float, float]] = []
    for lo, hi in ranges:
        if out:
            last_lo, last_hi = out[-1]
            if lo <= last_hi:
                if hi > last_hi:
                    out[-1] = (last_lo, hi)
                continue
        out.append((lo, hi))
    return out
