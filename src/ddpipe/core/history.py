"""A training's history: one :class:`EpochStats` per epoch (``paths.history``, the run's MLflow metrics at step
``epoch``), and the metrics a search's trial may be judged by. No torch: ``ddpipe search`` checks ``search.metric``
against :data:`EPOCH_METRICS` without importing the training."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Protocol


class Progress(Protocol):
    """An epoch's training summed over every rank (``ddpipe.engine.meters.EpochProgress``)."""

    loss_sum: float
    correct: float
    count: float
    seconds: float


@dataclass
class EpochStats:
    """One epoch of the history (``paths.history``, MLflow metrics at step ``epoch``)."""

    epoch: int
    train_loss: float
    train_accuracy: float
    val_loss: float
    val_accuracy: float
    lr: float
    images_per_s: float
    epoch_seconds: float
    ema_val_loss: float | None = None  # the moving average of the weights (train.ema_decay), when kept
    ema_val_accuracy: float | None = None

    @classmethod
    def from_progress(cls, epoch: int, done: Progress, lr: float, val: tuple[float, float],
                      ema: tuple[float, float] | None = None) -> EpochStats:
        """Epoch ``epoch`` (0-based) from its training over every rank (``done``) and its validation's loss and
        accuracy (``val``; ``ema``: the weight average's)."""
        seen = max(done.count, 1.0)
        return cls(epoch=epoch + 1, train_loss=done.loss_sum / seen, train_accuracy=done.correct / seen,
                   val_loss=val[0], val_accuracy=val[1], lr=lr,
                   images_per_s=done.count / done.seconds if done.seconds > 0 else 0.0, epoch_seconds=done.seconds,
                   ema_val_loss=ema[0] if ema else None, ema_val_accuracy=ema[1] if ema else None)

    def summary(self, num_epochs: int) -> str:
        """The epoch's line in the training log."""
        ema = f" (ema: loss {self.ema_val_loss:.4f} acc {self.ema_val_accuracy:.4f})" \
            if self.ema_val_accuracy is not None else ""
        return (f"epoch {self.epoch}/{num_epochs}: train loss {self.train_loss:.4f} acc {self.train_accuracy:.4f} | "
                f"val loss {self.val_loss:.4f} acc {self.val_accuracy:.4f}{ema} | {self.images_per_s:.0f} images/s, "
                f"{self.epoch_seconds:.1f} s")

    def logged(self) -> dict[str, float]:
        """The epoch's MLflow metrics (the weight average's only when kept)."""
        return {k: v for k, v in asdict(self).items() if k != "epoch" and v is not None}

    def of_weights(self, metric: str, averaged: bool) -> float | None:
        """The figure ``metric`` (an epoch metric's name) of the weights the epoch hands on: the weight average's
        counterpart (``ema_val_accuracy`` for ``val_accuracy``) when those weights are the average (``averaged``).
        The one definition of a run's score, taken at the epoch its model comes from (the exported epoch): a search's
        trial reports it as its value, the train stage records it (``model_val_accuracy``, ``model_val_loss``) and
        the champion alias moves by it (``ddpipe.tracking.champion``)."""
        figures = self.logged()
        if averaged and not metric.startswith("ema_") and f"ema_{metric}" in figures:
            return figures[f"ema_{metric}"]
        return figures.get(metric)


# The metrics a trial may be judged by: the epoch's own, as EpochStats logs them (the ema_ ones need train.ema_decay)
EPOCH_METRICS = tuple(f.name for f in fields(EpochStats) if f.name != "epoch")
