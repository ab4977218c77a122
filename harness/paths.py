"""Where a run reads its datasets and writes its output: one pair of names on every runtime.

The node agent sets two variables in every rental, whatever runs it:

* ``GPUMARKET_DATA_DIR``: the rental's datasets, one read-only directory per dataset name
  (``/data`` in a container, where they are mounted at ``/data/NAME``);
* ``GPUMARKET_WORKSPACE``: the rental's writable output directory, also the run's working
  directory (``/workspace`` in a container). Everything in it (checkpoints, final model, logs)
  is synced to object storage at every checkpoint and when the run ends.

A rental run as a host process (the agent's development runtime) cannot have ``/data`` and
``/workspace`` (making root-level paths needs root); there the variables name host directories.
The harness resolves every path through this module, so it behaves the same on both runtimes.
Outside a rental (no variables): ``/data``, and the working directory for the output (which is
``/workspace`` in the harness image).

No torch import: the config module (validated without torch) uses it.
"""

from __future__ import annotations

import os
from pathlib import Path

DATA_DIR_ENV = "GPUMARKET_DATA_DIR"
WORKSPACE_ENV = "GPUMARKET_WORKSPACE"
CHECKPOINT_DIR_ENV = "HARNESS_CHECKPOINT_DIR"
DEFAULT_DATA_DIR = "/data"

# Inside the output directory: what the artifacts of a completed rental list.
CHECKPOINT_SUBDIR = "checkpoints"
FINAL_SUBDIR = "final"  # final/model.pt (the model's state dict) and final/config.json
LOG_SUBDIR = "logs"  # logs/metrics.jsonl (the JSON-line events) and logs/harness.log
METRICS_LOG = "metrics.jsonl"
HUMAN_LOG = "harness.log"


def data_dir() -> Path:
    """The directory holding the rental's datasets."""
    return Path(os.environ.get(DATA_DIR_ENV) or DEFAULT_DATA_DIR)


def output_dir() -> Path:
    """The directory the run writes its output to (synced to object storage in a rental)."""
    return Path(os.environ.get(WORKSPACE_ENV) or ".")


def default_checkpoint_dir() -> str:
    """``HARNESS_CHECKPOINT_DIR``, else ``checkpoints`` in the output directory."""
    explicit = os.environ.get(CHECKPOINT_DIR_ENV)
    if explicit:
        return explicit
    workspace = os.environ.get(WORKSPACE_ENV)
    return os.path.join(workspace, CHECKPOINT_SUBDIR) if workspace else f"./{CHECKPOINT_SUBDIR}"
