"""How a training that was asked to stop ends: the signals that ask (a scheduler's), the exceptions that carry
the stop out of the loop (a signal's; the checkpoints' store away too long) and the exit code that says "run the same
command to resume". Plain definitions, so what only reads them (the tracker, and through it the evaluate stage)
imports nothing of ``ddpipe.distributed`` (``ddpipe.distributed.preemption`` turns the signals into a stop every rank
agrees on)."""

from __future__ import annotations

import signal

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

# EX_TEMPFAIL (sysexits.h): "a temporary failure; the user is invited to retry". A training that
# stopped for a signal with its progress saved exits with it, and one whose checkpoints' store was away too long (its
# newest whole checkpoint there); the same command resumes.
EXIT_PREEMPTED = 75


class Preempted(BaseException):
    """Training stopped for a stop signal at a step boundary, its progress saved. A BaseException, like
    KeyboardInterrupt: no ``except Exception`` swallows it on its way out."""

    def __init__(self, signum: int, epoch: int, step: int) -> None:
        self.signum, self.epoch, self.step = signum, epoch, step
        super().__init__(f"stopped by {signal.Signals(signum).name} at epoch {epoch + 1}, step {step}")


class StoreAway(BaseException):
    """Training stopped at a checkpoint that the store of its checkpoints did not take, that store away for
    ``ddpipe.core.objectstore.STORE_OUTAGE_S`` or more; its newest whole checkpoint is the store's. Raised on every rank
    at once (ddpipe.engine.checkpoint.Checkpointer); the process exits with ``EXIT_PREEMPTED``, for its scheduler to run
    it again, and the same command resumes from that checkpoint once the store answers. A BaseException, as
    :class:`Preempted` is: a stop, not an error."""


class TrialPruned(SystemExit):
    """A search's trial that its pruner stopped at a validation, on every rank at once (``ddpipe.engine.pruning``).
    A SystemExit carrying its message: the process exits non-zero printing that one line, without a traceback, so
    the train stage fails and a pruned trial leaves no output that looks like a finished training's."""

    def __init__(self, study: str, number: int, epoch: int, num_epochs: int, detail: str = "", step: int = 0) -> None:
        self.study, self.number, self.epoch, self.num_epochs = study, number, epoch, num_epochs
        where = pruned_where(epoch, step)
        super().__init__(f"trial {number} of search {study!r} pruned {where} of {num_epochs}{detail}")


def pruned_where(epoch: int, step: int = 0) -> str:
    """Where a pruner stopped a trial, in words: "after epoch 2", or "at step 40 of epoch 1" (epochs from 1)."""
    return f"at step {step} of epoch {epoch}" if step else f"after epoch {epoch}"
