"""Mixed precision: choosing fp32 / fp16 / bf16 for a device, autocast, and loss scaling.

* ``bf16``: autocast to bfloat16; same exponent range as fp32, so no loss scaling is needed.
* ``fp16``: autocast to float16 with a ``GradScaler`` (dynamic loss scaling) so small gradients
  do not underflow; the scaler's state is checkpointed.
* ``fp32``: no autocast. On CUDA, ``train.tf32`` lets fp32 matmuls use TF32 tensor cores.
* ``auto``: bf16 on a CUDA card that supports it, else fp16 on CUDA, else fp32 on CPU (CPU
  autocast works for both half types, but without matrix units it is usually slower than fp32).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from harness.config import ConfigError

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class PrecisionPlan:
    """The resolved precision for one device."""

    name: str
    device_type: str

    @property
    def dtype(self) -> torch.dtype:
        return _DTYPES[self.name]

    @property
    def uses_autocast(self) -> bool:
        return self.name != "fp32"

    @property
    def uses_scaler(self) -> bool:
        return self.name == "fp16"

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        if not self.uses_autocast:
            yield
            return
        with torch.autocast(device_type=self.device_type, dtype=self.dtype):
            yield

    def grad_scaler(self) -> torch.amp.GradScaler | None:
        if not self.uses_scaler:
            return None
        return torch.amp.GradScaler(self.device_type)


def resolve_precision(requested: str, device: torch.device) -> PrecisionPlan:
    """Turn ``train.precision`` into a plan; ConfigError when the device cannot do it."""
    if requested == "auto":
        if device.type == "cuda":
            name = "bf16" if torch.cuda.is_bf16_supported(including_emulation=False) else "fp16"
        else:
            name = "fp32"
        return PrecisionPlan(name, device.type)
    if (
        requested == "bf16"
        and device.type == "cuda"
        and not torch.cuda.is_bf16_supported(including_emulation=False)
    ):
        card = torch.cuda.get_device_name(device)
        raise ConfigError([("train.precision", f"bf16 is not supported on {card}")])
    if requested not in _DTYPES:
        raise ConfigError([("train.precision", f"unknown precision {requested!r}")])
    return PrecisionPlan(requested, device.type)
