"""Topology groups within one node, and which GPUs of a node a placement takes.

GPUs sharing an NVLink island or PCIe switch form a group; a GPU without a group label is a group
of its own. Positions are indices into a node's GPUs sorted by index, and groups are small ints,
so the choice is cheap enough to run for every node a search visits.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from scheduler.engine.types import Gpu


class Pick(NamedTuple):
    """GPU positions chosen on one node, in increasing order, and how many groups they span."""

    positions: list[int]
    spans: int


def group_ids(gpus: Sequence[Gpu]) -> list[int] | None:
    """Small-int topology group per position, or None when all GPUs share one group.

    A GPU without a group label is a group of its own.
    """
    labels: dict[str, int] = {}
    ids = []
    for position, gpu in enumerate(gpus):
        if gpu.group:
            ids.append(labels.setdefault(gpu.group, len(labels)))
        else:
            ids.append(-1 - position)
    if len(set(ids)) == 1:
        return None
    return ids


def max_group(group: list[int] | None, size: int) -> int:
    """The size of the largest group of a node of `size` GPUs."""
    if group is None:
        return size
    counts: dict[int, int] = {}
    for g in group:
        counts[g] = counts.get(g, 0) + 1
    return max(counts.values())


def pick(
    group: list[int] | None, free: list[int], k: int, same_group: bool, best_fit: bool
) -> Pick | None:
    """Choose k of the free positions, or None when they cannot hold the request.

    Best fit takes the smallest group that holds all k, so larger groups stay whole; failing
    that it spans the fewest groups. First fit takes the lowest indices.
    """
    if len(free) < k:
        return None
    if group is None:
        return Pick(free[:k], 1)
    if not best_fit and not same_group:
        chosen = free[:k]
        return Pick(chosen, len({group[p] for p in chosen}))
    by_group: dict[int, list[int]] = {}
    for p in free:
        by_group.setdefault(group[p], []).append(p)
    fitting = [ps for ps in by_group.values() if len(ps) >= k]
    if fitting:
        ps = min(fitting, key=len) if best_fit else fitting[0]
        return Pick(ps[:k], 1)
    if same_group:
        return None
    chosen = []
    spans = 0
    for ps in sorted(by_group.values(), key=len, reverse=True):
        chosen += ps[: k - len(chosen)]
        spans += 1
        if len(chosen) == k:
            break
    return Pick(sorted(chosen), spans)


def spans(sizes: list[int], k: int) -> int:
    """How many groups k GPUs span when taken from the largest groups first (sizes descending)."""
    total = 0
    for count, size in enumerate(sizes, start=1):
        total += size
        if total >= k:
            return count
    return len(sizes)
