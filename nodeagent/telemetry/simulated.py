"""Simulated GPUs: a node without NVIDIA hardware that still joins, rents and reports.

The one-command dev stack and the tests run on such nodes. GPUs are a catalog model (its slug is
the name, which the server matches exactly), UUIDs are derived from hostname and index (stable
across agent restarts, distinct across hosts), and readings are smooth functions of time, so a
dashboard shows plausible curves: busy GPUs near full load, idle ones cool and quiet. The join
payload carries `simulated: true`, so the node is flagged as such wherever it is shown. Its
benchmark is simulated too (`simulated_benchmark`): a plausible figure for the card, marked so.
"""

from __future__ import annotations

import hashlib
import math
import random
import re
import time
from collections.abc import Callable, Collection
from typing import Any

from agentprotocol import GpuInfo, GpuSample, simulated_gpu_uuid
from nodeagent.telemetry.base import (
    GpuInventory,
    PermanentTelemetryError,
)

# slug -> (memory GB, board power W, NVLink: "switch" all GPUs, "bridge" pairs, "" none,
# dense BF16/FP16 tensor TFLOPS (GeForce cards: the FP32-accumulate figure, what training uses),
# BF16 support); figures as in the server's catalog (vendors' datasheets). Slugs missing here
# still work: memory is read from the slug's "<n>gb" suffix and the rest defaulted, and they
# have no benchmark.
_MODELS: dict[str, tuple[int, int, str, float, bool]] = {
    "v100-sxm2-16gb": (16, 300, "switch", 125.0, False),
    "v100-sxm2-32gb": (32, 300, "switch", 125.0, False),
    "v100-pcie-16gb": (16, 250, "", 112.0, False),
    "v100-pcie-32gb": (32, 250, "", 112.0, False),
    "a100-sxm4-40gb": (40, 400, "switch", 312.0, True),
    "a100-sxm4-80gb": (80, 400, "switch", 312.0, True),
    "a100-pcie-40gb": (40, 250, "bridge", 312.0, True),
    "a100-pcie-80gb": (80, 300, "bridge", 312.0, True),
    "h100-sxm5-80gb": (80, 700, "switch", 989.0, True),
    "h100-pcie-80gb": (80, 350, "bridge", 756.0, True),
    "h200-sxm-141gb": (141, 700, "switch", 989.0, True),
    "l40s-48gb": (48, 350, "", 362.0, True),
    "a10-24gb": (24, 150, "", 125.0, True),
    "t4-16gb": (16, 70, "", 65.0, False),
    "rtx3090-24gb": (24, 350, "bridge", 71.0, True),
    "rtx3080ti-12gb": (12, 350, "", 68.0, True),
    "rtx4090-24gb": (24, 450, "", 165.2, True),
    "rtx-a6000-48gb": (48, 300, "bridge", 154.8, True),
}
_DEFAULT_POWER_W = 300
_SLUG_RE = re.compile(r"^[a-z0-9][a-z0-9-]*$")
_MEMORY_RE = re.compile(r"(\d+)gb$")

SIMULATED_DRIVER_VERSION = "simulated"
SIMULATED_CUDA_VERSION = "12.4"


def simulated_host(gpus: int) -> dict[str, int]:
    """The host a simulated GPU server declares at join: sized like a GPU server (16 cores,
    128 GB of memory and 1 TB of disk per GPU), not like the machine that simulates it, whose
    few cores would look absurd beside eight H100s. Nothing reads them to run a rental there:
    the local-process runtime limits nothing."""
    return {"cpu_cores": 16 * gpus, "ram_gb": 128 * gpus, "disk_gb": 1000 * gpus}


def parse_simulate_gpus(value: str) -> tuple[str, int]:
    """ "h100-sxm5-80gb:8" -> ("h100-sxm5-80gb", 8)."""
    slug, sep, count = value.strip().rpartition(":")
    if not sep or not _SLUG_RE.match(slug) or not count.isdigit() or not 1 <= int(count) <= 64:
        raise ValueError(
            f"expected MODEL-SLUG:COUNT (1-64 GPUs), e.g. h100-sxm5-80gb:8, not {value!r}"
        )
    return slug, int(count)


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
            memory_gb, power_w, link, _, _ = _MODELS[model_slug]
        else:
            match = _MEMORY_RE.search(model_slug)
            if match is None:
                raise PermanentTelemetryError(
                    f"unknown GPU model {model_slug!r}: use a catalog slug ending in its memory, "
                    "e.g. h100-sxm5-80gb"
                )
            memory_gb, power_w, link = int(match.group(1)), _DEFAULT_POWER_W, ""
        self.model_slug = model_slug
        self.hostname = hostname
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

    def benchmark(self) -> dict[str, Any]:
        """The node benchmark of these GPUs (see `simulated_benchmark`)."""
        return simulated_benchmark(hostname=self.hostname, model_slug=self.model_slug)

    def close(self) -> None:
        """Nothing to release."""


# A simulated node's benchmark: this share of its card's dense tensor peak, fixed per host in
# the band that real cards reach on the harness's matmul, with a little noise per run.
BENCHMARK_SHARE_LOW, BENCHMARK_SHARE_HIGH = 0.62, 0.78
BENCHMARK_NOISE = 0.01


def simulated_benchmark(
    *, hostname: str, model_slug: str, rng: random.Random | None = None
) -> dict[str, Any]:
    """A benchmark result for a simulated node, in the shape of the harness's benchmark event
    and marked `simulated: true`.

    There is no GPU to measure, and a real matmul on the host's CPU is 1,000 times below any
    card's figure, which the server rightly refuses as implausible. The result is instead the
    card's datasheet peak times a share drawn once per host in 62-78 % (so the dev stack's nodes
    differ, and one node stays put), plus 1 % noise. The server believes a result marked
    simulated from nodes that joined as simulated only (provisioning's benchmark_record)."""
    if model_slug not in _MODELS:
        raise ValueError(f"no simulated benchmark for {model_slug!r}: its peak is not known")
    peak, bf16 = _MODELS[model_slug][3], _MODELS[model_slug][4]
    digest = hashlib.sha256(f"{hostname}/{model_slug}".encode()).digest()
    share = BENCHMARK_SHARE_LOW + (BENCHMARK_SHARE_HIGH - BENCHMARK_SHARE_LOW) * (
        int.from_bytes(digest[:8], "big") / 2**64
    )
    noise = (rng or random.Random()).uniform(-BENCHMARK_NOISE, BENCHMARK_NOISE)
    return {
        "event": "benchmark",
        "simulated": True,
        "device": "simulated",
        "device_name": f"{model_slug} (simulated)",
        "precision": "bf16" if bf16 else "fp16",
        "quick": True,
        "matmul_tflops": round(peak * share * (1 + noise), 2),
        "mem_bandwidth_gbs": None,
        "h2d_gbs": None,
        "train_samples_per_s": None,
        "peak_tflops": peak,
        "peak_tflops_source": "datasheet",
        "notes": {
            "simulated": "no GPU was measured: a simulated node reports a fixed share (62-78 %, "
            "per host) of its card's dense tensor peak"
        },
        "time": round(time.time(), 3),
    }


def _topology_group(link: str, index: int) -> str:
    if link == "switch":
        return "nvl0"  # an NVSwitch board: every GPU reaches every other one
    if link == "bridge":
        return f"nvl{index // 2}"  # NVLink bridges join pairs of cards
    return ""
