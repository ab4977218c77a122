"""The agent's durable bookkeeping, in <state-dir>/spool/: usage reports and per-run records.

usage.jsonl  usage reports not yet acknowledged, one JSON object per line, oldest first. Reports
             are appended and fsync'd *before* they are sent, so a report survives a crash or an
             unreachable server and is replayed later; the server applies them idempotently by
             (node, seq) and acknowledges the highest seq it applied (`ack_usage_seq`).
last_seq     the last seq handed out. Seqs are monotonic per node across agent restarts: the
             counter is persisted before the reports using it are written, so a crash in between
             skips numbers but never reuses one.
runs.json    per run: what the last desired entry said (rental, GPUs, stop grace), how far its
             metrics lines were delivered (an output cursor plus a count of metrics lines after
             it), and whether its final usage report is spooled. It lets a restarted agent report
             usage (the GPU count), forward metrics (no resend, no gap) and finish the
             artifact sync of the runs it adopts. Losing it is harmless: the next desired
             state refills it, and lines are then forwarded again from the start (the server
             stores each line once).

Crash safety: a torn last line of usage.jsonl (the crash hit mid-append) is dropped; whole-file
rewrites go through a temporary file, fsync and rename.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from agentprotocol import UsageReport

logger = logging.getLogger(__name__)


def write_atomic(path: str, text: str) -> None:
    """Replace `path` with `text` (0600), durable once this returns."""
    tmp = f"{path}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(path))


def _fsync_dir(directory: str) -> None:
    # The rename itself is only durable once the directory entry is on disk.
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class UsageSpool:
    """Unacknowledged usage reports, with the node's seq counter."""

    def __init__(self, directory: str) -> None:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        self._path = os.path.join(directory, "usage.jsonl")
        self._seq_path = os.path.join(directory, "last_seq")
        self._records = self._load()
        self._last_seq = max(self._read_seq(), max((r["seq"] for r in self._records), default=0))

    @property
    def last_seq(self) -> int:
        return self._last_seq

    def __len__(self) -> int:
        return len(self._records)

    def append(self, reports: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        """Give each report the next seq and store it durably; returns the stored records."""
        if not reports:
            return []
        first = self._last_seq + 1
        records = [
            UsageReport(seq=first + i, **report).to_payload() for i, report in enumerate(reports)
        ]
        self._store_seq(first + len(records) - 1)
        with open(self._path, "a") as f:
            f.write("".join(json.dumps(record) + "\n" for record in records))
            f.flush()
            os.fsync(f.fileno())
        self._records.extend(records)
        return records

    def pending(self, limit: int) -> list[dict[str, Any]]:
        """The oldest `limit` unacknowledged records."""
        return [dict(record) for record in self._records[:limit]]

    def ack(self, seq: int) -> int:
        """Drop every record up to `seq` (the server applied them); returns how many."""
        if seq > self._last_seq:
            # The server has applied seqs we do not remember handing out (a state dir restored
            # from an old backup): continue after them, or new reports would be ignored as
            # replays.
            logger.warning(
                "server acknowledged a seq beyond ours", extra={"ack": seq, "ours": self._last_seq}
            )
            self._store_seq(seq)
        keep = [record for record in self._records if record["seq"] > seq]
        dropped = len(self._records) - len(keep)
        if dropped:
            write_atomic(self._path, "".join(json.dumps(record) + "\n" for record in keep))
            self._records = keep
        return dropped

    def _store_seq(self, seq: int) -> None:
        write_atomic(self._seq_path, f"{seq}\n")
        self._last_seq = seq

    def _read_seq(self) -> int:
        try:
            with open(self._seq_path) as f:
                return int(f.read().strip())
        except FileNotFoundError:
            return 0
        except ValueError:
            logger.warning("unreadable seq file, continuing after the spooled reports")
            return 0

    def _load(self) -> list[dict[str, Any]]:
        try:
            with open(self._path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return []
        complete, _, torn = data.rpartition(b"\n")
        damaged = bool(torn)
        if torn:
            logger.warning(
                "dropping a torn last line of the usage spool", extra={"bytes": len(torn)}
            )
        records = []
        for line in complete.split(b"\n") if complete else []:
            try:
                record = UsageReport.from_payload(json.loads(line)).to_payload()
            except ValueError:
                logger.warning(
                    "skipping an unreadable usage spool line", extra={"line": line[:200]}
                )
                damaged = True
                continue
            records.append(record)
        records.sort(key=lambda record: record["seq"])
        if damaged:
            # Rewrite it clean, so the next append does not continue a torn line.
            write_atomic(self._path, "".join(json.dumps(record) + "\n" for record in records))
        return records


@dataclass(slots=True)
class RunRecord:
    """What the agent remembers about one run between heartbeats and across restarts."""

    rental_id: str
    gpu_indices: tuple[int, ...]
    stop_grace_s: float
    # Metrics delivered: from `cursor` (the driver's, opaque) on, `skip` metrics lines.
    cursor: str | None = None
    skip: int = 0
    line: int = 0  # the index of the output line at `cursor` (log lines are numbered from it)
    log_sent: int = -1  # the highest log line number the server has taken
    final_spooled: bool = False
    # Artifact sync (nodeagent.artifacts): asked for by the desired entry; the final sync
    # after the run ended is done (its exited state may then be reported).
    sync_artifacts: bool = False
    final_synced: bool = False
    # The run has team secrets (their values are kept in memory only): after a restart its
    # output is not read until the server has said them again, to mask it with.
    secrets: bool = False


class RunLedger:
    """RunRecords by run_id, persisted in runs.json when `flush()` finds changes."""

    def __init__(self, directory: str) -> None:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        self._path = os.path.join(directory, "runs.json")
        self._records = self._load()
        self._dirty = False

    def get(self, run_id: str) -> RunRecord | None:
        return self._records.get(run_id)

    def __contains__(self, run_id: object) -> bool:
        return run_id in self._records

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._records))

    def put(self, run_id: str, record: RunRecord) -> None:
        if self._records.get(run_id) != record:
            self._records[run_id] = record
            self._dirty = True

    def update(self, run_id: str, **changes: Any) -> None:
        record = self._records[run_id]
        for key, value in changes.items():
            if getattr(record, key) != value:
                setattr(record, key, value)
                self._dirty = True

    def remove(self, run_id: str) -> None:
        if self._records.pop(run_id, None) is not None:
            self._dirty = True

    def flush(self) -> None:
        if self._dirty:
            data = {run_id: asdict(record) for run_id, record in sorted(self._records.items())}
            write_atomic(self._path, json.dumps(data, indent=1) + "\n")
            self._dirty = False

    def _load(self) -> dict[str, RunRecord]:
        try:
            with open(self._path) as f:
                data = json.load(f)
            return {
                run_id: RunRecord(**{**fields, "gpu_indices": tuple(fields["gpu_indices"])})
                for run_id, fields in data.items()
            }
        except FileNotFoundError:
            return {}
        except (ValueError, TypeError, KeyError, AttributeError):
            # Written atomically, so this is damage; the next desired state refills it.
            logger.warning("unreadable run records, starting afresh", extra={"path": self._path})
            return {}
