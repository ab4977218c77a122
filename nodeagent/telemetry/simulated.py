"""Simulated GPUs: a node without NVIDIA hardware that still joins, rents and reports.

The one-command dev stack and the tests run on such nodes. GPUs are a catalog model (its slug is
the name, which the server matches exactly), UUIDs are derived from hostname and index (stable
across agent restarts, distinct across hosts), and readings are smooth functions of time, so a
dashboard shows plausible curves: busy GPUs near full load, idle ones cool and quiet. The join
payload carries `simulated: true`, so the node is flagged as such wherever it is shown.
"""

from __future__ import annotations

import math
import re
import time
import uuid
from collections.abc import Callable, Collection

from agentprotocol import GpuInfo, GpuSample
from nodeagent.telemetry.base import (
    GpuInventory,
    PermanentTelemetryError,
)

# Namespace of the simulated GPU UUIDs (uuid5 of "hostname/index" in it).
_UUID_NAMESPACE = uuid.UUID("6f1d2c3e-9a4b-5c7d-8e9f-0a1b2c3d4e5f")

# slug -> (memory GB, board power W, NVLink: "switch" all GPUs, "bridge" pairs, "" none);
# figures as in the server's catalog. Slugs missing here still work: memory is read from the
# slug's "<n>gb" suffix and the rest defaulted.
_MODELS: dict[str, tuple[int, int, str]] = {
    "v100-sxm2-16gb": (16, 300, "switch"),
    "v100-sxm2-32gb": (32, 300, "switch"),
    "v100-pcie-16gb": (16, 250, ""),
    "v100-pcie-32gb": (32, 250, ""),
    "a100-sxm4-40gb": (40, 400, "switch"),
    "a100-sxm4-80gb": (80, 400, "switch"),
    "a100-pcie-40gb": (40, 250, "bridge"),
    "a100-pcie-80gb": (80, 300, "bridge"),
    "h100-sxm5-80gb": (80, 700, "switch"),
    "h100-pcie-80gb": (80, 350, "bridge"),
    "h200-sxm-141gb": (141, 700, "switch"),
    "l40s-48gb": (48, 350, ""),
    "a10-24gb": (24, 150, ""),
    "t4-16gb": (16, 70, ""),
    "rtx3090-24gb": (24, 350, "bridge"),
    "rtx3080ti-12gb": (12, 350, ""),
    "rtx4090-24gb": (24, 450, ""),
    "rtx-a6000-48gb": (48, 300, "bridge"),
}
_DEFAULT_POWER_W = 300
_SLUG_RE = re.compile(r"^[a-z0-9][a-z0-9-]*$")
_MEMORY_RE = re.compile(r"(\d+)gb$")

SIMULATED_DRIVER_VERSION = "simulated"
SIMULATED_CUDA_VERSION = "12.4"


def parse_simulate_gpus(value: str) -> tuple[str, int]:
    """ "h100-sxm5-80gb:8" -> ("h100-sxm5-80gb", 8)."""
    slug, sep, count = value.strip().rpartition(":")
    if not sep or not _SLUG_RE.match(slug) or not count.isdigit() or not 1 <= int(count) <= 64:
        raise ValueError(
            f"expected MODEL-SLUG:COUNT (1-64 GPUs), e.g. h100-sxm5-80gb:8, not {value!r}"
        )
    return slug, int(count)


def simulated_gpu_uuid(hostname: str, index: int) -> str:
    return f"GPU-{uuid.uuid5(_UUID_NAMESPACE, f'{hostname}/{index}')}"


class SimulatedSource:
    """TelemetrySource of `count` fake GPUs of one catalog model."""

    simulated = True

    def __init__(
        self,
        *,
        hostname: str,
        model_slug: str,
        count: int,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if model_slug in _MODELS:
            memory_gb, power_w, link = _MODELS[model_slug]
        else:
            match = _MEMORY_RE.search(model_slug)
            if match is None:
                raise PermanentTelemetryError(
                    f"unknown GPU model {model_slug!r}: use a catalog slug ending in its memory, "
                    "e.g. h100-sxm5-80gb"
                )
            memory_gb, power_w, link = int(match.group(1)), _DEFAULT_POWER_W, ""
        self.model_slug = model_slug
        self.memory_mb = memory_gb * 1024
        self.max_power_w = float(power_w)
        self._clock = clock
        self._gpus = tuple(
            GpuInfo(
                index=i,
                uuid=simulated_gpu_uuid(hostname, i),
                name=model_slug,
                memory_mb=self.memory_mb,
                topology_group=_topology_group(link, i),
            )
            for i in range(count)
        )
        # Per-GPU phase, so the GPUs' curves do not move in lockstep.
        self._phase = [int(g.uuid[-8:], 16) % 628 / 100 for g in self._gpus]

    def discover(self) -> GpuInventory:
        return GpuInventory(
            driver_version=SIMULATED_DRIVER_VERSION,
            cuda_version=SIMULATED_CUDA_VERSION,
            gpus=self._gpus,
        )

    def sample(self, busy: Collection[int] = ()) -> list[GpuSample]:
        now = self._clock()
        samples = []
        for gpu in self._gpus:
            wave = math.sin(now / 20 + self._phase[gpu.index])
            if gpu.index in busy:
                util = 90 + 8 * wave
                mem_used = int(self.memory_mb * (0.75 + 0.05 * wave))
            else:
                util = 0.0
                mem_used = 0
            idle_w = 0.1 * self.max_power_w
            samples.append(
                GpuSample(
                    gpu_index=gpu.index,
                    ts=now,
                    util_pct=round(util, 1),
                    mem_used_mb=mem_used,
                    power_w=round(idle_w + (self.max_power_w - idle_w) * util / 100, 1),
                    temp_c=round(32 + 0.4 * util + 1.5 * wave, 1),
                    ecc_errors=0,
                    xid_errors=0,
                    healthy=True,
                )
            )
        return samples

    def close(self) -> None:
        """Nothing to release."""


def _topology_group(link: str, index: int) -> str:
    if link == "switch":
        return "nvl0"  # an NVSwitch board: every GPU reaches every other one
    if link == "bridge":
        return f"nvl{index // 2}"  # NVLink bridges join pairs of cards
    return ""
