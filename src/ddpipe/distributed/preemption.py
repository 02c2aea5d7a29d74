"""Preemption: a stop signal ends training at a step every rank agrees on, after a checkpoint of that step.

Schedulers stop a job with a signal and kill it a grace period later: SLURM sends SIGTERM at the time
limit, on preemption and on ``scontrol requeue`` (then SIGKILL after KillWait), and SIGUSR1 ahead of
the time limit when asked to (``sbatch --signal=USR1@120``); Kubernetes sends SIGTERM on eviction
(then SIGKILL after terminationGracePeriodSeconds). torchrun forwards both to its workers when they
are in ``--signals-to-handle`` and waits ``--shutdown-timeout`` seconds before killing them.

In a worker, :class:`StopRequests` turns SIGTERM and SIGUSR1 into a flag. The trainer asks
:meth:`StopRequests.agreed` at every optimizer step (a one-integer all-reduce, so that every rank sees
the same answer at the same step even when the signal reached them at different times, overlapped
with the next step); when it says stop, global rank 0 writes a checkpoint of that step and every
rank raises ``ddpipe.core.exits.Preempted``. The process exits with ``EXIT_PREEMPTED``, and running the same
command again resumes from that step, ending with exactly the weights of an uninterrupted run.
"""

from __future__ import annotations

import signal
import sys
from typing import Any

import torch

from ddpipe.core.exits import STOP_SIGNALS, Preempted
from ddpipe.core.ranks import DistInfo
from ddpipe.distributed.group import flag_group, start_max


class StopRequests:
    """Within ``with``: SIGTERM and SIGUSR1 set a flag instead of ending the process. Each rank then
    calls :meth:`agreed` at the same points of the loop; the previous handlers come back on exit."""

    def __init__(self, info: DistInfo, timeout_s: int) -> None:
        self.signum = 0
        self._main = info.is_main
        self._group = flag_group(info, timeout_s)  # a CPU integer on a gloo group, on NCCL jobs too
        self._previous: dict[int, object] = {}
        self._pending: tuple[Any, torch.Tensor] | None = None

    def __enter__(self) -> StopRequests:
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._record)
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        # every rank issued the last exchange when all end normally or stop together: let it complete
        if self._pending is not None and (exc_type is None or exc_type is Preempted):
            self._pending[0].wait()
        self._pending = None

    def _record(self, signum: int, frame: object) -> None:
        if not self.signum and self._main:
            print(f"received {signal.Signals(signum).name}: stopping at the next step, after a checkpoint",
                  file=sys.stderr, flush=True)
        self.signum = self.signum or signum

    def agreed(self) -> int:
        """The stop signal's number if any rank had received one by the previous call, else 0. A
        collective: every rank calls it at the same points, and all get the same answer.

        Each call starts an all-reduce of this rank's flag and returns the one the previous call
        started, so the exchange overlaps a training step instead of adding its latency to it (one
        tiny gloo all-reduce: about 0.7 ms between 2 processes on one host here, BENCHMARKS.md); a stop
        comes one step later for it.
        """
        if self._group is None:
            return self.signum
        answer = 0
        if self._pending is not None:
            work, flag = self._pending
            work.wait()
            answer = int(flag.item())
        flag = torch.tensor([self.signum], dtype=torch.int32)
        self._pending = (start_max(flag, self._group), flag)
        return answer
