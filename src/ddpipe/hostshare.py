"""Trainings that run at once on one host share its cores: threads per process = cores / worker processes.

Every training worker on a CPU host registers itself in a per-user directory (one small file per
process). A worker's intra-op threads are the cores it may use divided by the ddpipe workers alive on the
host, re-read between optimizer steps: a training alone keeps today's threads (cores / its own
processes); when a second starts (``dvc queue start -j 2``), both shrink to their share within a step,
and grow back when it ends. Neither DVC, torchrun nor MLflow does this: without it each training takes
every core and two at once ran 5x slower each (BENCHMARKS.md). Threads change the float rounding, so a
change is printed and recorded with the run (``threads_per_process``, at the optimizer step it took
effect). ``distributed.threads_per_process`` set in params.yaml turns the sharing off for that training.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import torch

from ddpipe.devices import cpu_count

REGISTRY = Path(tempfile.gettempdir()) / f"ddpipe-{os.getuid()}-workers"
RECHECK_S = 5.0  # also re-list this often, to notice workers that died without unregistering


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (None if it is gone or a zombie): with the pid
    it names one process, even after the pid is reused."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else fields[19]


class HostShare:
    """This worker's entry in the host's registry, and the threads it should run with."""

    def __init__(self, fixed_threads: int | None, own_processes: int, enabled: bool = True,
                 registry: Path = REGISTRY) -> None:
        """``own_processes``: this training's processes on this host (its share never drops below
        cores / that, whatever the registry says while its own workers are still registering);
        ``enabled``: False for GPU workers, whose threads stay as distributed.init_distributed set them."""
        self.fixed, self.own, self.enabled, self.registry = fixed_threads, own_processes, enabled, registry
        self.entry: Path | None = None
        self._seen_mtime, self._listed_at, self.workers = -1, 0.0, own_processes

    def __enter__(self) -> HostShare:
        start = _start_time(os.getpid())
        if self.enabled and not self.fixed and start is not None:  # Linux: /proc names the process
            self.registry.mkdir(parents=True, exist_ok=True)
            self.entry = self.registry / f"{os.getpid()}-{start}"
            self.entry.touch()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.entry is not None:
            self.entry.unlink(missing_ok=True)
            self.entry = None

    def _live_workers(self) -> int:
        live = 0
        for path in self.registry.glob("*-*"):
            pid, _, start = path.name.partition("-")
            if pid.isdigit() and _start_time(int(pid)) == start:
                live += 1
            else:  # its process is gone: killed outright, or a pid reused since
                path.unlink(missing_ok=True)
        return max(1, live)

    def threads(self) -> int:
        """Threads per process for this worker now: the fixed setting, or cores / live workers."""
        if self.fixed:
            return self.fixed
        if self.entry is None:  # not sharing: GPU workers, or no /proc
            return torch.get_num_threads()
        mtime = self.registry.stat().st_mtime_ns  # a worker came or went (cheap: one stat per step)
        if mtime != self._seen_mtime or time.monotonic() - self._listed_at > RECHECK_S:
            self.workers, self._seen_mtime, self._listed_at = self._live_workers(), mtime, time.monotonic()
        return max(1, cpu_count() // max(self.workers, self.own))

    def rebalance(self) -> int | None:
        """Apply this worker's share; the new thread count if it changed, else None."""
        threads = self.threads()
        if threads == torch.get_num_threads():
            return None
        torch.set_num_threads(threads)
        return threads
