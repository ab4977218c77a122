"""Checkpoint files: atomic writes, retention of the last K, and finding the latest good one.

A checkpoint is one ``torch.save`` file ``step_<step>.pt``. It is written to a temporary file in
the same directory, flushed and fsynced, then renamed over the final name (``os.replace`` is
atomic on POSIX), and the directory is fsynced so the rename survives a crash. A reader therefore
sees either a complete checkpoint or none; a half-written temporary file left by a killed process
is removed at the next start. Files are loaded with ``weights_only=True``: they hold only tensors
and plain Python values, so loading cannot execute code.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("harness")

_NAME = re.compile(r"^step_(\d+)\.pt$")
_TMP_PREFIX = ".step_"
_TMP_SUFFIX = ".tmp"
FORMAT_VERSION = 1


def checkpoint_path(directory: Path, step: int) -> Path:
    return directory / f"step_{step:09d}.pt"


def list_checkpoints(directory: Path) -> list[tuple[int, Path]]:
    """(step, path) of every complete checkpoint, oldest first."""
    if not directory.is_dir():
        return []
    found = []
    for entry in directory.iterdir():
        match = _NAME.match(entry.name)
        if match and entry.is_file():
            found.append((int(match.group(1)), entry))
    return sorted(found)


def remove_stale_temporaries(directory: Path) -> None:
    """Delete temporary files of writes that never completed (only rank 0 writes, so at start
    nothing else can be writing)."""
    if not directory.is_dir():
        return
    for entry in directory.iterdir():
        if entry.name.startswith(_TMP_PREFIX) and entry.name.endswith(_TMP_SUFFIX):
            with contextlib.suppress(FileNotFoundError):
                entry.unlink()


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(state: dict[str, Any], directory: Path, step: int, keep: int) -> Path:
    """Atomically write ``state`` as the checkpoint of ``step``; keep only the newest ``keep``."""
    directory.mkdir(parents=True, exist_ok=True)
    final = checkpoint_path(directory, step)
    handle = tempfile.NamedTemporaryFile(  # noqa: SIM115 - closed explicitly before the rename
        dir=directory, prefix=_TMP_PREFIX, suffix=_TMP_SUFFIX, delete=False
    )
    try:
        with handle:
            torch.save({"format_version": FORMAT_VERSION, **state}, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(handle.name, final)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(handle.name)
        raise
    _fsync_directory(directory)
    for _, old in list_checkpoints(directory)[:-keep]:
        with contextlib.suppress(FileNotFoundError):
            old.unlink()
    return final


def load_checkpoint(path: Path, map_location: torch.device | str = "cpu") -> dict[str, Any]:
    state = torch.load(path, map_location=map_location, weights_only=True)
    if not isinstance(state, dict) or state.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path} is not a harness checkpoint of format {FORMAT_VERSION}")
    return state


def load_latest(
    directory: Path, map_location: torch.device | str = "cpu"
) -> tuple[dict[str, Any], Path] | None:
    """The newest readable checkpoint, skipping (with a warning) any that fail to load."""
    for _, path in reversed(list_checkpoints(directory)):
        try:
            return load_checkpoint(path, map_location), path
        except Exception as exc:  # a truncated or foreign file must not block resuming
            log.warning("skipping unreadable checkpoint %s: %s", path, exc)
    return None
