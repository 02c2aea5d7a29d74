"""An epoch's global order of the training split, and the class weights of the loss: class imbalance handled the
same way at any world size.

``uniform`` (``train.sampler``): DistributedSampler's permutation (seeded by seed + epoch), every sample once.
``balanced``: as many draws with replacement, each class equally likely (torch's WeightedRandomSampler over
the whole split, seeded the same way). Either is one global sequence that ``ddpipe.data.loaders.TrainOrder``
deals to the ranks as DistributedSampler does, so step ``s`` takes the same samples at any world size: the
balanced sampler that DistributedSampler lacks (pytorch#77154), without a rank drawing its own.

A sample drawn a second time in an epoch gets a new augmentation: its key (what crops, policies and mixing are
keyed by) is its index plus the split's size times its earlier draws in the epoch's sequence.
"""

from __future__ import annotations

import numpy as np
import torch


def class_counts(labels: np.ndarray | torch.Tensor, num_classes: int) -> torch.Tensor:
    """Samples of each class (int64 ``[num_classes]``)."""
    return torch.bincount(_as_long(labels), minlength=num_classes)


def _as_long(labels: np.ndarray | torch.Tensor) -> torch.Tensor:
    """Labels (perhaps a read-only memory map) as an int64 tensor of their own."""
    return torch.from_numpy(np.array(labels, dtype=np.int64))


def balanced_class_weights(labels: np.ndarray | torch.Tensor, num_classes: int) -> torch.Tensor:
    """``train.class_weights: balanced``: n / (classes x count) per class (scikit-learn's "balanced"), so the
    mean weight over the training split is 1; a class without training samples weighs 0."""
    counts = class_counts(labels, num_classes).double()
    present = counts > 0
    weights = torch.zeros(num_classes, dtype=torch.float64)
    weights[present] = counts.sum() / (present.sum() * counts[present])
    return weights.float()


def epoch_order(n: int, seed: int, epoch: int, labels: np.ndarray | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(sample indices, sample keys) of ``epoch``'s global sequence of ``n`` samples: a permutation, or with
    ``labels`` the class-balanced draw."""
    g = torch.Generator()
    g.manual_seed(seed + epoch)
    if labels is None:
        perm = torch.randperm(n, generator=g)
        return perm, perm
    counts = class_counts(labels, int(np.max(labels)) + 1 if n else 0).double()
    per_sample = (1.0 / counts)[_as_long(labels)]
    draws = torch.multinomial(per_sample, n, replacement=True, generator=g)
    return draws, draws + n * earlier_draws(draws)


def earlier_draws(draws: torch.Tensor) -> torch.Tensor:
    """For each position, how often its value occurs before it in ``draws``."""
    n = len(draws)
    order = torch.sort(draws, stable=True).indices  # equal values keep their order of position
    ordered = draws[order]
    positions = torch.arange(n)
    starts = torch.ones(n, dtype=torch.bool)
    starts[1:] = ordered[1:] != ordered[:-1]
    group_start = torch.cummax(torch.where(starts, positions, torch.zeros_like(positions)), 0).values
    earlier = torch.empty_like(draws)
    earlier[order] = positions - group_start
    return earlier
