"""NVML telemetry (`pynvml`, from nvidia-ml-py): the GPUs of a real NVIDIA host.

Every NVML call goes through `_nvml()`, which turns `NVMLError` into our typed errors: permanent
(no library, no permission) or retryable (anything else). Initialisation is retried with bounded
exponential backoff, since an agent started at boot may come up before the driver is loaded.

Readings are best effort per field: a counter the card does not have (ECC on GeForce cards, power
on some boards) reads as 0 and does not make the GPU unhealthy; a field that fails for another
reason (unknown error) does, and GPU_IS_LOST reports the GPU fallen off the bus. A GPU is also
unhealthy after a fatal Xid (agentprotocol.FATAL_XIDS), with volatile uncorrected ECC errors, or
when row remapping has failed. The health signals go to the server as read (throttle reasons,
PCIe link, pending repairs, the first fatal Xid): the server decides what they mean.

Topology groups come from the NVLink graph: for each active link, NVML tells the PCI address at
the other end, which is either another GPU or an NVSwitch. GPUs connected through any chain of
links (so every GPU of an NVSwitch board) form one island, named "nvl0", "nvl1", ... in order of
their lowest GPU index; GPUs without NVLink peers get "". This is best effort: a host whose
driver does not report NVLink state is listed without groups.

The calls block in C and cannot be cancelled; `SampleWatchdog` bounds how long a heartbeat waits.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Collection
from typing import Any, TypeVar

import pynvml

from agentprotocol import FATAL_XIDS, GpuInfo, GpuSample
from nodeagent.telemetry.base import (
    GpuInventory,
    PermanentTelemetryError,
    RetryableTelemetryError,
    TelemetryError,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")

_MIB = 1024 * 1024

# Errors no retry can fix on this host as it is.
_PERMANENT = {
    pynvml.NVML_ERROR_LIBRARY_NOT_FOUND,
    pynvml.NVML_ERROR_NO_PERMISSION,
    pynvml.NVML_ERROR_FUNCTION_NOT_FOUND,
}
# A counter this card or driver does not have: reads as its default, the GPU is still healthy.
_ABSENT = {
    pynvml.NVML_ERROR_NOT_SUPPORTED,
    pynvml.NVML_ERROR_NO_PERMISSION,
    pynvml.NVML_ERROR_FUNCTION_NOT_FOUND,
    pynvml.NVML_ERROR_NO_DATA,
}
# NVML itself went away (driver unloaded or upgraded): re-initialise on the next sample.
_LIBRARY_GONE = {
    pynvml.NVML_ERROR_UNINITIALIZED,
    pynvml.NVML_ERROR_DRIVER_NOT_LOADED,
    pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH,
}


# Events drained per sample: a storm of Xids must not hold up the heartbeat.
_MAX_EVENTS_PER_SAMPLE = 256


class _GpuLost(Exception):
    """NVML answers GPU_IS_LOST for this GPU: it fell off the bus."""


def _typed(exc: pynvml.NVMLError, what: str) -> TelemetryError:
    error_class = PermanentTelemetryError if exc.value in _PERMANENT else RetryableTelemetryError
    return error_class(f"NVML {what}: {exc}")


def _nvml(what: str, fn: Callable[..., T], *args: Any) -> T:
    try:
        return fn(*args)
    except pynvml.NVMLError as exc:
        raise _typed(exc, what) from exc


def _text(value: str | bytes) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def cuda_version_text(version: int) -> str:
    """NVML's integer CUDA driver version (12040) as "12.4"."""
    return f"{version // 1000}.{version % 1000 // 10}"


