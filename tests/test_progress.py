"""An epoch's progress as a person reads it: a bar on a terminal, a few plain lines in a log file."""

from __future__ import annotations

import io
import sys
from collections.abc import Callable

import pytest

from ddpipe.core.ranks import DistInfo
from ddpipe.engine.meters import EpochProgress
from ddpipe.engine.progress import LINE_EVERY_S, LineProgress, NullProgress, Progress, make_progress


class FakeMeter:
    """The sums of ``steps`` steps of ``batch`` samples at a loss of 0.5, 0.1 s each."""

    def __init__(self, batch: int = 64) -> None:
        self.batch, self.steps = batch, 0

    def local(self) -> EpochProgress:
        return EpochProgress(0.5 * self.batch * self.steps, 0.0, float(self.batch * self.steps), 0.1 * self.steps)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _into(out: io.StringIO) -> Callable[[str], None]:
    """A LineProgress's ``say`` that writes its lines into ``out``, as the handler writes them to stderr."""
    return lambda line: print(line, file=out)


def _run(progress: NullProgress, meter: FakeMeter, clock: FakeClock, steps: range, seconds_per_step: float) -> None:
    for step in steps:
        clock.now += seconds_per_step
        meter.steps = step - steps.start + 1
        progress.step(step, meter)
    progress.close()


def test_in_a_log_an_epoch_is_a_few_plain_lines() -> None:
    """Not a terminal: a line at each fifth of the epoch (none at its end: the epoch line follows), no carriage
    return, every line short, and the figures right (64 images a step, 0.1 s a step, 2 processes)."""
    out, clock, meter = io.StringIO(), FakeClock(), FakeMeter()
    _run(LineProgress("epoch 2/5", 300, 0, 2, _into(out), clock), meter, clock, range(1, 301), 0.1)
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue() and all(len(line) <= 120 for line in lines)
    assert [line.split(",")[0] for line in lines] == [f"epoch 2/5: step {s}/300 ({s // 3}%)"
                                                      for s in (60, 120, 180, 240)]
    assert lines[0] == "epoch 2/5: step 60/300 (20%), loss 0.5000, 1280 images/s, 0:06 elapsed, 0:24 left"


def test_in_a_log_a_long_epoch_still_says_it_is_alive() -> None:
    """Steps of 50 s: a line at least every LINE_EVERY_S, though the next fifth is far off."""
    out, clock, meter = io.StringIO(), FakeClock(), FakeMeter()
    _run(LineProgress("epoch 1/1", 1000, 0, 1, _into(out), clock), meter, clock, range(1, 21), 50.0)
    steps = [int(line.split("step ")[1].split("/")[0]) for line in out.getvalue().splitlines()]
    assert steps == [3, 6, 9, 12, 15, 18] and 3 * 50.0 >= LINE_EVERY_S > 2 * 50.0


def test_a_resumed_epoch_counts_from_its_resume() -> None:
    """Resumed at step 130 of 300: the next line at the next fifth (180), the rate over the steps run here."""
    out, clock, meter = io.StringIO(), FakeClock(), FakeMeter()
    _run(LineProgress("epoch 1/2", 300, 130, 1, _into(out), clock), meter, clock, range(131, 301), 0.1)
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("epoch 1/2: step 180/300 (60%), loss 0.5000, 640 images/s, 0:05 elapsed, 0:12 left")
    assert len(lines) == 2


def test_a_terminal_gets_the_bar_a_log_gets_lines_other_ranks_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "stderr", Terminal())
    bar = make_progress(DistInfo(), True, "epoch 1/1", 30, 0)
    assert isinstance(bar, Progress)
    _run(bar, FakeMeter(), FakeClock(), range(1, 31), 0.0)
    assert "\r" in sys.stderr.getvalue()  # tqdm redraws its line in place
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert isinstance(make_progress(DistInfo(), True, "epoch 1/1", 30, 0), LineProgress)
    assert type(make_progress(DistInfo(), False, "epoch 1/1", 30, 0)) is NullProgress
    assert type(make_progress(DistInfo(rank=1, world_size=2), True, "epoch 1/1", 30, 0)) is NullProgress
