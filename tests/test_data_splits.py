"""Stratified seeded splits and the class subset (data.classes)."""

from __future__ import annotations

import numpy as np
import pytest

from ddpipe.config.load import load_config
from ddpipe.config.schema import ConfigError, DataConfig
from ddpipe.data.splits import make_splits, relabel, select_classes, split_indices, stratified_pick
from tests.conftest import PARAMS

LABELS = np.repeat(np.arange(10), [100, 90, 80, 70, 60, 50, 40, 30, 20, 10])


def test_split_is_stratified_disjoint_and_covering() -> None:
    kept, held = split_indices(LABELS, 0.2, seed=1)
    assert len(np.intersect1d(kept, held)) == 0
    assert np.array_equal(np.sort(np.concatenate([kept, held])), np.arange(len(LABELS)))
    held_counts = np.bincount(LABELS[held], minlength=10)
    np.testing.assert_array_equal(held_counts, [20, 18, 16, 14, 12, 10, 8, 6, 4, 2])


def test_split_is_deterministic_per_seed_and_differs_across_seeds() -> None:
    a, b, c = (split_indices(LABELS, 0.2, seed=s)[1] for s in (1, 1, 2))
    assert np.array_equal(a, b) and not np.array_equal(a, c)


def test_stratified_subset_keeps_proportions() -> None:
    picked = stratified_pick(LABELS, 110, seed=0)
    assert len(picked) == 110 and len(np.unique(picked)) == 110
    counts = np.bincount(LABELS[picked], minlength=10)
    np.testing.assert_allclose(counts, np.bincount(LABELS) * 110 / len(LABELS), atol=1)


def test_splits_of_a_folder_carve_test_first_and_keep_source_order() -> None:
    cfg = DataConfig(test_fraction=0.1, val_fraction=0.2, max_train_samples=300)
    splits = make_splits(LABELS, None, cfg, seed=0)
    assert [len(splits[k]) for k in ("train", "val", "test")] == [300, 99, 55]
    for part in splits.values():
        assert np.all(np.diff(part) > 0)  # source order within a split
    joined = np.concatenate(list(splits.values()))
    assert len(np.unique(joined)) == len(joined)
    official = make_splits(LABELS, np.arange(len(LABELS)) >= 500, DataConfig(val_fraction=0.1), seed=0)
    assert np.array_equal(official["test"], np.arange(500, 550))


def test_class_subset_keeps_the_first_n_or_the_named_ones_relabelled() -> None:
    classes = ["ant", "bee", "cat", "dog"]
    labels = np.array([0, 1, 2, 3, 2, 1, 0, 3])
    assert select_classes(None, classes, "x") == [0, 1, 2, 3]
    assert select_classes(2, classes, "x") == [0, 1]
    kept = select_classes(["dog", "bee"], classes, "x")
    positions, new = relabel(labels, kept)
    assert positions.tolist() == [1, 3, 5, 7] and new.tolist() == [1, 0, 1, 0]
    with pytest.raises(ConfigError, match=r"data.classes = 5 is not accepted: x has 4 classes; accepted: 2 to 4"):
        select_classes(5, classes, "x")
    with pytest.raises(ConfigError, match=r"data.classes names \['emu'\], not classes of x"):
        select_classes(["emu", "ant"], classes, "x")


@pytest.mark.parametrize("value", ["1", "[cat]", "[cat,cat]", "true", "abc"])
def test_class_subset_values_are_checked_when_loaded(value: str) -> None:
    with pytest.raises(ConfigError, match="data.classes = .* is not accepted; expected null, an integer >= 2"):
        load_config([f"data.classes={value}"], params_file=PARAMS)
    assert load_config(["data.classes=[cat,dog]"], params_file=PARAMS).data.classes == ["cat", "dog"]


def test_max_test_samples_keeps_a_stratified_subset_of_the_test_split_and_leaves_the_others() -> None:
    """data.max_test_samples: a quick run's test split, each class in proportion, in source order; train and val as
    without it (an official test set and a carved one alike)."""
    is_test = np.zeros(len(LABELS), dtype=bool)
    is_test[::5] = True
    for marks in (is_test, None):
        full = make_splits(LABELS, marks, DataConfig(val_fraction=0.2), seed=0)
        cut = make_splits(LABELS, marks, DataConfig(val_fraction=0.2, max_test_samples=50), seed=0)
        assert np.array_equal(cut["train"], full["train"]) and np.array_equal(cut["val"], full["val"])
        assert len(cut["test"]) == 50 and np.all(np.diff(cut["test"]) > 0) and np.isin(cut["test"], full["test"]).all()
        np.testing.assert_allclose(np.bincount(LABELS[cut["test"]], minlength=10),
                                   np.bincount(LABELS[full["test"]], minlength=10) * 50 / len(full["test"]), atol=1)
    assert make_splits(LABELS, is_test, DataConfig(max_test_samples=10_000), seed=0)["test"].size == is_test.sum()
