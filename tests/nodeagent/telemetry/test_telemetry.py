"""Telemetry sources: simulated GPUs, the watchdog, NVML's typed errors."""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Collection

import pytest

from agentprotocol import GpuSample
from nodeagent.telemetry import (
    GpuInventory,
    PermanentTelemetryError,
    RetryableTelemetryError,
    SampleWatchdog,
    SimulatedSource,
    TelemetrySource,
    create_source,
    parse_simulate_gpus,
)
from nodeagent.telemetry.nvml import NvmlSource, cuda_version_text


def test_parse_simulate_gpus():
    assert parse_simulate_gpus("h100-sxm5-80gb:8") == ("h100-sxm5-80gb", 8)
    assert parse_simulate_gpus(" rtx4090-24gb:1 ") == ("rtx4090-24gb", 1)
    for bad in ("h100-sxm5-80gb", "h100:0", "h100:65", "H100 SXM:2", ":4", "h100:x"):
        with pytest.raises(ValueError):
            parse_simulate_gpus(bad)


def test_simulated_discovery_is_deterministic_per_host_and_flagged():
    source = SimulatedSource(hostname="fra-01", model_slug="h100-sxm5-80gb", count=8)
    inventory = source.discover()
    assert source.simulated is True
    assert isinstance(source, TelemetrySource)
    assert inventory.driver_version == "simulated"
    assert inventory.cuda_version == "12.4"
    assert [g.index for g in inventory.gpus] == list(range(8))
    assert {g.name for g in inventory.gpus} == {"h100-sxm5-80gb"}  # the catalog slug
    assert {g.memory_mb for g in inventory.gpus} == {80 * 1024}
    assert {g.topology_group for g in inventory.gpus} == {"nvl0"}  # one NVSwitch island
    uuids = [g.uuid for g in inventory.gpus]
    assert len(set(uuids)) == 8 and all(u.startswith("GPU-") for u in uuids)
    # the same host gets the same UUIDs after a restart, another host different ones
    assert [
        g.uuid
        for g in SimulatedSource(hostname="fra-01", model_slug="h100-sxm5-80gb", count=8)
        .discover()
        .gpus
    ] == uuids
    other = SimulatedSource(hostname="fra-02", model_slug="h100-sxm5-80gb", count=8)
    assert not set(uuids) & {g.uuid for g in other.discover().gpus}


def test_simulated_topology_follows_the_card():
    bridged = SimulatedSource(hostname="h", model_slug="rtx3090-24gb", count=4).discover()
    assert [g.topology_group for g in bridged.gpus] == ["nvl0", "nvl0", "nvl1", "nvl1"]
    pcie = SimulatedSource(hostname="h", model_slug="l40s-48gb", count=2).discover()
    assert [g.topology_group for g in pcie.gpus] == ["", ""]


def test_simulated_unknown_slug_uses_its_memory_suffix():
    gpus = SimulatedSource(hostname="h", model_slug="b200-sxm-192gb", count=1).discover().gpus
    assert gpus[0].memory_mb == 192 * 1024
    with pytest.raises(PermanentTelemetryError, match="unknown GPU model"):
        SimulatedSource(hostname="h", model_slug="mystery-card", count=1)


def test_simulated_samples_show_busy_and_idle_gpus():
    source = SimulatedSource(
        hostname="h", model_slug="a100-sxm4-80gb", count=2, clock=lambda: 1_700_000_000.0
    )
    idle, busy = source.sample(busy={1})
    assert (idle.gpu_index, busy.gpu_index) == (0, 1)
    assert idle.ts == busy.ts == 1_700_000_000.0
    assert idle.util_pct == 0.0 and idle.mem_used_mb == 0
    assert idle.power_w == 40.0  # 10 % of the A100's 400 W
    assert 82 <= busy.util_pct <= 98
    assert 0.7 * 80 * 1024 <= busy.mem_used_mb <= 0.8 * 80 * 1024
    assert idle.power_w < busy.power_w <= 400
    assert idle.temp_c < busy.temp_c
    for sample in (idle, busy):
        assert (sample.ecc_errors, sample.xid_errors, sample.healthy) == (0, 0, True)
    # deterministic for a given time
    assert source.sample(busy={1}) == [idle, busy]
    assert set(busy.to_payload()) == {
        "gpu_index", "ts", "util_pct", "mem_used_mb", "power_w", "temp_c", "ecc_errors",
        "xid_errors", "healthy",
    }  # fmt: skip


def test_create_source():
    source = create_source("simulated", hostname="h", simulate_gpus="t4-16gb:2")
    assert isinstance(source, SimulatedSource) and len(source.discover().gpus) == 2
    with pytest.raises(ValueError, match="simulate-gpus"):
        create_source("simulated", hostname="h")
    with pytest.raises(ValueError, match="unknown telemetry source"):
        create_source("dcgm", hostname="h")


class _SlowSource:
    """A TelemetrySource whose sample blocks until released, like a hung NVML call."""

    simulated = True

    def __init__(self) -> None:
        self.release = threading.Event()
        self.calls = 0

    def discover(self) -> GpuInventory:
        return GpuInventory("", "", ())

    def sample(self, busy: Collection[int] = ()) -> list[GpuSample]:
        self.calls += 1
        self.release.wait(10)
        return []

    def close(self) -> None:
        self.release.set()


class _FailingSource(_SlowSource):
    def sample(self, busy: Collection[int] = ()) -> list[GpuSample]:
        raise RetryableTelemetryError("NVML timeout")


def test_watchdog_gives_up_on_a_hung_source_and_does_not_pile_up_calls():
    source = _SlowSource()
    watchdog = SampleWatchdog(source, timeout_s=0.2)
    began = time.monotonic()
    assert watchdog.sample() == []
    assert time.monotonic() - began < 1.0
    # while the first call is stuck, no second call is queued behind it
    assert watchdog.sample() == []
    assert source.calls == 1
    # once it comes back, sampling resumes
    source.release.set()
    time.sleep(0.1)
    assert watchdog.sample() == []
    assert source.calls == 2
    watchdog.close()


def test_watchdog_turns_source_errors_into_no_samples():
    watchdog = SampleWatchdog(_FailingSource(), timeout_s=1.0)
    assert watchdog.sample() == []
    watchdog.close()


def _nvml_present() -> bool:
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return False
    return True


def test_nvml_source_on_this_host():
    if _nvml_present():
        # a GPU host: discovery and sampling work and agree
        source = NvmlSource()
        inventory = source.discover()
        assert inventory.gpus and inventory.driver_version
        samples = source.sample()
        assert [s.gpu_index for s in samples] == [g.index for g in inventory.gpus]
        assert all(0 <= s.util_pct <= 100 and s.mem_used_mb >= 0 for s in samples)
        source.close()
    else:
        # no NVIDIA driver: a permanent, typed error at once, no retry loop
        slept: list[float] = []
        with pytest.raises(PermanentTelemetryError, match="NVML init"):
            NvmlSource(sleep=slept.append)
        assert slept == []


def test_cuda_version_text():
    assert cuda_version_text(12040) == "12.4"
    assert cuda_version_text(11080) == "11.8"
    assert cuda_version_text(12090) == "12.9"
