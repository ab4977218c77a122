"""Checkpoint files: atomic writes, retention of the last K, and finding the latest good one.

A checkpoint is one ``torch.save`` file ``step_<step>.pt``. It is written to a temporary file in
the same directory, flushed and fsynced, then renamed over the final name (``os.replace`` is
atomic on POSIX), and the directory is fsynced so the rename survives a crash. A reader therefore
sees either a complete checkpoint or none; a half-written temporary file left by a killed process
is removed at the next start. A completed run also writes its final model (``save_final_model``)
the same way. Files are loaded with ``weights_only=True``: they hold only tensors
and plain Python values, so loading cannot execute code.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import torch

from harness.metrics import json_safe

log = logging.getLogger("harness")

_NAME = re.compile(r"^step_(\d+)\.pt$")
_TMP_PREFIX = ".step_"
_TMP_SUFFIX = ".tmp"
_FINAL_TMP_PREFIX = ".final_"
FINAL_MODEL = "model.pt"
FINAL_CONFIG = "config.json"
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


def _write_atomic(final: Path, write: Callable[[IO[bytes]], None], prefix: str) -> None:
    """Write a file through a temporary beside it (fsync, rename, fsync of the directory)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    handle = tempfile.NamedTemporaryFile(  # noqa: SIM115 - closed explicitly before the rename
        dir=final.parent, prefix=prefix, suffix=_TMP_SUFFIX, delete=False
    )
    try:
        with handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(handle.name, final)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(handle.name)
        raise
    _fsync_directory(final.parent)


def save_checkpoint(state: dict[str, Any], directory: Path, step: int, keep: int) -> Path:
    """Atomically write ``state`` as the checkpoint of ``step``; keep only the newest ``keep``."""
    final = checkpoint_path(directory, step)
    _write_atomic(
        final, lambda f: torch.save({"format_version": FORMAT_VERSION, **state}, f), _TMP_PREFIX
    )
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
    directory: Path, map_location: torch.device | str = "cpu", among: set[int] | None = None
) -> tuple[dict[str, Any], Path] | None:
    """The newest readable checkpoint, skipping (with a warning) any that fail to load; of the
    steps `among` when given (those every rank has)."""
    for step, path in reversed(list_checkpoints(directory)):
        if among is not None and step not in among:
            continue
        try:
            return load_checkpoint(path, map_location), path
        except Exception as exc:  # a truncated or foreign file must not block resuming
            log.warning("skipping unreadable checkpoint %s: %s", path, exc)
    return None


def save_final_model(
    model_state: dict[str, Any], description: dict[str, Any], directory: Path
) -> Path:
    """Write a completed run's model: ``model.pt``, the model's state dict alone (load it with
    ``torch.load(path, weights_only=True)`` into the model that ``config.json`` describes), and
    ``config.json``, the harness config and where the run ended. Atomic like a checkpoint, so
    the artifact sync never uploads half a file; returns the model's path."""
    model_path = directory / FINAL_MODEL
    _write_atomic(model_path, lambda f: torch.save(model_state, f), _FINAL_TMP_PREFIX)
    text = json.dumps(json_safe(description), indent=2, sort_keys=True, allow_nan=False) + "\n"
    _write_atomic(directory / FINAL_CONFIG, lambda f: f.write(text.encode()), _FINAL_TMP_PREFIX)
    return model_path
