"""Sharded checkpoints of the transformer: ``torch.distributed.checkpoint`` (DCP), one directory
per step.

``step_<N>/`` holds the DCP files (each rank writes its own shards of the model and optimizer
state; ``.metadata`` maps every fully qualified parameter name to its pieces) and
``harness.pt``, rank 0's file of everything else (step, LR schedule, every rank's RNG state,
data position, config; loadable with ``weights_only=True``). State dicts come from
``torch.distributed.checkpoint.state_dict``, which names parameters without wrapper prefixes and
flattens the optimizer state per parameter name, so a checkpoint written by one layout and world
size loads into any other: DCP reshards on load.

Completeness works as for file checkpoints (harness.checkpoint): every rank writes into
``.step_<N>.tmp/``; DCP returns on all ranks once rank 0 has written ``.metadata``; rank 0 then
adds ``harness.pt`` and renames the directory to ``step_<N>/`` (atomic), so a reader sees a whole
step or none, and a temporary directory left by a killed job is removed at the next start.

Across nodes without a shared file system each node holds only its own ranks' shards. Once rank
0 has completed the step, the first rank of every other node renames its node's temporary
directory to ``step_<N>/`` too (``finish_node_part``) and keeps its newest ``keep`` parts: each
node's output then holds its part of one checkpoint under one step, the files named by global
rank, so the parts synced out of every node make up the whole step and none overwrites another.
Such a part alone is no complete step here (no ``.metadata``, no ``harness.pt``); a resumed job
gets every file of the step on every node.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

log = logging.getLogger("harness")

_NAME = re.compile(r"^step_(\d+)$")
_TMP = re.compile(r"^\.step_\d+\.tmp$")
EXTRA = "harness.pt"
METADATA = ".metadata"
FORMAT_VERSION = 1
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def step_dir(directory: Path, step: int) -> Path:
    return directory / f"step_{step:09d}"


def list_steps(directory: Path) -> list[tuple[int, Path]]:
    """(step, directory) of every complete sharded checkpoint, oldest first."""
    if not directory.is_dir():
        return []
    found = []
    for entry in directory.iterdir():
        match = _NAME.match(entry.name)
        if match and (entry / METADATA).is_file() and (entry / EXTRA).is_file():
            found.append((int(match.group(1)), entry))
    return sorted(found)


def remove_stale_temporaries(directory: Path) -> None:
    """Delete the directories of writes that never completed (called by rank 0 at start)."""
    if not directory.is_dir():
        return
    for entry in directory.iterdir():
        if _TMP.match(entry.name) and entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_sharded(
    *,
    directory: Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    extra: dict[str, Any] | None,
    keep: int,
) -> Path:
    """Write this rank's shards (collective: every rank calls it); rank 0 passes ``extra`` and
    completes the step directory, the others pass None. Returns the final directory."""
    final = step_dir(directory, step)
    temporary = directory / f".step_{step:09d}.tmp"
    model_state, optim_state = get_state_dict(model, optimizer, options=_OPTIONS)
    dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(temporary))
    if extra is None:
        return final
    with open(temporary / EXTRA, "wb") as handle:
        torch.save({"format_version": FORMAT_VERSION, **extra}, handle)
        handle.flush()
        os.fsync(handle.fileno())
    _replace_directory(temporary, final)
    _fsync_directory(directory)
    for _, old in list_steps(directory)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _replace_directory(temporary: Path, final: Path) -> None:
    """Rename `temporary` to `final`; a directory already there (a part an earlier placement of
    a resumed job wrote for the same step) is replaced, not merged."""
    if final.exists():
        shutil.rmtree(final)
    os.replace(temporary, final)


def finish_node_part(*, directory: Path, step: int, keep: int) -> Path | None:
    """On the first rank of a node other than rank 0's, once rank 0 has completed the step:
    move this node's shards of it from the temporary directory to the step's, and keep the
    newest ``keep`` step directories here. None when there is no temporary directory (a file
    system shared with rank 0's node, where rank 0 renamed it already)."""
    temporary = directory / f".step_{step:09d}.tmp"
    if not temporary.is_dir():
        return None
    final = step_dir(directory, step)
    _replace_directory(temporary, final)
    _fsync_directory(directory)
    parts = sorted(
        (int(match.group(1)), entry)
        for entry in directory.iterdir()
        if (match := _NAME.match(entry.name)) and entry.is_dir()
    )
    for _, old in parts[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_extra(path: Path) -> dict[str, Any]:
    state = torch.load(path / EXTRA, map_location="cpu", weights_only=True)
    if not isinstance(state, dict) or state.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path} is not a harness sharded checkpoint of format {FORMAT_VERSION}")
    return state


def latest_readable(directory: Path, among: set[int] | None = None) -> Path | None:
    """The newest complete step directory whose ``harness.pt`` loads (rank 0 decides), of the
    steps `among` when given (those every rank has)."""
    for step, path in reversed(list_steps(directory)):
        if among is not None and step not in among:
            continue
        try:
            load_extra(path)
        except Exception as exc:  # a damaged step must not block resuming from an older one
            log.warning("skipping unreadable checkpoint %s: %s", path, exc)
            continue
        return path
    return None


def load_sharded(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load the model and optimizer state into this rank's (possibly differently sharded) model;
    collective: every rank calls it."""
    model_state, optim_state = get_state_dict(model, optimizer, options=_OPTIONS)
    state = {"model": model_state, "optimizer": optim_state}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(
        model,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optimizer"],
        options=_OPTIONS,
    )


def directory_bytes(path: Path) -> int:
    total = 0
    for entry in path.rglob("*"):
        with contextlib.suppress(OSError):
            if entry.is_file():
                total += entry.stat().st_size
    return total
