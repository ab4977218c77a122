"""Runtime drivers: how the node agent runs a rental's container (Docker Engine or host process).

The agent talks to `RuntimeDriver` only; `create_driver` picks the implementation from settings.
No Django import anywhere in this package.
"""

from __future__ import annotations

from typing import Any

from nodeagent.runtime.base import (
    LABEL_MANAGED,
    LABEL_NODE,
    LABEL_RENTAL,
    LABEL_RUN,
    ContainerSpec,
    ContainerState,
    ImageNotFoundError,
    PermanentRuntimeError,
    RetryableRuntimeError,
    RunNotFoundError,
    RuntimeDriver,
    RuntimeDriverError,
)


def create_driver(kind: str, **options: Any) -> RuntimeDriver:
    """A driver by name: "docker" (options of DockerDriverConfig) or "process"
    (options of ProcessDriverConfig; state_dir required)."""
    # Imported here: hosts using the process driver need not have the docker SDK importable.
    if kind == "docker":
        from nodeagent.runtime.docker import DockerDriver, DockerDriverConfig

        return DockerDriver(DockerDriverConfig(**options))
    if kind == "process":
        from nodeagent.runtime.process import LocalProcessDriver, ProcessDriverConfig

        return LocalProcessDriver(ProcessDriverConfig(**options))
    raise ValueError(f"unknown runtime driver {kind!r} (docker, process)")


__all__ = [
    "LABEL_MANAGED",
    "LABEL_NODE",
    "LABEL_RENTAL",
    "LABEL_RUN",
    "ContainerSpec",
    "ContainerState",
    "ImageNotFoundError",
    "PermanentRuntimeError",
    "RetryableRuntimeError",
    "RunNotFoundError",
    "RuntimeDriver",
    "RuntimeDriverError",
    "create_driver",
]
