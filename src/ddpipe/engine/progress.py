"""An epoch's progress on global rank 0, and its do-nothing twin on every other rank (and when
``train.progress_bar`` is off): the training loop updates it unconditionally.

On a terminal it is a tqdm bar. Where stderr is not a terminal (``dvc repro > log 2>&1``, a SLURM job's output,
CI) a bar's carriage-return redraws pile up into one endless line of the log, so there it is a plain line (a message
of this module's logger) at every fifth of the epoch and at least every two minutes; the loop's epoch line follows
each epoch's last step. Neither where ddpipe's messages are not shown at INFO (``-q``)."""

from __future__ import annotations

import logging
import math
import sys
import time
from collections.abc import Callable
from typing import Protocol

from ddpipe.core.ranks import DistInfo
from ddpipe.engine.meters import EpochProgress

LINES_PER_EPOCH = 5  # a line at every 1/5 of the epoch (not at its end: the epoch line says it)
LINE_EVERY_S = 120.0  # and one at least this often, so a log of long epochs still shows it is alive

logger = logging.getLogger(__name__)


class Meter(Protocol):
    def local(self) -> EpochProgress: ...


class NullProgress:
    """No progress shown: does nothing."""

    def step(self, step: int, meter: Meter) -> None: ...
    def close(self) -> None: ...


class Progress(NullProgress):
    """tqdm over an epoch's optimizer steps, with the running loss and images/s every 10 steps (a terminal)."""

    def __init__(self, desc: str, total: int, initial: int, world_size: int) -> None:
        from tqdm import tqdm

        self.world_size = world_size
        self.bar = tqdm(total=total, initial=initial, desc=desc, unit="step", mininterval=2.0, leave=False,
                        dynamic_ncols=True)

    def step(self, step: int, meter: Meter) -> None:
        """One more step done; ``meter``: this rank's epoch so far (read every 10 steps only: on CUDA reading it
        waits for the device)."""
        self.bar.update(1)
        if step % 10 == 0:
            now = meter.local()
            rate = now.count * self.world_size / now.seconds
            self.bar.set_postfix(loss=f"{now.loss_sum / now.count:.4f}", img_s=f"{rate:.0f}")

    def close(self) -> None:
        self.bar.close()


class LineProgress(NullProgress):
    """A plain line now and then (a log file), through ``say``: ``epoch 2/5: step 120/300 (40%), loss 0.4321, 5230
    images/s, 0:12 elapsed, 0:18 left``, at every ``1/LINES_PER_EPOCH`` of the epoch and at least every
    ``LINE_EVERY_S``. The figures are this process's since it started the epoch (a resumed epoch: since the resume)."""

    def __init__(self, desc: str, total: int, initial: int, world_size: int, say: Callable[[str], None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.desc, self.total, self.initial, self.world_size = desc, total, initial, world_size
        self.say, self.clock = say, clock
        self.every = max(1, math.ceil(total / LINES_PER_EPOCH))
        self.next_step = (initial // self.every + 1) * self.every
        self.started = self.last = clock()

    def step(self, step: int, meter: Meter) -> None:
        """One more step done; reads ``meter`` only when a line is due (on CUDA reading it waits for the device)."""
        now = self.clock()
        if step >= self.total or (step < self.next_step and now - self.last < LINE_EVERY_S):
            return
        self.next_step, self.last = (step // self.every + 1) * self.every, now
        self.say(self._line(step, meter.local(), now - self.started))

    def _line(self, step: int, so_far: EpochProgress, elapsed: float) -> str:
        done = step - self.initial
        left = elapsed / done * (self.total - step) if done > 0 else 0.0
        loss = f"loss {so_far.loss_sum / so_far.count:.4f}, " if so_far.count else ""
        rate = so_far.count * self.world_size / max(elapsed, 1e-9)
        return (f"{self.desc}: step {step}/{self.total} ({100 * step / self.total:.0f}%), {loss}{rate:.0f} images/s, "
                f"{_clock(elapsed)} elapsed, {_clock(left)} left")


def _clock(seconds: float) -> str:
    """``1:02:03`` or ``2:03``."""
    minutes, s = divmod(round(seconds), 60)
    h, m = divmod(minutes, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def make_progress(info: DistInfo, enabled: bool, desc: str, total: int, initial: int) -> NullProgress:
    """The epoch's progress of ``total`` steps from ``initial`` on global rank 0 (a bar on a terminal, plain lines
    in a log), a do-nothing one elsewhere and where INFO messages are not shown."""
    if not (enabled and info.is_main and logger.isEnabledFor(logging.INFO)):
        return NullProgress()
    if sys.stderr.isatty():
        return Progress(desc, total, initial, info.world_size)
    return LineProgress(desc, total, initial, info.world_size, logger.info)
