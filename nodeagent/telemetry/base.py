"""The telemetry contract: what a GPU host reports about its cards, from NVML or simulated.

A source does two things: `discover()` lists the GPUs once (the join payload), `sample()` reads
their current state (every heartbeat). No Django import: this runs on GPU hosts.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Collection
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from agentprotocol import GpuInfo, GpuSample
from nodeagent.metrics import NVML_ERRORS

logger = logging.getLogger(__name__)


class TelemetryError(Exception):
    """Reading the GPUs failed; see the subclasses for whether retrying can help."""


class RetryableTelemetryError(TelemetryError):
    """Transient (NVML busy or timed out, driver reloading): a later call may succeed."""


class PermanentTelemetryError(TelemetryError):
    """No use retrying: no NVML library, no driver, no permission, no such GPU model."""


@dataclass(frozen=True, slots=True)
class GpuInventory:
    """What discovery finds on the host: driver facts and the GPUs."""

    driver_version: str
    cuda_version: str
    gpus: tuple[GpuInfo, ...]


@runtime_checkable
class TelemetrySource(Protocol):
    """Where GPU facts and readings come from."""

    # True for fake GPUs: the join payload says so, and the node is flagged for everyone to see.
    simulated: bool

    def discover(self) -> GpuInventory:
        """The host's driver versions and GPUs, in index order."""
        ...

    def sample(self, busy: Collection[int] = ()) -> list[GpuSample]:
        """A reading of every GPU. `busy`: indices running a rental (simulated sources use it
        to look plausible; real ones read the hardware and ignore it)."""
        ...

    def close(self) -> None:
        """Release the library handles."""
        ...


class SampleWatchdog:
    """Bounds how long a heartbeat waits for telemetry.

    NVML calls are blocking C calls that can hang (a GPU falling off the bus); they cannot be
    cancelled, so the call runs in a worker thread and the heartbeat goes without telemetry when
    it is late. While a call is still stuck, no new one is queued behind it.
    """

    def __init__(self, source: TelemetrySource, timeout_s: float) -> None:
        self.source = source
        self.timeout_s = timeout_s
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="telemetry")
        self._pending: Future[list[GpuSample]] | None = None
        self._lock = threading.Lock()

    def sample(self, busy: Collection[int] = ()) -> list[GpuSample]:
        """The source's samples, or [] when it failed or took longer than the timeout."""
        with self._lock:
            if self._pending is not None and not self._pending.done():
                logger.warning("telemetry still stuck in the previous call, skipping")
                return []
            self._pending = self._executor.submit(self.source.sample, frozenset(busy))
            future = self._pending
        try:
            return future.result(timeout=self.timeout_s)
        except FutureTimeout:
            NVML_ERRORS.labels(kind="timeout").inc()
            logger.warning("telemetry timed out", extra={"timeout_s": self.timeout_s})
        except TelemetryError as exc:
            NVML_ERRORS.labels(kind="error").inc()
            logger.warning("telemetry failed", extra={"error": str(exc)})
        return []

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        self.source.close()
