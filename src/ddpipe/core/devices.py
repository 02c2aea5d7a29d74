"""What the device has and how a training computes on it: CPU cores and instruction sets, autocast, loss
scaling, memory format, pinned copies.

Precision and memory format are chosen once per training by ``ddpipe.engine.resolved`` (from ``train.precision`` /
``train.channels_last`` and these probes) and recorded with the run (``resolved_precision``, ``channels_last``),
since they change the float rounding.
"""

from __future__ import annotations

import contextlib
import functools
import os
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


def cpu_count() -> int:
    """CPUs this process may run on: its affinity (a cpuset), and no more than its cgroup's CPU quota (a container's
    or a Kubernetes pod's CPU limit, :func:`cpu_quota`), where threads beyond the quota wait for each other's turn."""
    try:
        count = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        count = os.cpu_count() or 1
    quota = _own_quota()
    return min(count, quota) if quota else count


@functools.lru_cache(maxsize=1)
def _own_quota() -> int | None:
    """This process's :func:`cpu_quota`, read once (:func:`cpu_count` is asked at every step)."""
    return cpu_quota()


def physical_cores() -> int:
    """The cores under this process's logical CPUs, a core's hyperthreads counted once (sysfs' thread siblings), no
    more than :func:`cpu_count`; :func:`cpu_count` where the topology cannot be read. A cloud VM's two vCPUs are often
    one core's two threads."""
    try:
        cpus = os.sched_getaffinity(0)
    except AttributeError:  # not Linux
        return cpu_count()
    cores = set()
    for cpu in cpus:
        try:
            cores.add(Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list").read_text().strip())
        except OSError:
            return cpu_count()
    return max(1, min(len(cores), cpu_count()))


def cpu_quota(cgroup_root: str | Path = "/sys/fs/cgroup") -> int | None:
    """The CPUs' worth of time this process's cgroup may use (its CFS quota over its period, rounded up: a container's
    or a Kubernetes pod's CPU limit), or None where none is set or readable. The CPUs its affinity allows may be many
    more: threads beyond the quota wait for each other's turn at every layer (BENCHMARKS.md, "`auto` by
    measuring")."""
    found = _quota_and_period(cgroup_root)
    return None if found is None else max(1, -(-found[0] // found[1]))


def cpu_quota_exact(cgroup_root: str | Path = "/sys/fs/cgroup") -> float | None:
    """:func:`cpu_quota` unrounded (1.5 for a limit of 1.5 CPUs), or None: what ``auto``'s measurement is keyed by,
    since a quota of 1.5 CPUs and none on 2 CPUs both count 2 CPUs and compute differently."""
    found = _quota_and_period(cgroup_root)
    return None if found is None else found[0] / found[1]


def _quota_and_period(cgroup_root: str | Path) -> tuple[int, int] | None:
    """This process's cgroup's CFS quota and period (microseconds, v2's cpu.max or v1's cfs files), or None."""
    root = Path(cgroup_root)
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:  # "0::/path" (v2), "N:cpu,cpuacct:/path" or "N:cpu:/path" (v1)
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            files = [root / path.lstrip("/") / "cpu.max", root / "unified" / path.lstrip("/") / "cpu.max"]
            for f in files:
                with contextlib.suppress(OSError, ValueError):
                    quota, period = f.read_text().split()[:2]
                    if quota != "max" and int(period) > 0:
                        return int(quota), int(period)
        elif "cpu" in controllers.split(","):
            base = root / controllers / path.lstrip("/")
            with contextlib.suppress(OSError, ValueError):
                quota = int((base / "cpu.cfs_quota_us").read_text())
                period = int((base / "cpu.cfs_period_us").read_text())
                if quota > 0 and period > 0:  # -1: no quota
                    return quota, period
    return None


# glibc's allocator, held for a CPU training's steps (:func:`keep_freed_memory`): blocks up to this size come from
# the heap (glibc's largest accepted threshold), and freed heap is returned to the system only above this much.
HEAP_BLOCK_MAX = 32 << 20
HEAP_KEEP = 1 << 30
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (malloc.h)


@functools.cache
def _glibc() -> Any:
    """The C library when it is glibc (its allocator's mallopt and malloc_trim), else None."""
    import ctypes
    import ctypes.util

    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


@functools.cache
def keep_freed_memory() -> bool:
    """Keep the memory a step frees for the next step, in this process (glibc's mallopt; where the C library is not
    glibc: nothing, False). By default glibc maps each block over a threshold anew and returns freed heap to the
    system, thresholds it moves as blocks come and go, so a step's tensors could fault in fresh zeroed pages every
    step, or not, by the order they were freed in: one config trained at 5,847-8,535 images/s from run to run, 375,000
    page faults in 5 s in a slow run; held (and one process out of DDP), at 8,207-9,152 (BENCHMARKS.md, "`auto` by
    measuring"). The process's peak memory is the same; it gives back less of it between steps
    (:func:`give_back_freed_memory`). Once per process, before its steps (a training's, ``auto``'s timed ones): the
    blocks already made stay as they are."""
    libc = _glibc()
    return libc is not None and bool(libc.mallopt(_M_MMAP_THRESHOLD, HEAP_BLOCK_MAX)) \
        and bool(libc.mallopt(_M_TRIM_THRESHOLD, HEAP_KEEP))


def give_back_freed_memory() -> None:
    """Return the heap's free memory to the system now (glibc's malloc_trim): a process whose steps are over (the
    launcher, once ``auto`` measured) holds only what it still uses while its training runs."""
    if (libc := _glibc()) is not None:
        libc.malloc_trim(0)


# The instruction sets a process may be held to below what its CPU has: PyTorch's own kernels by ATEN_CPU_CAPABILITY
# (torch.backends.cpu.get_cpu_capability() then says so), oneDNN's convolutions by ONEDNN_MAX_CPU_ISA (older name:
# DNNL_MAX_CPU_ISA). Held to AVX2, an AMX Xeon computes as an AVX2-only CPU does, and `auto` must choose as on one.
ONEDNN_ISA_ENV = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")
ONEDNN_WITHOUT_BF16 = frozenset({"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI"})


def _aten_below_avx512() -> bool:
    """PyTorch's own kernels run below AVX-512 here (``ATEN_CPU_CAPABILITY``, or a CPU without it)."""
    return torch.backends.cpu.get_cpu_capability() != "AVX512"


def _onednn_cap() -> str:
    """The instruction set oneDNN is held to (:data:`ONEDNN_ISA_ENV`), upper case; "" when it is not held."""
    cap = next((os.environ[name].strip().upper() for name in ONEDNN_ISA_ENV if os.environ.get(name, "").strip()), "")
    return "" if cap == "DEFAULT" else cap


def cpu_supports_bf16() -> bool:
    """AVX512-BF16 or AMX, usable by this process: bf16 autocast is then ~2x faster than fp32 on CPU (BENCHMARKS.md).
    False where PyTorch's kernels are held below AVX-512 or oneDNN's below AVX512_CORE_BF16 (:data:`ONEDNN_ISA_ENV`)."""
    if _aten_below_avx512() or _onednn_cap() in ONEDNN_WITHOUT_BF16:
        return False
    probe = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
    return bool(probe and probe()) or cpu_has_amx()


def cpu_has_amx() -> bool:
    """AMX tiles, usable by this process (not where its kernels are held to an instruction set without them)."""
    cap = _onednn_cap()
    if _aten_below_avx512() or (cap and "AMX" not in cap):
        return False
    amx = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(amx and amx())


# The x86 instructions that multiply uint8 by int8 and add into int32 without an int16 step: AVX512-VNNI, AVX-VNNI,
# AMX-INT8 (as /proc/cpuinfo names them). Without one, ONNX Runtime's U8S8 kernels use VPMADDUBSW, whose int16 pair
# sums saturate: an INT8 graph's answers then depend on the data and on which kernel a batch's shape picks.
VNNI_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux's /proc/cpuinfo lists them; empty where there is no such file."""
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.is_file():
        return frozenset()
    for line in cpuinfo.read_text(errors="replace").splitlines():
        if line.startswith(("flags", "Features")):  # x86 | ARM
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def cpu_int8_kind() -> str:
    """How this CPU multiplies 8-bit integers: ``x86-vnni`` (VNNI or AMX: exact int32 sums), ``x86-no-vnni`` (AVX2 or
    AVX-512 without VNNI: int16 pair sums that saturate), or ``other`` (ARM and the rest, whose dot products
    accumulate in int32). Without /proc/cpuinfo, torch's own probe decides on x86."""
    if platform.machine().lower() not in ("x86_64", "amd64", "i386", "i686", "x86"):
        return "other"
    flags = cpu_flags()
    probe = getattr(torch.cpu, "_is_vnni_supported", None)
    vnni = any(f in flags for f in VNNI_FLAGS) if flags else bool(probe and probe()) or cpu_has_amx()
    return "x86-vnni" if vnni else "x86-no-vnni"


# cuBLAS's workspace configuration under which its results are deterministic (CUDA's "Results reproducibility")
CUBLAS_DETERMINISTIC_WORKSPACE = ":4096:8"


def cuda_kernels(device: torch.device, deterministic: bool) -> None:
    """How CUDA picks this process's kernels (``train.deterministic``). Deterministic: fixed cuDNN algorithms,
    ``torch.use_deterministic_algorithms`` (an op with no deterministic kernel raises, naming itself), cuBLAS's
    deterministic workspace (before its first call in this process) and fp32 kept fp32. Otherwise: cuDNN times its
    algorithms for each new shape (``cudnn.benchmark``), and fp32 matmuls and convolutions use TF32. Set both ways,
    since these switches are the process's: a training run in-process after another gets its own. On the CPU
    nothing changes: its kernels are run-to-run deterministic at a given thread count."""
    if device.type != "cuda":
        return
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_DETERMINISTIC_WORKSPACE)
    torch.backends.cudnn.benchmark = not deterministic
    torch.backends.cudnn.deterministic = deterministic
    torch.use_deterministic_algorithms(deterministic)
    fp32 = "ieee" if deterministic else "tf32"
    if hasattr(torch.backends.cuda.matmul, "fp32_precision"):  # torch >= 2.9
        torch.backends.cuda.matmul.fp32_precision = fp32
        torch.backends.cudnn.conv.fp32_precision = fp32
    else:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = not deterministic


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