class NvmlSource:
    """TelemetrySource reading every NVIDIA GPU of the host through NVML."""

    simulated = False

    def __init__(
        self,
        *,
        init_attempts: int = 5,
        init_backoff_s: float = 1.0,
        init_backoff_max_s: float = 16.0,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self._init_attempts = init_attempts
        self._init_backoff_s = init_backoff_s
        self._init_backoff_max_s = init_backoff_max_s
        self._sleep = sleep
        self._handles: list[Any] | None = None
        self._event_set: Any = None
        self._xids: list[int] = []
        self._fatal_xid: list[int] = []
        self._open(self._init_attempts)

    # -- the TelemetrySource interface -------------------------------------------------------

    def discover(self) -> GpuInventory:
        handles = self._ready()
        groups = self._nvlink_groups(handles)
        gpus = []
        for index, handle in enumerate(handles):
            memory = _nvml("memory info", pynvml.nvmlDeviceGetMemoryInfo, handle)
            gpus.append(
                GpuInfo(
                    index=index,
                    uuid=_text(_nvml("UUID", pynvml.nvmlDeviceGetUUID, handle)),
                    name=_text(_nvml("name", pynvml.nvmlDeviceGetName, handle)),
                    memory_mb=int(memory.total // _MIB),
                    topology_group=groups.get(index, ""),
                )
            )
        return GpuInventory(
            driver_version=_text(_nvml("driver version", pynvml.nvmlSystemGetDriverVersion)),
            cuda_version=cuda_version_text(
                _nvml("CUDA version", pynvml.nvmlSystemGetCudaDriverVersion)
            ),
            gpus=tuple(gpus),
        )

    def sample(self, busy: Collection[int] = ()) -> list[GpuSample]:
        handles = self._ready()
        try:
            self._drain_xids()
            return [self._sample_one(index, handle) for index, handle in enumerate(handles)]
        except RetryableTelemetryError:
            self._close_library()  # re-initialised on the next call
            raise

    def close(self) -> None:
        self._close_library()

    # -- helpers -----------------------------------------------------------------------------

    def _open(self, attempts: int) -> None:
        """nvmlInit (retried), device handles and the Xid event set."""
        for attempt in range(attempts):
            try:
                pynvml.nvmlInit()
                break
            except pynvml.NVMLError as exc:
                error = _typed(exc, "init")
                if isinstance(error, PermanentTelemetryError) or attempt == attempts - 1:
                    raise error from exc
                delay = min(self._init_backoff_max_s, self._init_backoff_s * 2**attempt)
                delay = delay / 2 + random.uniform(0, delay / 2)
                logger.warning(
                    "NVML init failed, retrying",
                    extra={"error": str(exc), "attempt": attempt + 1, "retry_in_s": delay},
                )
                self._sleep(delay)
        try:
            count = _nvml("device count", pynvml.nvmlDeviceGetCount)
            self._handles = [
                _nvml("device handle", pynvml.nvmlDeviceGetHandleByIndex, i) for i in range(count)
            ]
        except TelemetryError:
            self._close_library()
            raise
        self._xids = [0] * count
        self._fatal_xid = [0] * count
        self._event_set = self._register_xid_events(self._handles)

    def _ready(self) -> list[Any]:
        if self._handles is None:
            self._open(1)
        assert self._handles is not None
        return self._handles

    def _close_library(self) -> None:
        if self._handles is None:
            return
        self._handles = None
        try:
            if self._event_set is not None:
                pynvml.nvmlEventSetFree(self._event_set)
            pynvml.nvmlShutdown()
        except pynvml.NVMLError as exc:
            logger.info("NVML shutdown failed", extra={"error": str(exc)})
        self._event_set = None

    def _read(self, what: str, default: T, fn: Callable[..., T], *args: Any) -> tuple[T, bool]:
        """(value, ok): absent counters read as `default` and ok; other failures are not ok; a
        GPU that is lost raises _GpuLost."""
        try:
            return fn(*args), True
        except pynvml.NVMLError as exc:
            if exc.value in _LIBRARY_GONE:
                raise _typed(exc, what) from exc
            if exc.value == pynvml.NVML_ERROR_GPU_IS_LOST:
                raise _GpuLost from exc
            if exc.value in _ABSENT:
                return default, True
            logger.warning("NVML read failed", extra={"field": what, "error": str(exc)})
            return default, False

    def _sample_one(self, index: int, handle: Any) -> GpuSample:
        try:
            return self._read_one(index, handle)
        except _GpuLost:
            logger.error("GPU fell off the bus", extra={"gpu": index})
            return GpuSample(
                gpu_index=index, ts=time.time(), util_pct=0.0, mem_used_mb=0, power_w=0.0,
                temp_c=0.0, xid_errors=self._xids[index], fatal_xid=self._fatal_xid[index],
                healthy=False, lost=True,
            )  # fmt: skip

    def _read_one(self, index: int, handle: Any) -> GpuSample:
        util, ok_util = self._read(
            "utilization", None, pynvml.nvmlDeviceGetUtilizationRates, handle
        )
        memory, ok_mem = self._read("memory", None, pynvml.nvmlDeviceGetMemoryInfo, handle)
        power_mw, ok_power = self._read("power", 0, pynvml.nvmlDeviceGetPowerUsage, handle)
        temp, ok_temp = self._read(
            "temperature", 0, pynvml.nvmlDeviceGetTemperature, handle, pynvml.NVML_TEMPERATURE_GPU
        )
        ecc, ok_ecc = self._read(
            "ECC errors",
            0,
            pynvml.nvmlDeviceGetTotalEccErrors,
            handle,
            pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
            pynvml.NVML_VOLATILE_ECC,
        )
        # (corrected rows, uncorrected rows, remap pending, remap failed)
        remap, ok_remap = self._read(
            "remapped rows", (0, 0, 0, 0), pynvml.nvmlDeviceGetRemappedRows, handle
        )
        retired, _ = self._read(
            "retired pages pending",
            pynvml.NVML_FEATURE_DISABLED,
            pynvml.nvmlDeviceGetRetiredPagesPendingStatus,
            handle,
        )
        throttle, _ = self._read(
            "throttle reasons", 0, pynvml.nvmlDeviceGetCurrentClocksThrottleReasons, handle
        )
        width, _ = self._read("PCIe width", 0, pynvml.nvmlDeviceGetCurrPcieLinkWidth, handle)
        width_max, _ = self._read("PCIe max width", 0, pynvml.nvmlDeviceGetMaxPcieLinkWidth, handle)
        # The slot's and card's best generation, not the current one (it drops at idle).
        gen, _ = self._read("PCIe gen", 0, pynvml.nvmlDeviceGetMaxPcieLinkGeneration, handle)
        gen_max, _ = self._read(
            "PCIe card gen", 0, pynvml.nvmlDeviceGetGpuMaxPcieLinkGeneration, handle
        )
        healthy = (
            ok_util
            and ok_mem
            and ok_power
            and ok_temp
            and ok_ecc
            and ok_remap
            and ecc == 0
            and not remap[3]  # row remapping failure: the memory cannot be repaired in place
            and not self._fatal_xid[index]
        )
        return GpuSample(
            gpu_index=index,
            ts=time.time(),
            util_pct=float(util.gpu) if util is not None else 0.0,
            mem_used_mb=int(memory.used // _MIB) if memory is not None else 0,
            power_w=power_mw / 1000,
            temp_c=float(temp),
            ecc_errors=int(ecc),
            xid_errors=self._xids[index],
            healthy=bool(healthy),
            fatal_xid=self._fatal_xid[index],
            remap_failed=bool(remap[3]),
            retire_pending=bool(remap[2]) or retired == pynvml.NVML_FEATURE_ENABLED,
            throttle_reasons=int(throttle),
            pcie_width=int(width),
            pcie_width_max=int(width_max),
            pcie_gen=int(gen),
            pcie_gen_max=int(gen_max),
        )

    def _register_xid_events(self, handles: list[Any]) -> Any:
        """An event set receiving critical Xids of every GPU that supports it (None: none)."""
        try:
            event_set = pynvml.nvmlEventSetCreate()
        except pynvml.NVMLError as exc:
            logger.info("no NVML events, Xids not counted", extra={"error": str(exc)})
            return None
        for index, handle in enumerate(handles):
            try:
                pynvml.nvmlDeviceRegisterEvents(
                    handle, pynvml.nvmlEventTypeXidCriticalError, event_set
                )
            except pynvml.NVMLError as exc:
                logger.info("Xid events unsupported", extra={"gpu": index, "error": str(exc)})
        return event_set

    def _drain_xids(self) -> None:
        if self._event_set is None:
            return
        for _ in range(_MAX_EVENTS_PER_SAMPLE):
            try:
                event = pynvml.nvmlEventSetWait_v2(self._event_set, 0)
            except pynvml.NVMLError as exc:
                if exc.value != pynvml.NVML_ERROR_TIMEOUT:  # TIMEOUT: no event pending
                    logger.info("NVML event wait failed", extra={"error": str(exc)})
                return
            if not event.eventType & pynvml.nvmlEventTypeXidCriticalError:
                continue
            index = _nvml("device index", pynvml.nvmlDeviceGetIndex, event.device)
            xid = int(event.eventData)
            self._xids[index] += 1
            if xid in FATAL_XIDS and not self._fatal_xid[index]:
                self._fatal_xid[index] = xid
            logger.warning("GPU Xid", extra={"gpu": index, "xid": xid})

    def _nvlink_groups(self, handles: list[Any]) -> dict[int, str]:
        """GPU index -> "nvl<k>" for GPUs with NVLink peers (see the module docstring)."""
        by_pci: dict[tuple[int, int, int], int] = {}
        for index, handle in enumerate(handles):
            pci = _nvml("PCI info", pynvml.nvmlDeviceGetPciInfo, handle)
            by_pci[(pci.domain, pci.bus, pci.device)] = index
        parent: dict[object, object] = {}

        def find(node: object) -> object:
            parent.setdefault(node, node)
            while parent[node] != node:
                parent[node] = parent[parent[node]]
                node = parent[node]
            return node

        for index, handle in enumerate(handles):
            for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
                try:
                    if pynvml.nvmlDeviceGetNvLinkState(handle, link) != pynvml.NVML_FEATURE_ENABLED:
                        continue
                    remote = pynvml.nvmlDeviceGetNvLinkRemotePciInfo(handle, link)
                except pynvml.NVMLError:
                    break  # no NVLink, or past this GPU's last link
                address = (remote.domain, remote.bus, remote.device)
                peer = ("gpu", by_pci[address]) if address in by_pci else ("switch", address)
                parent[find(("gpu", index))] = find(peer)

        islands: dict[object, list[int]] = {}
        for index in range(len(handles)):
            if ("gpu", index) in parent:
                islands.setdefault(find(("gpu", index)), []).append(index)
        groups = {}
        connected = [members for members in islands.values() if len(members) > 1]
        for number, members in enumerate(sorted(connected)):
            for index in members:
                groups[index] = f"nvl{number}"
        return groups
