"""What a training measures, counted exactly over the ranks: an epoch's running sums, the loss and
accuracy over a whole split, and the numbers a finished run reports."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ddpipe.core.devices import PrecisionPolicy
from ddpipe.core.history import EpochStats
from ddpipe.core.metric_names import MODEL_VAL_ACCURACY
from ddpipe.core.ranks import DistInfo
from ddpipe.data.loaders import real_sample_mask
from ddpipe.data.transforms import BatchTransform
from ddpipe.distributed import group as dd
from ddpipe.models.nets import predict_logits


@dataclass(frozen=True)
class EpochProgress:
    """An epoch's training so far: its loss sum, correct predictions and samples, and its seconds. Summed over
    every rank, it is what a mid-epoch checkpoint records (:meth:`as_state`) and a resumed epoch
    continues from; one rank's, what the progress bar shows."""

    loss_sum: float = 0.0
    correct: float = 0.0
    count: float = 0.0
    seconds: float = 0.0

    def as_state(self) -> dict[str, torch.Tensor]:
        """The checkpoint's form: each field by name, a float64 scalar."""
        return {f.name: torch.tensor(getattr(self, f.name), dtype=torch.float64) for f in fields(self)}

    @classmethod
    def from_state(cls, state: dict[str, torch.Tensor]) -> EpochProgress:
        """What :meth:`as_state` wrote (older checkpoints' forms are brought to it by
        ``ddpipe.engine.checkpoint.upgraded``)."""
        return cls(**{name: float(v) for name, v in state.items()})


class EpochMeter:
    """An epoch's loss sum, correct predictions and samples on this rank, and its seconds, continuing from
    what a mid-epoch checkpoint recorded of the steps before (``resumed``; an empty one at an epoch's start).
    The sums stay on the device as one float64 tensor [loss sum, correct, count], summed over the ranks in one
    collective; they leave it named, as an :class:`EpochProgress`."""

    def __init__(self, device: torch.device, resumed: EpochProgress) -> None:
        self.sums = torch.zeros(3, dtype=torch.float64, device=device)  # [loss sum, correct, count]
        self.resumed, self.t0 = resumed, time.perf_counter() - resumed.seconds

    def add(self, loss: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor) -> None:
        with torch.no_grad():
            self.sums += torch.stack([loss.detach().double() * len(labels),
                                      (logits.argmax(1) == labels).sum().double(),
                                      torch.tensor(float(len(labels)), dtype=torch.float64, device=self.sums.device)])

    def seconds(self) -> float:
        return time.perf_counter() - self.t0

    def _named(self, sums: torch.Tensor) -> EpochProgress:
        loss_sum, correct, count = sums.tolist()
        return EpochProgress(loss_sum=loss_sum, correct=correct, count=count, seconds=self.seconds())

    def local(self) -> EpochProgress:
        """This rank's sums since the epoch (re)started, and the epoch's seconds (the progress bar's figures)."""
        return self._named(self.sums)

    def _resumed_sums(self) -> torch.Tensor:
        r = self.resumed
        return torch.tensor([r.loss_sum, r.correct, r.count], dtype=torch.float64, device=self.sums.device)

    def so_far(self, info: DistInfo) -> EpochProgress:
        """Sums over every rank and seconds so far, for a mid-epoch checkpoint (a collective)."""
        return self._named(dd.all_reduce_sum(self.sums.clone(), info) + self._resumed_sums())

    def total(self, info: DistInfo) -> EpochProgress:
        """The epoch's sums over every rank (a collective) and its seconds."""
        sums = dd.all_reduce_sum(self.sums, info)
        sums += self._resumed_sums()
        return self._named(sums)


