"""Trainings that run at once on one host share its cores: threads per process = cores / worker processes.

Every training worker on a CPU host registers itself in a per-user directory (one small file per
process, holding the threads it claims: its ``distributed.threads_per_process``, or 0 when it takes a
share). A sharing worker's intra-op threads are the cores that fixed workers leave, divided by the
sharing workers alive on the host, re-read between optimizer steps: a training alone keeps today's
threads (cores / its own processes); when a second starts (``dvc queue start -j 2``), both shrink to
their share within a step, and grow back when it ends. A training with fixed threads keeps them and is
counted by the others. Neither DVC, torchrun nor MLflow does this: without it each training takes every
core and two at once ran 5x slower each (BENCHMARKS.md). Threads change the float rounding, so a change
is printed and recorded with the run (``threads_per_process``, at the optimizer step it took effect).

GPUs cannot be re-split under a running DDP job, so they are leased at launch (:class:`GpuLease`, taken
by ``ddpipe.launch`` before torchrun starts): a training takes its GPUs from those no live training on
the host holds: ``nproc_per_node`` of them, or with ``auto`` the visible GPUs divided by the trainings
expected at once (the DVC queue workers alive on the host, ``dvc queue start -j N``, or the trainings
holding a lease, plus this one), and waits while none it needs are free. Its workers see only those
(``CUDA_VISIBLE_DEVICES``), and the run records them (``visible_gpus``).
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from ddpipe.core.devices import cpu_count
from ddpipe.core.processes import alive, host_lock, start_time

logger = logging.getLogger(__name__)

REGISTRY = Path(tempfile.gettempdir()) / f"ddpipe-{os.getuid()}-workers"
GPU_REGISTRY = Path(tempfile.gettempdir()) / f"ddpipe-{os.getuid()}-gpus"
RECHECK_S = 5.0  # also re-list this often, to notice workers that died without unregistering


class HostShare:
    """This worker's entry in the host's registry, and the threads it should run with."""

    def __init__(self, fixed_threads: int | None, own_processes: int, enabled: bool = True,
                 registry: Path = REGISTRY) -> None:
        """``own_processes``: this training's processes on this host (its share never drops below
        cores / that, whatever the registry says while its own workers are still registering);
        ``enabled``: False for GPU workers, whose threads stay as distributed.init_distributed set them."""
        self.fixed, self.own, self.enabled, self.registry = fixed_threads, own_processes, enabled, registry
        self.entry: Path | None = None
        self._seen_mtime, self._listed_at, self.workers, self.claimed = -1, 0.0, own_processes, 0

    def __enter__(self) -> HostShare:
        if self.enabled and start_time(os.getpid()) is not None:  # Linux: /proc names the process
            self.entry = _claim(self.registry, str(self.fixed or 0))
        if self.enabled:  # from the first step: the fixed count (auto's measured one too), or this host's share
            self.rebalance()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.entry is not None:
            self.entry.unlink(missing_ok=True)
            self.entry = None

    def _live_workers(self) -> tuple[int, int]:
        """(sharing workers, threads claimed by fixed workers) alive on the host; entries of dead ones pruned."""
        sharing, claimed = 0, 0
        for content in _live_entries(self.registry).values():
            fixed = int(content) if content.strip().isdigit() else 0
            sharing, claimed = (sharing + 1, claimed) if fixed <= 0 else (sharing, claimed + fixed)
        return max(1, sharing), claimed

    def threads(self) -> int:
        """Threads per process for this worker now: the fixed setting, or the cores that fixed workers
        leave / live sharing workers (at least 1)."""
        if self.fixed:
            return self.fixed
        if self.entry is None:  # not sharing: GPU workers, or no /proc
            return torch.get_num_threads()
        mtime = self.registry.stat().st_mtime_ns  # a worker came or went (cheap: one stat per step)
        if mtime != self._seen_mtime or time.monotonic() - self._listed_at > RECHECK_S:
            (self.workers, self.claimed), self._seen_mtime, self._listed_at = \
                self._live_workers(), mtime, time.monotonic()
        return max(1, (cpu_count() - self.claimed) // max(self.workers, self.own))

    def cores(self, device: torch.device) -> int:
        """Cores this rank may use: its CPU threads' share of the host, or on CUDA the host's cores over this
        job's processes on it."""
        return max(1, cpu_count() // self.own) if device.type == "cuda" else self.threads()

    def rebalance(self) -> int | None:
        """Apply this worker's share; the new thread count if it changed, else None."""
        threads = self.threads()
        if threads == torch.get_num_threads():
            return None
        torch.set_num_threads(threads)
        return threads


@contextmanager
def cpu_share(fixed_threads: int | None, registry: Path = REGISTRY) -> Iterator[int]:
    """A CPU stage that is not a training (evaluate, export) takes its share of the host like one: registered for its
    duration as one process, its intra-op threads ``fixed_threads`` (``distributed.threads_per_process``) or the cores
    the trainings alive on the host leave it, set once and yielded. Alone on the host it takes every core; beside a
    training, half; each thread more than the cores a process gets costs it many times over, spinning in OpenMP's
    barriers (BENCHMARKS.md, "The test suite")."""
    with HostShare(fixed_threads, 1, registry=registry) as share:
        threads = share.threads() if share.entry is not None or fixed_threads else cpu_count()
        torch.set_num_threads(threads)
        yield threads


def _claim(registry: Path, content: str) -> Path:
    """This process's entry ``<pid>-<start time>`` in ``registry`` holding ``content``, written whole
    under another name and then renamed: a reader never sees a half-written one."""
    registry.mkdir(parents=True, exist_ok=True)
    entry = registry / f"{os.getpid()}-{start_time(os.getpid())}"
    staged = registry / f"staged.{os.getpid()}"
    staged.write_text(content)
    os.replace(staged, entry)
    return entry


def _live_entries(registry: Path) -> dict[Path, str]:
    """The entries of live processes in ``registry`` and what they hold; dead processes' are removed."""
    live = {}
    for path in registry.glob("*-*"):
        pid, _, start = path.name.partition("-")
        if pid.isdigit() and alive(int(pid), start):
            try:
                live[path] = path.read_text()
            except OSError:  # unregistered meanwhile
                continue
        else:  # its process is gone: killed outright, or a pid reused since
            path.unlink(missing_ok=True)
    return live


def dvc_queue_worker_pids() -> set[int]:
    """DVC experiment-queue workers alive on this host: ``dvc queue start -j N`` starts N, each running
    one experiment at a time (``dvc exp queue-worker dvc-exp-<repo hash>-<i>@localhost``)."""
    pids = set()
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        if b"queue-worker" in args and any(a.startswith(b"dvc-exp-") for a in args):
            pids.add(int(cmdline.parent.name))
    return pids


def dvc_queue_workers() -> int:
    return len(dvc_queue_worker_pids())


def visible_gpus() -> list[str]:
    """This process's GPUs as the driver names them: CUDA_VISIBLE_DEVICES's entries, else 0..N-1."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None and listed.strip():
        return [g.strip() for g in listed.split(",") if g.strip()][:torch.cuda.device_count()]
    return [str(i) for i in range(torch.cuda.device_count())]


class GpuLease:
    """GPUs of this host leased to one training (the launcher process holds the lease while torchrun runs).

    ``count``: GPUs wanted (``nproc_per_node``), or None for ``auto``: an equal share of ``gpus`` among
    the trainings expected at once (``expected()``: DVC queue workers alive), or among those holding a
    lease plus this one, whichever is more; at least 1. Taken when enough are free (``auto``: any), else
    it waits, saying so once, and looks again every ``poll_s``."""

    def __init__(self, gpus: list[str], count: int | None, registry: Path = GPU_REGISTRY,
                 expected: Callable[[], int] = dvc_queue_workers, poll_s: float = 5.0) -> None:
        self.pool, self.count, self.registry, self.expected, self.poll_s = gpus, count, registry, expected, poll_s
        self.entry: Path | None = None
        self.gpus: list[str] = []

    def _try_take(self) -> list[str] | None:
        self.registry.mkdir(parents=True, exist_ok=True)
        with host_lock(self.registry / "lock"):  # one launcher at a time lists and claims
            leases = _live_entries(self.registry)
            held = {g for content in leases.values() for g in content.split(",") if g}
            free = [g for g in self.pool if g not in held]
            want = self.count or max(1, len(self.pool) // max(1, self.expected(), len(leases) + 1))
            if len(free) < (self.count or 1):
                return None
            taken = free[:want]
            self.entry = _claim(self.registry, ",".join(taken))
            return taken

    def __enter__(self) -> GpuLease:
        said = False
        while (taken := self._try_take()) is None:
            if not said:
                logger.info(f"ddpipe.launch: waiting for {self.count or 1} free GPU(s) of {','.join(self.pool)}: "
                            f"other trainings on this host hold them (leases in {self.registry})")
                said = True
            time.sleep(self.poll_s)
        self.gpus = taken
        return self

    def __exit__(self, *exc: object) -> None:
        if self.entry is not None:
            self.entry.unlink(missing_ok=True)
            self.entry = None
