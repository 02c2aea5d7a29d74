"""Which samples go where: the class subset (``data.classes``) and the stratified, seeded splits.

Splits are computed from labels alone, so a split is the same whichever way its images are stored.
Within a split, samples keep the source's order (class, then file name, for a folder).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ddpipe.config.schema import ConfigError, DataConfig


def stratified_pick(labels: np.ndarray, total: int, seed: int) -> np.ndarray:
    """Indices of ``total`` samples drawn per class in proportion to class size (largest
    remainders get the leftovers), seeded; returned sorted."""
    n = len(labels)
    if not 0 <= total <= n:
        raise ValueError(f"cannot pick {total} of {n} samples")
    rng = np.random.default_rng(seed)
    classes, counts = np.unique(labels, return_counts=True)
    exact = counts * total / n
    take = np.floor(exact).astype(int)
    leftover = total - take.sum()
    take[np.argsort(-(exact - take), kind="stable")[:leftover]] += 1
    picked = [rng.permutation(np.flatnonzero(labels == c))[:k] for c, k in zip(classes, take)]
    return np.sort(np.concatenate(picked)) if picked else np.array([], dtype=np.int64)


def split_indices(labels: np.ndarray, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A stratified, seeded split: (kept, held out), disjoint and covering."""
    held = stratified_pick(labels, int(round(len(labels) * fraction)), seed)
    mask = np.ones(len(labels), dtype=bool)
    mask[held] = False
    return np.flatnonzero(mask), held


def select_classes(wanted: Any, classes: list[str], where: str) -> list[int]:
    """The class numbers ``data.classes`` keeps: all (null), the first N (an int), or these names (a list,
    in its order). ``where`` names the source, for the message."""
    if wanted is None:
        return list(range(len(classes)))
    if isinstance(wanted, int):
        if wanted > len(classes):
            raise ConfigError(f"data.classes = {wanted} is not accepted: {where} has {len(classes)} classes; "
                              f"accepted: 2 to {len(classes)}, a list of class names, or null")
        return list(range(wanted))
    unknown = [name for name in wanted if name not in classes]
    if unknown:
        shown = ", ".join(classes[:20]) + (", ..." if len(classes) > 20 else "")
        raise ConfigError(f"data.classes names {unknown}, not classes of {where}; accepted: names among {shown}")
    return [classes.index(name) for name in wanted]


def relabel(labels: np.ndarray, kept: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """(positions of the samples of the kept classes, their labels renumbered 0..K-1 in ``kept``'s order)."""
    lookup = np.full(int(labels.max(initial=0)) + 1, -1, dtype=np.int64)
    lookup[kept] = np.arange(len(kept))
    new = lookup[labels]
    positions = np.flatnonzero(new >= 0)
    return positions, new[positions]


def make_splits(labels: np.ndarray, is_test: np.ndarray | None, cfg: DataConfig, seed: int) -> dict[str, np.ndarray]:
    """Positions (into ``labels``) of train, val and test. ``is_test`` marks an official test set; without
    one (a folder of one's own) ``data.test_fraction`` is carved first (seed + 1). Validation is
    ``data.val_fraction`` of the rest (seed), and ``data.max_train_samples`` a stratified subset of what
    remains (seed + 2), ``data.max_test_samples`` one of the test split (seed + 3). Every split is in source order."""
    if is_test is None:
        rest, test = split_indices(labels, cfg.test_fraction, seed + 1)
    else:
        rest, test = np.flatnonzero(~is_test), np.flatnonzero(is_test)
    train, val = split_indices(labels[rest], cfg.val_fraction, seed)
    if cfg.max_train_samples is not None and cfg.max_train_samples < len(train):
        train = train[stratified_pick(labels[rest][train], cfg.max_train_samples, seed + 2)]
    if cfg.max_test_samples is not None and cfg.max_test_samples < len(test):
        test = test[stratified_pick(labels[test], cfg.max_test_samples, seed + 3)]
    return {"train": rest[train], "val": rest[val], "test": test}
