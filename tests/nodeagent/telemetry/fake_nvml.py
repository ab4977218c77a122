"""A fake of NVML at the library boundary: the `pynvml` functions NvmlSource calls, answering
from a scripted host. NVML is external, so faking it is fine; everything above it (NvmlSource,
the agent protocol, the server) is the real code.

    fake = FakeNvml(gpus=4)
    fake.install(monkeypatch)
    fake.xid(2, 79)          # the driver reports Xid 79 on GPU 2
    fake.gpus[1].ecc = 3     # three volatile uncorrectable ECC errors on GPU 1
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pynvml

_MIB = 1024 * 1024


@dataclass
class FakeGpu:
    index: int
    name: str = "NVIDIA H100 80GB HBM3"
    memory_mb: int = 81559
    used_mb: int = 0
    util: int = 0
    power_mw: int = 70_000
    temp_c: int = 31
    ecc: int = 0
    remap: tuple[int, int, int, int] = (0, 0, 0, 0)
    retired_pending: bool = False
    throttle: int = 0x1  # GPU idle: normal
    pcie_width: int = 16
    pcie_width_max: int = 16
    pcie_gen: int = 5
    pcie_gen_max: int = 5
    lost: bool = False

    @property
    def uuid(self) -> str:
        return f"GPU-fake-{self.index:04d}"


@dataclass
class FakeNvml:
    gpus: list[FakeGpu] | int = 4
    driver_version: str = "550.54.15"
    cuda_version: int = 12040
    events: list[tuple[int, int]] = field(default_factory=list)  # (gpu index, xid) pending
    initialised: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.gpus, int):
            self.gpus = [FakeGpu(index=i) for i in range(self.gpus)]

    def xid(self, index: int, xid: int) -> None:
        """The driver reports Xid `xid` on GPU `index` (drained at the next sample)."""
        self.events.append((index, xid))

    # -- the pynvml functions ----------------------------------------------------------------

    def _gpu(self, handle: Any) -> FakeGpu:
        if not self.initialised:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)
        gpu = self.gpus[handle]
        if gpu.lost:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        return gpu

    def install(self, monkeypatch: Any) -> FakeNvml:
        def init() -> None:
            self.initialised = True

        def shutdown() -> None:
            self.initialised = False

        def not_supported(*_: Any) -> Any:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)

        def wait(_event_set: Any, _timeout_ms: int) -> Any:
            if not self.events:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT)
            index, xid = self.events.pop(0)
            return SimpleNamespace(
                eventType=pynvml.nvmlEventTypeXidCriticalError, eventData=xid, device=index
            )

        gpu = self._gpu
        functions = {
            "nvmlInit": init,
            "nvmlShutdown": shutdown,
            "nvmlDeviceGetCount": lambda: len(self.gpus),
            "nvmlDeviceGetHandleByIndex": lambda i: i,
            "nvmlDeviceGetIndex": lambda h: h,
            "nvmlSystemGetDriverVersion": lambda: self.driver_version,
            "nvmlSystemGetCudaDriverVersion": lambda: self.cuda_version,
            "nvmlDeviceGetUUID": lambda h: gpu(h).uuid,
            "nvmlDeviceGetName": lambda h: gpu(h).name,
            "nvmlDeviceGetPciInfo": lambda h: SimpleNamespace(domain=0, bus=h + 1, device=0),
            "nvmlDeviceGetNvLinkState": not_supported,
            "nvmlDeviceGetMemoryInfo": lambda h: SimpleNamespace(
                total=gpu(h).memory_mb * _MIB, used=gpu(h).used_mb * _MIB
            ),
            "nvmlDeviceGetUtilizationRates": lambda h: SimpleNamespace(gpu=gpu(h).util),
            "nvmlDeviceGetPowerUsage": lambda h: gpu(h).power_mw,
            "nvmlDeviceGetTemperature": lambda h, _sensor: gpu(h).temp_c,
            "nvmlDeviceGetTotalEccErrors": lambda h, _type, _counter: gpu(h).ecc,
            "nvmlDeviceGetRemappedRows": lambda h: gpu(h).remap,
            "nvmlDeviceGetRetiredPagesPendingStatus": lambda h: (
                pynvml.NVML_FEATURE_ENABLED
                if gpu(h).retired_pending
                else pynvml.NVML_FEATURE_DISABLED
            ),
            "nvmlDeviceGetCurrentClocksThrottleReasons": lambda h: gpu(h).throttle,
            "nvmlDeviceGetCurrPcieLinkWidth": lambda h: gpu(h).pcie_width,
            "nvmlDeviceGetMaxPcieLinkWidth": lambda h: gpu(h).pcie_width_max,
            "nvmlDeviceGetMaxPcieLinkGeneration": lambda h: gpu(h).pcie_gen,
            "nvmlDeviceGetGpuMaxPcieLinkGeneration": lambda h: gpu(h).pcie_gen_max,
            "nvmlEventSetCreate": lambda: "event-set",
            "nvmlDeviceRegisterEvents": lambda h, _types, _set: None,
            "nvmlEventSetWait_v2": wait,
            "nvmlEventSetFree": lambda _set: None,
        }
        for name, fn in functions.items():
            assert hasattr(pynvml, name), name  # the fake names only functions NVML has
            monkeypatch.setattr(pynvml, name, fn)
        return self
