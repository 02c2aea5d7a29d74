"""Every CPU kind's kernels on any machine: the tests whose verdicts the CPU's arithmetic can move (marked
``cpu_kernels``: INT8 against fp32, ONNX against PyTorch, the served model against the evaluated one, what `auto`
resolves to and trains) run again in a child pytest with PyTorch's and oneDNN's kernels held to another x86 kind's
instructions. A developer on an AMX Xeon or an AVX-512 BF16 EPYC then sees what an AVX2-only EPYC or a Cascade Lake
Xeon would fail. ONNX Runtime picks its own kernels by CPUID and reads neither variable: its INT8 answers on a CPU
without VNNI are checked under qemu-user (test_export.py, the emulated AVX2 CPU)."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

from ddpipe.core.devices import cpu_flags
from tests.conftest import ROOT, subprocess_env

# The kinds of x86 CPU seen so far by what their kernels compute, each with the environment that holds this host's
# kernels to it (PyTorch: ATEN_CPU_CAPABILITY; oneDNN: ONEDNN_MAX_CPU_ISA; `auto` follows both, ddpipe.core.devices)
# and the flags this host needs for the hold to mean that kind. AMX (an Intel Sapphire Rapids Xeon or later) is held
# to by no one: it is the top.
KINDS = {
    "avx2": ({"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}, ("avx2",)),  # AMD EPYC Rome, Milan
    "avx512-vnni": ({"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_VNNI"},  # Intel Cascade Lake
                    ("avx512f", "avx512bw", "avx512_vnni")),
    "avx512-bf16": ({"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"},  # AMD EPYC Genoa
                    ("avx512f", "avx512bw", "avx512_vnni", "avx512_bf16")),
}


def host_kind() -> str:
    """This host's own kind among :data:`KINDS` (or ``amx``, above them all; ``other`` below AVX2 or off x86)."""
    flags = cpu_flags()
    if "amx_tile" in flags:
        return "amx"
    held_to = [kind for kind, (_, needs) in KINDS.items() if set(needs) <= flags]
    return held_to[-1] if held_to else "other"


def marked_files() -> list[str]:
    """The test files with a ``cpu_kernels`` test (collecting only those: the whole suite takes seconds to collect)."""
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py")
                  if "pytest.mark.cpu_kernels" in p.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(KINDS))
def test_the_cpu_dependent_tests_pass_under_another_cpu_kinds_kernels(kind: str, tmp_path) -> None:  # noqa: ANN001
    held, needs = KINDS[kind]
    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip(f"an x86-64 host is needed to hold its kernels to {kind}")
    if kind == host_kind():
        pytest.skip(f"this host is {kind}: the suite's own run of the cpu_kernels tests is that kind's")
    if missing := [f for f in needs if f not in cpu_flags()]:
        pytest.skip(f"this CPU cannot run {kind}'s kernels: it lacks {', '.join(missing)}")
    # the child is a plain pytest run, not one of this run's xdist workers
    env = {k: v for k, v in subprocess_env(held).items() if not k.startswith(("PYTEST_XDIST", "PYTEST_CURRENT"))}
    cmd = [sys.executable, "-m", "pytest", "-m", "cpu_kernels", "-n", "0", "-q", "-p", "no:cacheprovider",
           "--basetemp", str(tmp_path / "child"), *marked_files()]
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    said = result.stdout[-6000:] + result.stderr[-2000:]
    assert result.returncode == 0, f"under {kind}'s kernels ({held}):\n{said}"
    assert " passed" in said and "no tests ran" not in said, said
