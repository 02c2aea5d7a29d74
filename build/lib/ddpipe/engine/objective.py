"""What a training step minimises: cross-entropy with label smoothing, each sample weighted by its class
(``train.class_weights``), against soft targets where MixUp or CutMix blended two samples
(``ddpipe.data.augment.Mixing``).

The loss is a mean over the local batch of per-sample terms, so a sample's gradient does not depend on which
other samples share its rank: weighted, it is ``mean(w_i * loss_i)``, not torch's ``sum(w_i * loss_i) /
sum(w_i)``, whose denominator is the rank's own and would change the step with the world size. Balanced
weights have mean 1 over the training split (``ddpipe.data.sampling``), so the learning rate keeps its meaning.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ddpipe.config.schema import TrainConfig
from ddpipe.data.loaders import TrainingData
from ddpipe.data.sampling import balanced_class_weights


class Objective:
    """The batch as the network takes it (transformed, mixed) and the loss of its logits."""

    def __init__(self, tc: TrainConfig, data: TrainingData, device: torch.device) -> None:
        self.smoothing, self.data, self.device = tc.label_smoothing, data, device
        self.num_classes = len(data.meta.classes)
        self.weights = balanced_class_weights(data.train_labels(), self.num_classes).to(device) \
            if tc.class_weights == "balanced" else None

    def inputs(self, batch: tuple, epoch: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(network input, labels, soft targets or None) of a training batch on the device."""
        images, labels, keys, *partner = batch
        transform, device = self.data.transform, self.device
        x = transform(images.to(device, non_blocking=True), keys, epoch)
        labels = labels.to(device, non_blocking=True)
        if not partner:
            return x, labels, None
        mixing = self.data.mixing
        assert mixing is not None
        p_images, p_labels, p_keys = partner
        plan = mixing.plan(keys, epoch, x.shape[2], x.shape[3]).to(device)
        x = mixing.images(x, transform(p_images.to(device, non_blocking=True), p_keys, epoch), plan)
        targets = mixing.targets(labels, p_labels.to(device, non_blocking=True), plan, self.num_classes)
        return x, labels, targets

    def loss(self, logits: torch.Tensor, labels: torch.Tensor, targets: torch.Tensor | None) -> torch.Tensor:
        """The mean loss over the batch (``targets``: soft targets, before label smoothing)."""
        eps = self.smoothing
        if targets is None and self.weights is None:
            return F.cross_entropy(logits, labels, label_smoothing=eps)
        if targets is None:
            per_sample = F.cross_entropy(logits, labels, reduction="none", label_smoothing=eps)
            weights = None if self.weights is None else self.weights[labels]
        else:
            per_sample = F.cross_entropy(logits, targets * (1 - eps) + eps / self.num_classes, reduction="none")
            weights = None if self.weights is None else targets @ self.weights
        return (per_sample * weights).mean() if weights is not None else per_sample.mean()
