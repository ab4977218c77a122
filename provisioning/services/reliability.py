"""Node reliability, measured from the last 30 days of history rather than declared.

Two observations per node:
- uptime = time ONLINE or DRAINING (heartbeating: a silent node is marked OFFLINE) over time
  listed (every status but MAINTENANCE, which the provider announced), from the node's status
  events; an ONLINE node whose last heartbeat is older than the silence timeout is down since;
- survival = 1 - failed / ran: of the rentals handed to the node in the window, those that
  ended by the node's fault (it went silent, it could not start the container, the container
  disappeared from it).

    observed = uptime x survival
    w        = H / (H + H0)          H: listed hours in the window, H0 = PRIOR_HOURS
    score    = (1 - w) x declared + w x observed

A Bayesian blend: the declared figure is a prior worth H0 hours of record, so a new node shows
what its provider declared and a node with a month of history shows mostly what it did.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from decimal import Decimal

from django.conf import settings
from django.db import connection, transaction
from django.utils import timezone

from marketplace.models import Node, NodeEvent, NodeStatus

WINDOW = timedelta(days=30)
PRIOR_HOURS = 72.0
_UP = frozenset({NodeStatus.ONLINE, NodeStatus.DRAINING})
_LISTED = frozenset(NodeStatus) - {NodeStatus.MAINTENANCE}

_FAILURES_SQL = """
SELECT a.node_id, count(DISTINCT a.rental_id),
       count(DISTINCT a.rental_id) FILTER (WHERE EXISTS (
           SELECT 1 FROM marketplace_rentalevent e
           WHERE e.rental_id = a.rental_id AND e.created_at >= %(since)s
             AND (starts_with(e.reason, 'node ' || n.hostname || ' went silent')
                  OR starts_with(e.reason, 'cannot start on ' || n.hostname || ':')
                  -- This reason names no host: the node is the one whose GPUs it freed then.
                  OR (e.reason = 'container disappeared from the node'
                      AND a.released_at BETWEEN e.created_at - interval '1 minute'
                                            AND e.created_at + interval '1 minute'))))
FROM marketplace_allocation a
JOIN marketplace_node n ON n.id = a.node_id
WHERE upper(a.during) > %(since)s AND lower(a.during) <= %(now)s
  AND EXISTS (SELECT 1 FROM marketplace_rentalevent p
              WHERE p.rental_id = a.rental_id AND p.to_status = 'provisioning')
GROUP BY a.node_id
"""


def _uptime(
    node: Node, events: list[NodeEvent], since: datetime, now: datetime, silence: timedelta
) -> tuple[float, float]:
    """(seconds up, seconds listed) in [since, now], walking the status changes."""
    at = max(since, node.created_at)
    status = events[0].from_status if events else node.status
    up = listed = 0.0
    for event in [*events, None]:
        until = now if event is None else max(at, event.created_at)
        if event is None and node.last_seen_at is not None:
            heard_until = min(now, max(at, node.last_seen_at + silence))
        else:
            heard_until = until
        if status in _LISTED:
            listed += (until - at).total_seconds()
        if status in _UP:
            up += (min(until, heard_until) - at).total_seconds()
        if event is not None:
            at, status = until, event.to_status
    return up, listed


def reliability_score(
    *, declared: float, up_s: float, listed_s: float, ran: int, failed: int
) -> float:
    """The blend of the module docstring, in [0, 1]."""
    hours = listed_s / 3600
    uptime = up_s / listed_s if listed_s > 0 else 1.0
    survival = 1 - failed / ran if ran else 1.0
    weight = hours / (hours + PRIOR_HOURS)
    return min(1.0, max(0.0, (1 - weight) * declared + weight * uptime * survival))


def nodes_reliability_update(*, now: datetime | None = None) -> int:
    """Recompute every node's reliability from its history; returns the nodes whose score
    changed. Reads first, then one short transaction of updates."""
    now = now or timezone.now()
    since = now - WINDOW
    silence = timedelta(seconds=settings.GPUMARKET.get("NODE_SILENCE_TIMEOUT_S", 60))
    nodes = list(
        Node.objects.only(
            "id", "status", "created_at", "last_seen_at", "reliability",
            "reliability_declared", "reliability_observed_hours",
        )
    )  # fmt: skip
    events: dict[int, list[NodeEvent]] = {}
    for event in NodeEvent.objects.filter(created_at__gt=since, created_at__lte=now).order_by(
        "node_id", "created_at", "id"
    ):
        events.setdefault(event.node_id, []).append(event)
    with connection.cursor() as cursor:
        cursor.execute(_FAILURES_SQL, {"since": since, "now": now})
        runs = {node_id: (ran, failed) for node_id, ran, failed in cursor.fetchall()}
    changed = []
    for node in nodes:
        up, listed = _uptime(node, events.get(node.pk, []), since, now, silence)
        ran, failed = runs.get(node.pk, (0, 0))
        score = reliability_score(
            declared=float(node.reliability_declared),
            up_s=up,
            listed_s=listed,
            ran=ran,
            failed=failed,
        )
        measured = Decimal(f"{score:.4f}")
        hours = round(listed / 3600, 2)
        if (measured, hours) != (node.reliability, node.reliability_observed_hours):
            node.reliability, node.reliability_observed_hours = measured, hours
            changed.append(node)
    with transaction.atomic():
        Node.objects.bulk_update(
            changed, ["reliability", "reliability_observed_hours"], batch_size=1000
        )
    return len(changed)
