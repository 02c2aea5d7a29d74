"""Fine-tuning: the network's body (everything but its classifier head) learns at ``train.body_lr_ratio`` of the
head's rate, and may be frozen for the first ``train.freeze_body_epochs`` epochs or for good.

A frozen body has ``requires_grad=False`` (no gradients computed or all-reduced: DDP is re-wrapped when the set
changes, as DDP registers its hooks on the parameters that require gradients when it is built) and its
BatchNorm layers in eval mode (their running statistics stay the pretrained ones). Whether the body is frozen
is a function of the epoch, so a resumed run freezes exactly as the uninterrupted one did.
"""

from __future__ import annotations

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from ddpipe.models.catalog import classifier_head


class FineTuning:
    """Which parameters are the head's, their learning rates, and the body's freezing by epoch."""

    def __init__(self, body_lr_ratio: float, freeze_body_epochs: int | None, module: nn.Module,
                 num_classes: int) -> None:
        """``train.body_lr_ratio`` and ``train.freeze_body_epochs`` (None: frozen for good) for ``module``."""
        self.ratio, self.freeze = body_lr_ratio, freeze_body_epochs
        self.active = self.ratio != 1.0 or self.freeze != 0
        # the head by name: make_exact and SyncBatchNorm keep every module's name when they swap layers
        self.head = classifier_head(module, num_classes) if self.active else ""
        self.frozen = False

    def in_head(self, name: str) -> bool:
        """Whether the parameter or module ``name`` is (in) the classifier head."""
        return bool(self.head) and (name == self.head or name.startswith(self.head + "."))

    def param_groups(self, module: nn.Module, lr: float) -> list[dict]:
        """The optimizer's groups: the head at ``lr``, the body at ``lr * body_lr_ratio`` (one group when
        fine-tuning is off)."""
        if not self.active:
            return [{"params": list(module.parameters()), "lr": lr}]
        named = list(module.named_parameters())
        return [{"params": [p for n, p in named if self.in_head(n)], "lr": lr},
                {"params": [p for n, p in named if not self.in_head(n)], "lr": lr * self.ratio}]

    def body_frozen(self, epoch: int) -> bool:
        return self.freeze is None or epoch < self.freeze

    def set_epoch(self, module: nn.Module, epoch: int) -> bool:
        """Freeze or thaw the body for ``epoch``; whether that changed anything (then re-wrap in DDP)."""
        frozen = self.active and self.body_frozen(epoch)
        if frozen == self.frozen:
            return False
        for name, p in module.named_parameters():
            if not self.in_head(name):
                p.requires_grad_(not frozen)
        self.frozen = frozen
        return True

    def freeze_batchnorm(self, module: nn.Module) -> None:
        """A frozen body's BatchNorm layers back in eval mode (after ``model.train()``)."""
        if self.frozen:
            for name, m in module.named_modules():
                if isinstance(m, _BatchNorm) and not self.in_head(name):
                    m.eval()
