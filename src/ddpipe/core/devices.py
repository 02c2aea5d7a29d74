"""What the device has and how a training computes on it: CPU cores and instruction sets, autocast, loss
scaling, memory format, pinned copies.

Precision and memory format are chosen once per training by ``ddpipe.engine.resolved`` (from ``train.precision`` /
``train.channels_last`` and these probes) and recorded with the run (``resolved_precision``, ``channels_last``),
since they change the float rounding.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch


def cpu_count() -> int:
    """Cores this process may run on (affinity/cgroup aware where the OS says)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def cpu_supports_bf16() -> bool:
    """AVX512-BF16 or AMX: bf16 autocast is then ~2x faster than fp32 on CPU (BENCHMARKS.md)."""
    probe = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
    return bool(probe and probe()) or cpu_has_amx()


def cpu_has_amx() -> bool:
    amx = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(amx and amx())


def deterministic_kernels(device: torch.device) -> None:
    """cuDNN picks fixed, deterministic algorithms: the same result for a given seed and world size."""
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = False
        torch.backends.cudnn.deterministic = True


@dataclass(frozen=True)
class PrecisionPolicy:
    """How a training computes on its device: the precision (autocast, loss scaling), the memory format, and
    host-to-device copies."""

    device: torch.device
    precision: str  # fp32 | bf16 | fp16, resolved
    channels_last: bool

    @property
    def pin_memory(self) -> bool:
        """Pinned host batches, copied with ``non_blocking=True``: CUDA only."""
        return self.device.type == "cuda"

    def autocast(self) -> contextlib.AbstractContextManager:
        """bf16/fp16 autocast, or nothing for fp32."""
        if self.precision == "fp32":
            return contextlib.nullcontext()
        dtype = torch.bfloat16 if self.precision == "bf16" else torch.float16
        return torch.autocast(self.device.type, dtype=dtype)

    def grad_scaler(self) -> torch.amp.GradScaler:
        """Loss scaling for fp16 (a no-op object otherwise)."""
        return torch.amp.GradScaler("cuda", enabled=self.precision == "fp16")

    def place(self, module: torch.nn.Module) -> torch.nn.Module:
        """The module on this device, in this memory format."""
        module = module.to(self.device)
        return module.to(memory_format=torch.channels_last) if self.channels_last else module
