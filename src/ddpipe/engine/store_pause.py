"""A checkpoint store that is away: a pause of a training's checkpoints, not the training's end (issue 69).

With ``paths.checkpoints = s3://...``, global rank 0 writes each checkpoint through a :class:`StorePause`. While the
store answers, a write is retried with backoff as every store request is (ddpipe.core.objectstore.retried: 15.5 s). One
that still fails starts an outage: the checkpoint is skipped, said once, and the training goes on; the next checkpoint
takes its place, each tried once while the store stays away (ddpipe.core.objectstore.tried_once), and the first that
goes through ends the outage, said too. Nothing the training computes depends on whether a checkpoint was written
(the RNG states are read, never drawn from), so its weights are those of a run the store never left; and the store's
newest whole checkpoint, an older one meanwhile, stays a valid resume point (S3 shows an object whole or not at all).
The training's last checkpoint has no later one to take its place: :meth:`StorePause.wait` waits for the store.

Away for ``ddpipe.core.objectstore.STORE_OUTAGE_S`` or more, counted from the first write that failed, the write that
finds it so (or the wait) gives the reason to stop: the Checkpointer raises StoreAway on every rank, and the process
exits 75 (EXIT_PREEMPTED) for its scheduler to run it again, resuming from the store's newest whole checkpoint.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import logging
import time
from collections.abc import Callable
from typing import Any

from ddpipe.core import objectstore
from ddpipe.core.objectstore import StoreError, tried_once

logger = logging.getLogger(__name__)

Save = Callable[[dict[str, Any]], None]


class StorePause:
    """Rank 0's checkpoints into the store that ``label`` names (its URL and endpoint, in words), through its outages.
    :meth:`write` returns None (written, or skipped while the store is away) or why the training stops."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.newest: str | None = None  # this run's newest checkpoint in the store (written, or resumed from)
        self.since: tuple[float, float] | None = None  # when the store went away: (time.monotonic(), time.time())
        self.skipped = 0  # checkpoints not written since then
        self.unwritten: tuple[str, str, dict[str, Any], Save] | None = None  # the newest of them: name, words, copy

    def write(self, name: str, words: str, state: dict[str, Any], save: Save) -> str | None:
        """``save(state)``: the checkpoint ``name`` (``words``: it in words), with the store's retries (while it is
        away: once). None once written or skipped; why the training stops when the store has been away too long."""
        started = (time.monotonic(), time.time())
        if (failed := self._attempt(name, words, state, save)) is None:
            return None
        self.since, self.skipped = self.since or started, self.skipped + 1
        if self.away_s() >= objectstore.STORE_OUTAGE_S:
            return self._too_long(words, failed)
        self.unwritten = (name, words, copy.deepcopy(state), save)  # the parts' tensors change as the training goes on
        if self.skipped == 1:
            logger.warning(f"warning: {self.label} is away since {_clock(self.since[1])} ({failed}): {words} is not "
                           "written; the training goes on, the next checkpoint takes its place, and it stops (exit "
                           f"75) if the store is still away {objectstore.STORE_OUTAGE_S:g} s from then "
                           f"(ddpipe.core.objectstore.STORE_OUTAGE_S); {self._newest()}")
        return None

    def wait(self) -> str | None:
        """The newest checkpoint not written (the training's last) written once the store is back: tried with backoff
        until ``STORE_OUTAGE_S`` after the store went away. None once written (or none to write); else why the training
        stops."""
        if self.unwritten is None or self.since is None:
            return None
        name, words, state, save = self.unwritten
        deadline = self.since[0] + objectstore.STORE_OUTAGE_S
        until = _clock(self.since[1] + objectstore.STORE_OUTAGE_S)
        logger.info(f"note: {self.label} is away since {_clock(self.since[1])}: waiting for it to take {words}, this "
                    f"training's last, until {until}")
        delays = objectstore.RETRY_DELAYS_S
        for delay in itertools.chain(delays, itertools.repeat(delays[-1])):
            time.sleep(max(0.0, min(delay, deadline - time.monotonic())))
            if (failed := self._attempt(name, words, state, save)) is None:
                return None
            if time.monotonic() >= deadline:
                return self._too_long(words, failed)
        raise AssertionError("unreachable")

    def away_s(self) -> float:
        """Seconds since the store went away (0: it answers)."""
        return 0.0 if self.since is None else time.monotonic() - self.since[0]

    def _attempt(self, name: str, words: str, state: dict[str, Any], save: Save) -> StoreError | None:
        """One write, with its retries (while the store is away: once); None once written, else what ended it."""
        try:
            with tried_once() if self.since else contextlib.nullcontext():
                save(state)
        except StoreError as exc:
            return exc
        if self.since is not None:
            logger.info(f"note: {self.label} is back after {self.away_s():.0f} s: {words} is written, the newest whole "
                        f"checkpoint there ({self.skipped - 1} skipped before it)")
        self.since, self.unwritten, self.skipped, self.newest = None, None, 0, name
        return None

    def _too_long(self, words: str, failed: StoreError) -> str:
        assert self.since is not None
        return (f"{self.label} has been away for {self.away_s():.0f} s (since {_clock(self.since[1])}), "
                f"{objectstore.STORE_OUTAGE_S:g} s or more (ddpipe.core.objectstore.STORE_OUTAGE_S): {words} is not "
                f"written ({failed}); {self._newest()}")

    def _newest(self) -> str:
        return f"the newest whole checkpoint there is {self.newest}" if self.newest else \
            "this run has no checkpoint there yet"


def _clock(when: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(when))
