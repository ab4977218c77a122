"""The live log of a run: output lines the agent forwards, numbered, kept a few days."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.utils import timezone

from agentprotocol.untrusted import secrets_mask, text_sanitize
from marketplace.models import Node
from provisioning import queries
from provisioning.models import ContainerRun, RunLogLine

# A run that prints without end keeps its first lines and its newest: past this many, a
# line is dropped and counted (the agent already drops the oldest it cannot send).
MAX_LINES_PER_RUN = 200_000


def log_retention_days() -> int:
    return int(settings.GPUMARKET.get("LOG_RETENTION_DAYS", 7))


def run_logs_store(
    *, node: Node, lines: list[tuple[str, int, str]], masks: Mapping | None = None
) -> int:
    """Store forwarded output lines (run_id, line_no, line) of runs on this node; a line sent
    twice is kept once. Lines of runs that are not this node's are refused. `masks`: rental
    id -> the secret values to blank out of its lines (the agent is not trusted to have done
    it). Returns how many were refused."""
    runs = dict(
        ContainerRun.objects.filter(node=node, run_id__in={r for r, _, _ in lines}).values_list(
            "run_id", "rental_id"
        )
    )
    rows, refused = log_rows(lines=lines, runs=runs, masks=masks)
    queries.heartbeat_writes(
        node_id=node.pk, now=timezone.now(), steady=(), metrics=queries.Rows.metrics(), logs=rows
    )
    return refused


def log_rows(
    *, lines: Sequence[tuple[str, int, str]], runs: Mapping[str, Any], masks: Mapping | None
) -> tuple[queries.Rows, int]:
    """The rows of forwarded output lines (run_id, line_no, line) for
    queries.heartbeat_writes, and how many lines were refused: those of runs not in `runs`
    (run id -> rental id of the node's runs) and those past MAX_LINES_PER_RUN."""
    rows, refused = queries.Rows.logs(), 0
    for run_id, line_no, line in lines:
        rental_id = runs.get(run_id)
        if rental_id is None or line_no >= MAX_LINES_PER_RUN:
            refused += 1
            continue
        if masks and (terms := masks.get(rental_id)):
            line = secrets_mask(line, terms)
        # The HTTP edge refused control characters; the agent is not trusted to have cleaned.
        rows.add(rental_id, run_id, line_no, text_sanitize(line))
    return rows, refused


def run_logs_expire(*, now=None) -> int:
    """Delete log lines older than the retention; returns how many."""
    cutoff = (now or timezone.now()) - timedelta(days=log_retention_days())
    deleted, _ = RunLogLine.objects.filter(received_at__lt=cutoff).delete()
    return deleted
