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

A launcher that dies is a stop too (:func:`follow_launcher`). torchrun starts its workers in sessions of their own,
so a SIGKILL to the launcher's process group (``kill -9 -PGID``, the out-of-memory killer, a closed session's
supervisor) leaves them running, orphaned. Each worker watches the torchrun agent that started it and the
``python -m ddpipe.launch`` above it (:data:`LAUNCHER_ENV`); when either ends, by any signal, the worker sends
itself SIGTERM: inside the training loop it stops at the next step after rank 0's checkpoint, exactly as a
preemption does (every rank of every node agrees on that step), and anywhere else it ends at once.
"""

from __future__ import annotations

import logging
import os
import signal
import stat
import threading
import time
from typing import Any

import torch

from ddpipe.core.environment import LAUNCHER_ENV
from ddpipe.core.exits import STOP_SIGNALS, Preempted, StoreAway
from ddpipe.core.processes import alive, start_time
from ddpipe.core.ranks import DistInfo
from ddpipe.distributed.group import flag_group, start_max

logger = logging.getLogger(__name__)


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
        # every rank issued the last exchange when all end normally or stop together (a signal, a store away): let it
        # complete
        if self._pending is not None and exc_type in (None, Preempted, StoreAway):
            self._pending[0].wait()
        self._pending = None

    def _record(self, signum: int, frame: object) -> None:
        if not self.signum and self._main:
            logger.warning(f"received {signal.Signals(signum).name}: stopping at the next step, after a checkpoint")
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
            if self.signum:
                STOPPING.set()
            return self.signum
        answer = 0
        if self._pending is not None:
            work, flag = self._pending
            work.wait()
            answer = int(flag.item())
        flag = torch.tensor([self.signum], dtype=torch.int32)
        self._pending = (start_max(flag, self._group), flag)
        if answer:
            STOPPING.set()
        return answer


# How often a worker looks at its launcher and torchrun agent (a read of /proc each: about 20 us), and a launcher at
# the DVC process above it: a stop lands within a tenth of a second of the kill, inside the epoch it came in
FOLLOW_EVERY_S = 0.1
# How long a worker whose launcher died waits for its training to reach a step boundary (the stop agreed, its
# checkpoint under way) before it leaves at once (inside a validation pass, or writing a finished training's
# outputs), and then for that checkpoint to be written: the run resumes from its newest checkpoint either way
STEP_GRACE_S, CHECKPOINT_GRACE_S = 3.0, 60.0
# Set once every rank agreed to stop (StopRequests.agreed): the step's checkpoint is being written
STOPPING = threading.Event()


def launcher_env() -> dict[str, str]:
    """What the launcher puts in torchrun's environment so that the workers follow it."""
    return {LAUNCHER_ENV: f"{os.getpid()} {start_time(os.getpid()) or ''}"}


def follow_launcher(label: str) -> threading.Thread | None:
    """Under torchrun or ddpipe.launch: a daemon thread that stops this worker (SIGTERM to itself) once the torchrun
    agent that started it or the launcher above it has ended; None for a process started otherwise (a plain
    ``python stages/train_worker.py`` goes on when its shell ends, as ``nohup`` users expect). ``label``: how the
    note names this process (its rank)."""
    watched: dict[str, tuple[int, str | None]] = {}
    if "TORCHELASTIC_RUN_ID" in os.environ:
        parent = os.getppid()
        watched["torchrun agent"] = (parent, start_time(parent) if parent != 1 else None)
    if spec := os.environ.get(LAUNCHER_ENV, "").split():
        watched["launcher (python -m ddpipe.launch)"] = (int(spec[0]), spec[1] if len(spec) > 1 else None)
    if not watched:
        return None
    thread = threading.Thread(target=_follow, args=(watched, label), name="ddpipe-follow-launcher", daemon=True)
    thread.start()
    return thread


def _follow(watched: dict[str, tuple[int, str | None]], label: str) -> None:
    while True:
        for name, (pid, started) in watched.items():
            if pid == 1 or not alive(pid, started):  # pid 1: the agent was gone before this worker looked
                quiet_orphaned_output()
                logger.warning(f"{label}: the {name} (pid {pid}) has ended: stopping at the next step, after a "
                               "checkpoint")
                os.kill(os.getpid(), signal.SIGTERM)
                if not STOPPING.wait(STEP_GRACE_S):
                    _leave(f"{label}: no step boundary within {STEP_GRACE_S:g} s (a validation pass, or the outputs "
                           "of a finished training): leaving now; the run resumes from its newest checkpoint")
                time.sleep(CHECKPOINT_GRACE_S)
                _leave(f"{label}: the stop's checkpoint was not written within {CHECKPOINT_GRACE_S:g} s: leaving now")
        time.sleep(FOLLOW_EVERY_S)


def _leave(why: str) -> None:
    """End this process at once (its launcher is gone: nobody waits for what is left to do), saying why."""
    logger.warning(why)
    os._exit(128 + signal.SIGTERM)


def quiet_orphaned_output() -> None:
    """Point stdout and stderr at /dev/null where they are a pipe or a socket: its reader (the launcher, a ``| tee``
    in the killed group) is likely gone, and a write to it would raise BrokenPipeError in the middle of the stop. A
    file (a log) or a terminal keeps the last lines."""
    null = None
    for fd in (1, 2):
        try:
            if not (stat.S_ISFIFO(os.fstat(fd).st_mode) or stat.S_ISSOCK(os.fstat(fd).st_mode)):
                continue
            null = null if null is not None else os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, fd)
        except OSError:
            continue
