"""Which weights leave a training: the best validation epoch or the last one, the raw weights or their moving
average (``ddpipe.engine.ema``) when it validates better, and early stopping.

Every rank sees the same (all-reduced) validation accuracy, so every rank keeps the same best copy
and takes the same decision to stop; the copy travels in the checkpoints, so a resumed run exports
exactly what an uninterrupted one would.
"""

from __future__ import annotations

import torch
from torch import nn

from ddpipe.config.schema import TrainConfig
from ddpipe.engine.ema import WeightAverage

RAW, EMA = "raw", "ema"  # which weights an epoch's result is of


class ModelSelection:
    """Tracks the best validation accuracy's epoch (1-based; the earliest on ties) and its weights. An epoch's
    accuracy is its better candidate's: the raw weights', or their average's when that is higher."""

    def __init__(self, cfg: TrainConfig) -> None:
        self.model_epoch, self.patience = cfg.model_epoch, cfg.early_stopping_patience
        self.best_epoch = 0
        self.best_val_accuracy = float("-inf")
        self.best_weights: dict[str, torch.Tensor] = {}
        self.best_source = self.last_source = RAW

    def update(self, epoch: int, val_accuracy: float, module: nn.Module, ema: WeightAverage | None = None,
               ema_accuracy: float | None = None) -> bool:
        """Record epoch ``epoch``'s result (and its weight average's, when one is kept); True if it is the new
        best (its weights, the better of the two, are copied)."""
        self.last_source = EMA if ema is not None and ema_accuracy is not None and ema_accuracy > val_accuracy \
            else RAW
        accuracy = ema_accuracy if self.last_source == EMA else val_accuracy
        if accuracy <= self.best_val_accuracy:
            return False
        self.best_epoch, self.best_val_accuracy, self.best_source = epoch, accuracy, self.last_source
        self.best_weights = ema.weights() if self.last_source == EMA else \
            {k: v.detach().to("cpu", copy=True) for k, v in module.state_dict().items()}
        return True

    def should_stop(self, epochs_done: int) -> bool:
        """Early stopping: ``patience`` epochs have passed without a better validation accuracy."""
        return self.patience is not None and self.best_epoch > 0 and epochs_done - self.best_epoch >= self.patience

    def exported(self, module: nn.Module, last_epoch: int, ema: WeightAverage | None = None
                 ) -> tuple[dict[str, torch.Tensor], int, str]:
        """(weights, epoch, raw or ema) that become ``paths.model``: the best epoch's, or the last epoch's better
        of the module as it is now and its average."""
        epoch, source = self.exported_epoch(last_epoch, ema is not None)
        if self._best_kept:
            return self.best_weights, epoch, source
        return (ema.weights() if source == EMA and ema is not None else module.state_dict()), epoch, source

    def exported_epoch(self, last_epoch: int, averaged: bool) -> tuple[int, str]:
        """The epoch and kind (raw or ema) of the weights :meth:`exported` would give if the training ended now;
        ``averaged``: a weight average is kept."""
        if self._best_kept:
            return self.best_epoch, self.best_source
        return last_epoch, EMA if self.last_source == EMA and averaged else RAW

    @property
    def _best_kept(self) -> bool:
        """The best epoch's copy is what leaves (train.model_epoch = best, once an epoch was validated)."""
        return self.model_epoch == "best" and bool(self.best_weights)

    def state_dict(self) -> dict[str, object]:
        """For the checkpoint (tensors, numbers and words only, so ``weights_only`` loading accepts it)."""
        return {"best_epoch": self.best_epoch, "best_val_accuracy": self.best_val_accuracy,
                "best_weights": self.best_weights, "best_source": self.best_source, "last_source": self.last_source}

    def load_state_dict(self, state: dict[str, object]) -> None:
        """What :meth:`state_dict` wrote (older checkpoints' forms are brought to it by
        ``ddpipe.engine.checkpoint.upgraded``)."""
        self.best_epoch = int(state["best_epoch"])  # type: ignore[arg-type]
        self.best_val_accuracy = float(state["best_val_accuracy"])  # type: ignore[arg-type]
        self.best_weights = dict(state["best_weights"])  # type: ignore[arg-type]
        self.best_source = str(state["best_source"])
        self.last_source = str(state["last_source"])
