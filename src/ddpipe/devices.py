"""Decisions that depend on the device: CPU cores, precision, memory format, autocast, pinned copies.

Decided once per training from ``train.precision`` / ``train.channels_last`` and the device, and recorded
with the run (``resolved_precision``, ``channels_last``), since they change the float rounding.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch

from ddpipe.config.schema import ConfigError, TrainConfig


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


# What ``model.name: auto`` and ``train.batch_size_per_rank: auto`` become, by device (BENCHMARKS.md,
# "Which network `auto` picks"). resnet_compact at batch 128 reached 0.923 test accuracy in 10 epochs
# at 2.2x resnet_small's images/s in fp32 on an AVX2/AVX512 CPU; resnet_small at batch 256 is the
# combination measured on an AMX Xeon (bf16, 0.44x the reference loop's time) and the one the GPU
# tests ran, kept unchanged there until the compact one is measured on those devices.
AUTO_CHOICES = {  # device_kind -> (model.name, train.batch_size_per_rank), applied by ddpipe.resolved
    "cpu": ("resnet_compact", 128),  # a CPU without AMX
    "cpu-amx": ("resnet_small", 256),
    "cuda": ("resnet_small", 256),
}
# Inputs above SMALL_INPUT px a side (encoded images, 224 by default) get torchvision's ImageNet networks, whose
# stem downsamples 4x at once: ddpipe's small-image nets keep full resolution through their first layers.
# ResNet-50 at batch 128 is torchvision's reference recipe per GPU (8 GPUs x 32 there; bf16 fits 128 in 40 GB);
# on a CPU, ResNet-18 (a fifth of ResNet-50's multiply-adds) at batch 64.
SMALL_INPUT = 64
AUTO_LARGE_INPUT = {"cpu": ("resnet18", 64), "cpu-amx": ("resnet18", 64), "cuda": ("resnet50", 128)}


def device_kind(device: torch.device) -> str:
    """The key of :data:`AUTO_CHOICES` for this device."""
    if device.type == "cuda":
        return "cuda"
    return "cpu-amx" if cpu_has_amx() else "cpu"


def auto_choice(device: torch.device, side: int) -> tuple[str, int]:
    """(model.name, train.batch_size_per_rank) that ``auto`` means on ``device`` for inputs ``side`` px a side."""
    table = AUTO_CHOICES if side <= SMALL_INPUT else AUTO_LARGE_INPUT
    return table[device_kind(device)]


def eval_batch_size(cfg: TrainConfig, device: torch.device, side: int) -> int:
    """``train.eval_batch_size_per_rank`` for ``device``: auto is twice the training batch (itself auto or not)."""
    if cfg.eval_batch_size_per_rank != "auto":
        return int(cfg.eval_batch_size_per_rank)
    requested = cfg.batch_size_per_rank
    return 2 * (auto_choice(device, side)[1] if requested == "auto" else int(requested))


def loader_workers(setting: str, encoding: str, device: torch.device, cores: int) -> int:
    """``data.num_workers`` resolved for a rank that may use ``cores`` cores. ``auto``: none for raw data (a
    batch is one gather from the memory map: handing it between processes would cost more); for encoded
    data on CUDA the rank's cores less one (the training process feeds the GPU), on CPU half of them (the
    training's own threads compute on the same cores), at least one."""
    if setting != "auto":
        return int(setting)
    if encoding == "raw":
        return 0
    return max(1, cores - 1) if device.type == "cuda" else max(1, cores // 2)


def resolve_precision(requested: str, device: torch.device) -> str:
    """fp32/bf16/fp16 for this device; ConfigError for a precision the device cannot run."""
    if requested == "fp16" and device.type != "cuda":
        raise ConfigError("train.precision = 'fp16' needs a CUDA GPU (GradScaler); on CPU use "
                          "auto, fp32 or bf16")
    if requested != "auto":
        return requested
    if device.type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    return "bf16" if cpu_supports_bf16() else "fp32"


def use_channels_last(setting: str, device: torch.device, precision: str) -> bool:
    """``train.channels_last`` resolved: auto is on for CPU and for CUDA with bf16/fp16 (tensor cores)."""
    if setting != "auto":
        return setting == "on"
    return device.type == "cpu" or precision in ("bf16", "fp16")


def deterministic_kernels(device: torch.device) -> None:
    """cuDNN picks fixed, deterministic algorithms: the same result for a given seed and world size."""
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = False
        torch.backends.cudnn.deterministic = True


@dataclass(frozen=True)
class Compute:
    """How a training computes on its device: precision, memory format, and host-to-device copies."""

    device: torch.device
    precision: str  # fp32 | bf16 | fp16, resolved
    channels_last: bool

    @classmethod
    def resolve(cls, cfg: TrainConfig, device: torch.device) -> Compute:
        precision = resolve_precision(cfg.precision, device)
        return cls(device, precision, use_channels_last(cfg.channels_last, device, precision))

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
