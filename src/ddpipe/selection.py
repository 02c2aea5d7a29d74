"""Which weights leave a training: the best validation epoch or the last one, and early stopping.

Every rank sees the same (all-reduced) validation accuracy, so every rank keeps the same best copy
and takes the same decision to stop; the copy travels in the checkpoints, so a resumed run exports
exactly what an uninterrupted one would.
"""

from __future__ import annotations

import torch
from torch import nn

from ddpipe.config.schema import TrainConfig


class ModelSelection:
    """Tracks the best validation accuracy's epoch (1-based; the earliest on ties) and its weights."""

    def __init__(self, cfg: TrainConfig) -> None:
        self.export, self.patience = cfg.export, cfg.early_stopping_patience
        self.best_epoch = 0
        self.best_val_accuracy = float("-inf")
        self.best_weights: dict[str, torch.Tensor] = {}

    def update(self, epoch: int, val_accuracy: float, module: nn.Module) -> bool:
        """Record epoch ``epoch``'s result; True if it is the new best (its weights are copied)."""
        if val_accuracy <= self.best_val_accuracy:
            return False
        self.best_epoch, self.best_val_accuracy = epoch, val_accuracy
        self.best_weights = {k: v.detach().to("cpu", copy=True) for k, v in module.state_dict().items()}
        return True

    def should_stop(self, epochs_done: int) -> bool:
        """Early stopping: ``patience`` epochs have passed without a better validation accuracy."""
        return self.patience is not None and self.best_epoch > 0 and epochs_done - self.best_epoch >= self.patience

    def exported(self, module: nn.Module, last_epoch: int) -> tuple[dict[str, torch.Tensor], int]:
        """(weights, epoch) that become ``paths.model``: the best epoch's, or the module's as it is now."""
        if self.export == "best" and self.best_weights:
            return self.best_weights, self.best_epoch
        return module.state_dict(), last_epoch

    def state_dict(self) -> dict[str, object]:
        """For the checkpoint (tensors and plain numbers only, so ``weights_only`` loading accepts it)."""
        return {"best_epoch": self.best_epoch, "best_val_accuracy": self.best_val_accuracy,
                "best_weights": self.best_weights}

    def load_state_dict(self, state: dict[str, object]) -> None:
        self.best_epoch = int(state["best_epoch"])  # type: ignore[arg-type]
        self.best_val_accuracy = float(state["best_val_accuracy"])  # type: ignore[arg-type]
        self.best_weights = dict(state["best_weights"])  # type: ignore[arg-type]
