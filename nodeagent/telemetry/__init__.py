"""GPU telemetry for the node agent: discovery (the join payload) and readings (heartbeats).

Two sources behind `TelemetrySource`: `NvmlSource` (real NVIDIA GPUs through NVML) and
`SimulatedSource` (fake GPUs of a catalog model, flagged simulated). No Django import.
"""

from __future__ import annotations

from nodeagent.telemetry.base import (
    GpuInventory,
    PermanentTelemetryError,
    RetryableTelemetryError,
    SampleWatchdog,
    TelemetryError,
    TelemetrySource,
)
from nodeagent.telemetry.simulated import SimulatedSource, parse_simulate_gpus


def create_source(kind: str, *, hostname: str, simulate_gpus: str | None = None) -> TelemetrySource:
    """ "nvml" (the host's GPUs) or "simulated" (simulate_gpus: "MODEL-SLUG:COUNT")."""
    if kind == "nvml":
        # Imported here: pynvml loads libnvidia-ml lazily, but keep simulated hosts free of it.
        from nodeagent.telemetry.nvml import NvmlSource

        return NvmlSource()
    if kind == "simulated":
        if not simulate_gpus:
            raise ValueError("simulated telemetry needs --simulate-gpus, e.g. h100-sxm5-80gb:8")
        slug, count = parse_simulate_gpus(simulate_gpus)
        return SimulatedSource(hostname=hostname, model_slug=slug, count=count)
    raise ValueError(f"unknown telemetry source {kind!r} (nvml, simulated)")


__all__ = [
    "GpuInventory",
    "PermanentTelemetryError",
    "RetryableTelemetryError",
    "SampleWatchdog",
    "SimulatedSource",
    "TelemetryError",
    "TelemetrySource",
    "create_source",
    "parse_simulate_gpus",
]
