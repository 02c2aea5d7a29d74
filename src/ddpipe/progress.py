"""The progress bar of an epoch on global rank 0, and its do-nothing twin on every other rank (and when
``train.progress_bar`` is off): the training loop updates it unconditionally."""

from __future__ import annotations

import sys
from typing import Protocol

from ddpipe.distributed import DistInfo
from ddpipe.metrics import EpochProgress


class Meter(Protocol):
    def local(self) -> EpochProgress: ...


class NullProgress:
    """No bar: does nothing."""

    def step(self, step: int, meter: Meter) -> None: ...
    def close(self) -> None: ...


class Progress(NullProgress):
    """tqdm over an epoch's optimizer steps, with the running loss and images/s every 10 steps."""

    def __init__(self, desc: str, total: int, initial: int, world_size: int) -> None:
        from tqdm import tqdm

        # In a log file (DVC, CI, a cluster) every refresh is a line: refresh rarely there.
        interval = 2.0 if sys.stderr.isatty() else 30.0
        self.world_size = world_size
        self.bar = tqdm(total=total, initial=initial, desc=desc, unit="step", mininterval=interval, leave=False,
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


def make_progress(info: DistInfo, enabled: bool, desc: str, total: int, initial: int) -> NullProgress:
    """A progress bar of ``total`` steps starting at ``initial`` on global rank 0, a do-nothing one elsewhere."""
    return Progress(desc, total, initial, info.world_size) if enabled and info.is_main else NullProgress()
