"""Sums over the ranks of one host through shared memory, for CPU process groups (gloo).

gloo's all-reduce of a few hundred bytes between two processes on one host took 1.3-1.5 ms on a
2-core VM (a wake-up through the kernel on each side), and with a convolution between calls each
one cost 3.4 ms of a step (BENCHMARKS.md, "DDP on one host"). CPUSyncBatchNorm makes two such calls
per layer per step, DDP one per gradient bucket. Here every rank writes its tensor into its own slot of
one shared segment, raises its sequence number and spins until every rank has raised theirs, then
adds the slots in rank order: every rank gets the same bits, and for two ranks the same bits as gloo's
sum. Used when every rank of the group runs on this host, on x86-64 (whose store order makes a
plain sequence counter a correct flag), outside the world-size-exact mode
(``distributed.shared_memory``); tensors larger than a slot go through gloo as before.

A transport behind ``ddpipe.distributed``'s sums (``all_reduce_sum`` and the DDP hook it registers), not an API
of its own. A rank that dies is noticed at once (its pid is gone); one that stops answering makes the others
raise a timeout after ``distributed.timeout_s``, which the trainer reports like gloo's.
"""

import logging
import os
import platform
import secrets
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ddpipe.core.processes import alive

logger = logging.getLogger(__name__)

SLOT_BYTES = 1 << 20  # per rank and parity: BatchNorm statistics and DDP's first (1 MiB) gradient bucket
SHM_DIR = Path("/dev/shm")
_LINE = 64  # bytes: one sequence number per cache line, so ranks do not write the same line


class SegmentUnavailable(OSError):
    """The shared segment could not be made or mapped on some rank (every rank raises it together)."""


class HostReduce:
    """One shared segment for the ranks of this host; :meth:`all_reduce_` sums a tensor in place."""

    def __init__(self, rank: int, world: int, timeout_s: float) -> None:
        self.rank, self.world, self.timeout_s, self.seq = rank, world, timeout_s, 0
        header = 2 * _LINE * world
        size = header + 2 * world * SLOT_BYTES
        name = [f"ddpipe-{os.getuid()}-{secrets.token_hex(8)}" if rank == 0 else None]
        dist.broadcast_object_list(name, src=0)
        path, buf, error = SHM_DIR / name[0], None, ""

        def any_rank_failed() -> bool:
            failed = torch.tensor([bool(error)], dtype=torch.int32)
            dist.all_reduce(failed)
            return bool(failed.item())

        try:
            if rank == 0:
                with open(path, "wb") as f:
                    os.posix_fallocate(f.fileno(), 0, size)  # the space now, not a SIGBUS at the first write
        except OSError as exc:
            error = f"{path}: {exc}"
        failed = any_rank_failed()  # every rank learns whether rank 0 could make it
        if not failed:
            try:
                buf = torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8)
            except (OSError, RuntimeError) as exc:
                error = f"{path}: {exc}"
            failed = any_rank_failed()  # every rank has it mapped (or one could not): the name can go
        if rank == 0:
            path.unlink(missing_ok=True)
        if failed:
            raise SegmentUnavailable(error or f"{size} bytes in {SHM_DIR}: another rank could not map them")
        self._seqs = buf[:_LINE * world].view(torch.int64)[::_LINE // 8]
        self._pids = buf[_LINE * world:header].view(torch.int64)[::_LINE // 8]
        self._slots = buf[header:].view(2, world, SLOT_BYTES)
        self._pids[rank] = os.getpid()
        dist.barrier()
        self.pids = self._pids.tolist()

    def fits(self, t: torch.Tensor) -> bool:
        return t.device.type == "cpu" and t.is_contiguous() and t.numel() * t.element_size() <= SLOT_BYTES

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` replaced by its sum over the ranks (every rank calls this with the same shape and dtype)."""
        self.seq += 1
        slots = self._slots[self.seq % 2, :, :t.numel() * t.element_size()].view(self.world, -1).view(t.dtype)
        slots[self.rank].copy_(t.view(-1))
        self._seqs[self.rank] = self.seq  # after the data: x86-64 keeps stores in order
        self._wait(self.seq)
        total = slots[0].clone()
        for r in range(1, self.world):
            total += slots[r]
        t.view(-1).copy_(total)
        return t

    def _wait(self, seq: int) -> None:
        spins, start = 0, None
        while int(self._seqs.min()) < seq:
            spins += 1
            if spins < 500:  # about the wait of a balanced step; longer spins only burn a core
                continue
            os.sched_yield()  # more runnable threads than cores: let the others run
            if spins % 500:
                continue
            start = start or time.monotonic()
            late = [r for r in range(self.world) if int(self._seqs[r]) < seq]
            for r in late:
                if not alive(self.pids[r]):
                    raise RuntimeError(f"rank {r} (pid {self.pids[r]}) exited during a shared-memory "
                                       f"all-reduce (call {seq} of this rank)")
            if time.monotonic() - start > self.timeout_s:
                raise RuntimeError(f"shared-memory all-reduce timed out after {self.timeout_s:g} s waiting for "
                                   f"rank(s) {late} (call {seq} of this rank)")


def usable(world_size: int, processes_on_host: int, device: torch.device, backend: str | None) -> bool:
    """Every rank on this host, CPU tensors over gloo, x86-64, and a /dev/shm to share."""
    return (world_size > 1 and processes_on_host == world_size and device.type == "cpu" and backend == "gloo"
            and platform.machine().lower() in ("x86_64", "amd64") and SHM_DIR.is_dir())


def open_segment(rank: int, world: int, timeout_s: float) -> HostReduce | None:
    """The segment of this host's ranks (a collective: every rank calls it), or None if it cannot be made (a full
    or missing /dev/shm): rank 0 then says why, and the caller's sums stay on gloo."""
    try:
        return HostReduce(rank, world, timeout_s)
    except SegmentUnavailable as exc:
        if rank == 0:
            logger.warning(f"warning: shared-memory sums unavailable ({exc}); summing over gloo")
        return None


# No `from __future__ import annotations` in this module: DDP checks the hook's annotations as objects.
def ddp_comm_hook(state: HostReduce, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's gradient averaging (``register_comm_hook(segment, ddp_comm_hook)``) through the segment ``state``:
    like DDP's default hook, each rank divides by the world size, then the ranks sum (a bucket too large for a
    slot goes through gloo)."""
    grads = bucket.buffer()
    grads.div_(dist.get_world_size())
    if state.fits(grads):
        future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        future.set_result(state.all_reduce_(grads))
        return future
    return dist.all_reduce(grads, async_op=True).get_future().then(lambda f: f.value()[0])