class StepLog:
    """Every ``every`` optimizer steps (``train.log_every_n_steps``; 0: per epoch only), on global rank 0: the mean
    training loss of this rank's samples since the last record, the learning rate the step used, the global gradient
    norm before clipping and images/s (this rank's, times the world size), to ``tracker`` at the global step
    (``epoch * steps_per_epoch + step``, as ``threads_per_process``) as ``train_loss_step``, ``lr_step``,
    ``grad_norm`` and ``images_per_s_step``. One host sync per record (the meter's sums), none between; the record
    goes through the run's outbox, as an epoch's does."""

    def __init__(self, every: int, steps_per_epoch: int, info: DistInfo) -> None:
        self.every = every if info.is_main else 0
        self.steps_per_epoch, self.world_size = steps_per_epoch, info.world_size
        self.last: tuple[EpochMeter, EpochProgress] | None = None

    def after(self, epoch: int, step: int, meter: EpochMeter, lr: float, norm: torch.Tensor | None,
              tracker: Any) -> None:
        """After step ``step`` (from 1) of ``epoch`` (from 0), whose figures ``meter`` holds."""
        if not self.every or step % self.every:
            return
        now = meter.local()
        before = self.last[1] if self.last and self.last[0] is meter else EpochProgress(seconds=meter.resumed.seconds)
        count = now.count - before.count
        if count <= 0:
            return
        metrics = {"train_loss_step": (now.loss_sum - before.loss_sum) / count, "lr_step": lr,
                   "images_per_s_step": count * self.world_size / max(now.seconds - before.seconds, 1e-9),
                   **({"grad_norm": float(norm)} if norm is not None else {})}
        tracker.log_metrics(metrics, step=epoch * self.steps_per_epoch + step)
        self.last = (meter, now)


@torch.no_grad()
def measure_split(model: nn.Module, batches: Iterable[tuple], n: int, transform: BatchTransform, info: DistInfo,
                   compute: PrecisionPolicy, flips: bool = False) -> tuple[float, float]:
    """(mean loss, accuracy) over a split of ``n`` samples, spread over the ranks: ``batches`` is this
    rank's padded shard (``TrainingData.eval_batches``); the padding repeats are excluded from every
    count. ``flips``: logits averaged with the mirror image's (``model.eval_flips``, as the evaluate stage
    and the served model predict)."""
    was_training = model.training
    model.eval()
    sums = torch.zeros(3, dtype=torch.float64, device=info.device)
    seen = 0
    for images, labels, idx in batches:
        x = transform(images.to(info.device, non_blocking=True), idx, None)
        labels = labels.to(info.device, non_blocking=True)
        with compute.autocast():
            logits = predict_logits(model, x, flips)
        real = real_sample_mask(seen, len(labels), info.rank, info.world_size, n).to(info.device)
        seen += len(labels)
        loss = F.cross_entropy(logits, labels, reduction="none")
        sums += torch.stack([(loss * real).sum().double(),
                             ((logits.argmax(1) == labels) & real).sum().double(), real.sum().double()])
    loss_sum, correct, count = dd.all_reduce_sum(sums, info).tolist()
    model.train(was_training)
    return loss_sum / count, correct / count


def final_metrics(history: list[EpochStats], best_epoch: int, best_val_accuracy: float,
                  exported_epoch: int, world_size: int, effective_lr: float, exported_ema: bool = False
                  ) -> dict[str, float]:
    """What a finished training reports (``paths.train_metrics``, the DVC metrics of the train stage);
    ``exported_ema``: the exported weights are the moving average (1) or the raw weights (0)."""
    last, model = history[-1], history[exported_epoch - 1]
    ema = {"ema_val_accuracy": last.ema_val_accuracy, "exported_ema": float(exported_ema)} \
        if last.ema_val_accuracy is not None else {}
    return {
        "best_val_accuracy": best_val_accuracy, "best_epoch": best_epoch,
        "exported_epoch": exported_epoch, "epochs": len(history), **ema,
        # the exported model's own validation figures (EpochStats.of_weights): what the champion alias is moved by
        MODEL_VAL_ACCURACY: model.of_weights("val_accuracy", exported_ema),
        "model_val_loss": model.of_weights("val_loss", exported_ema),
        "val_accuracy": last.val_accuracy, "val_loss": last.val_loss,
        "train_loss": last.train_loss, "train_accuracy": last.train_accuracy,
        "train_seconds": sum(h.epoch_seconds for h in history),
        "world_size": world_size, "effective_lr": effective_lr,
    }
