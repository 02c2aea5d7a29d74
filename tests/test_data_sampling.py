"""The class-balanced order: one global sequence dealt to the ranks, so every world size takes the same samples
in each step; repeated draws get keys of their own; balanced class weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ddpipe.data.loaders import TrainOrder
from ddpipe.data.sampling import balanced_class_weights, earlier_draws, epoch_order

# one class 10x each of the others, as the imbalanced folder of the benchmarks
LABELS = np.array([0] * 400 + [1] * 40 + [2] * 40 + [3] * 40)


def test_the_balanced_order_is_the_same_global_batches_at_one_and_two_processes() -> None:
    n = len(LABELS)
    for epoch in (0, 1):
        one = TrainOrder(n, 32, 0, 1, seed=3, labels=LABELS).keyed_batches(epoch)
        two = [TrainOrder(n, 16, rank, 2, seed=3, labels=LABELS).keyed_batches(epoch) for rank in range(2)]
        for part in (0, 1):  # indices, then keys
            # step s of 1 x 32 is step s of 2 x 16, the ranks' samples interleaved as DistributedSampler deals them
            interleaved = torch.stack([two[0][part], two[1][part]], dim=2).flatten(1)
            assert torch.equal(one[part], interleaved)
    assert not torch.equal(TrainOrder(n, 32, 0, 1, 3, LABELS).batches(0), TrainOrder(n, 32, 0, 1, 3, LABELS).batches(1))


def test_each_class_is_drawn_about_equally_and_repeats_get_new_keys() -> None:
    n = len(LABELS)
    indices, keys = epoch_order(n, 0, 0, LABELS)
    counts = np.bincount(LABELS[indices.numpy()], minlength=4)
    assert counts.sum() == n and counts.min() > 0.8 * n / 4  # 120 each expected, against 40 in a uniform epoch
    assert len(set(keys.tolist())) == n and torch.equal(keys % n, indices)
    uniform, same = epoch_order(n, 0, 0)
    assert torch.equal(uniform, same) and sorted(uniform.tolist()) == list(range(n))


def test_earlier_draws_count_each_values_previous_positions() -> None:
    assert earlier_draws(torch.tensor([5, 2, 5, 5, 2, 7])).tolist() == [0, 0, 1, 2, 1, 0]


def test_balanced_weights_average_one_over_the_split() -> None:
    weights = balanced_class_weights(LABELS, 5)  # class 4 has no samples
    assert weights[4] == 0 and torch.allclose(weights[:4], torch.tensor([520 / 1600, 520 / 160, 520 / 160, 520 / 160]))
    assert float(weights[torch.as_tensor(LABELS)].mean()) == pytest.approx(1.0)
