"""Device decisions: the network, batch and precision `auto` resolve to, channels_last, autocast, what
CPU cannot run."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

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


KEPT = """
import ctypes, os, sys, torch
from ddpipe.core.devices import give_back_freed_memory, keep_freed_memory

class MallInfo2(ctypes.Structure):  # glibc's mallinfo2 (malloc.h): its first field, the heap's bytes
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]

mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
mallinfo2.restype = MallInfo2
held = keep_freed_memory() if sys.argv[1] == "held" else None
before = mallinfo2()
block = torch.ones(5 << 20)  # one of a step's tensors, 20 MB
during = mallinfo2()
del block
after = mallinfo2()
resident = lambda: int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") >> 20
kept = resident()
give_back_freed_memory()
print(held, (during.hblkhd - before.hblkhd) >> 20, (after.arena - before.arena) >> 20, kept - resident())
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's allocator")
def test_a_steps_freed_memory_is_kept_for_the_next_step() -> None:
    """What a CPU training's process does before its steps (ddpipe.distributed.group.init_distributed, auto's
    measurement): the heap keeps what a step freed for the next, where glibc by default gives it back and the next
    step faults fresh pages in (3,200-11,500 page faults a step of these blocks here; a training's images/s varied
    1.4x from run to run with it)."""
    runs = {how: subprocess.Popen([sys.executable, "-c", KEPT, how], stdout=subprocess.PIPE, text=True)
            for how in ("held", "default")}
    held, default = ((out.split()[0], *map(int, out.split()[1:])) for out in (p.communicate()[0]
                                                                               for p in runs.values()))
    assert held[0] == "True"
    assert default[1] == 20  # by default a block this large is mapped apart, and unmapped when freed...
    assert held[1] == 0 and held[2] >= 15  # ...held, it comes from the heap, which keeps it once freed...
    assert held[3] >= 15  # ...until a process whose steps are over gives it back (its pages leave the RSS)
