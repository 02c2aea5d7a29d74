"""Device decisions: the network, batch and precision `auto` resolve to, channels_last, autocast, what
CPU cannot run."""

from __future__ import annotations

import os

import pytest
import torch

from ddpipe.config.load import load_config
from ddpipe.config.schema import ConfigError
from ddpipe.core.devices import PrecisionPolicy, cpu_count, cpu_supports_bf16
from ddpipe.engine import resolved as resolve_run
from ddpipe.engine.resolved import resolve_precision, use_channels_last

CPU = torch.device("cpu")


@pytest.mark.cpu_kernels
def test_auto_precision_on_cpu_follows_the_cpu() -> None:
    assert resolve_precision("auto", CPU) == ("bf16" if cpu_supports_bf16() else "fp32")
    assert resolve_precision("fp32", CPU) == "fp32" and resolve_precision("bf16", CPU) == "bf16"


def test_kernels_held_to_avx2_resolve_auto_as_an_avx2_cpu_would(monkeypatch: pytest.MonkeyPatch) -> None:
    """oneDNN held to AVX2 (ONEDNN_MAX_CPU_ISA), or PyTorch's kernels (ATEN_CPU_CAPABILITY, read when torch loads: a
    new process): no bf16, no AMX, whatever /proc/cpuinfo says; oneDNN held to AVX512_CORE_BF16 keeps bf16 only."""
    import subprocess
    import sys

    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "avx2")
    assert resolve_precision("auto", CPU) == "fp32" and resolve_run.device_kind(CPU) == "cpu"
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
    from ddpipe.core.devices import cpu_has_amx

    assert not cpu_has_amx()
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    probe = ("import torch; from ddpipe.engine.resolved import resolve_precision, device_kind; "
             "print(resolve_precision('auto', torch.device('cpu')), device_kind(torch.device('cpu')))")
    said = subprocess.run([sys.executable, "-c", probe], env={**os.environ, "ATEN_CPU_CAPABILITY": "avx2"},
                          capture_output=True, text=True, check=True).stdout.split()
    assert said == ["fp32", "cpu"]


def test_fp16_needs_a_gpu() -> None:
    with pytest.raises(ConfigError, match="train.precision = 'fp16' needs a CUDA GPU"):
        resolve_precision("fp16", CPU)


@pytest.mark.parametrize("setting, device, precision, expected", [
    ("auto", "cpu", "fp32", True), ("auto", "cuda", "fp32", False), ("auto", "cuda", "bf16", True),
    ("on", "cuda", "fp32", True), ("off", "cpu", "bf16", False),
])
def test_channels_last(setting: str, device: str, precision: str, expected: bool) -> None:
    assert use_channels_last(setting, torch.device(device), precision) is expected


def test_compute_on_cpu_autocasts_only_below_fp32() -> None:
    fp32 = PrecisionPolicy(CPU, resolve_precision("fp32", CPU), use_channels_last("off", CPU, "fp32"))
    assert (fp32.precision, fp32.channels_last, fp32.pin_memory) == ("fp32", False, False)
    with fp32.autocast():
        assert not torch.is_autocast_enabled("cpu")
    bf16 = PrecisionPolicy(CPU, "bf16", channels_last=True)
    with bf16.autocast():
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    assert not bf16.grad_scaler().is_enabled()
    module = bf16.place(torch.nn.Conv2d(1, 4, 3))
    assert module.weight.is_contiguous(memory_format=torch.channels_last)
    assert cpu_count() >= 1


@pytest.mark.parametrize("device, expected", [("cpu", ("resnet18", 64)), ("cuda", ("resnet50", 128))])
def test_auto_picks_an_imagenet_network_for_large_inputs(device: str, expected: tuple[str, int]) -> None:
    """Above 64 px a side (encoded images: 224 by default) auto means torchvision's networks, whose stem
    downsamples at once; at 64 px and below, the small-image ones."""
    assert resolve_run.auto_choice(torch.device(device), 64)[0] in ("resnet_compact", "resnet_small")
    assert resolve_run.auto_choice(torch.device(device), 224) == expected


def test_an_explicit_eval_batch_is_kept() -> None:
    fixed = load_config(["train.eval_batch_size_per_rank=1000"])
    assert resolve_run.eval_batch_size(fixed.train, CPU, 28) == 1000
    assert resolve_run.eval_batch_size(load_config(["train.batch_size_per_rank=48"]).train, CPU, 28) == 96
