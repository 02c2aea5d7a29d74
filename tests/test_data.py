"""Splits, prepared files, samplers, augmentation, and the data stages on the real Fashion-MNIST."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from ddpipe.config import DataConfig
from ddpipe.data import (
    BatchTransform,
    InMemoryDataset,
    TrainShards,
    eval_loader,
    prepare,
    real_sample_mask,
    split_indices,
    stratified_pick,
)
from ddpipe.sources import fetch
from tests.conftest import FASHION_DIR, clone_repo, make_imagefolder, make_mnist_like, run

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


def test_prepare_writes_weights_only_loadable_splits(tmp_path: Path, accept_test_checksums) -> None:
    src = make_mnist_like(tmp_path / "src", n_train=200, n_test=50)
    accept_test_checksums("mnist", src)
    cfg = DataConfig(dataset="mnist", source_dir=str(src), val_fraction=0.25, max_train_samples=100)
    fetch(cfg, tmp_path / "raw")
    result = prepare(cfg, 0, tmp_path / "raw", tmp_path / "prepared")
    assert result.sizes == {"train": 100, "val": 50, "test": 50}
    for split, n in result.sizes.items():
        data = torch.load(tmp_path / "prepared" / f"{split}.pt", weights_only=True)
        assert data["images"].dtype == torch.uint8 and data["images"].shape == (n, 1, 28, 28)
        assert data["labels"].dtype == torch.int64
    meta = json.loads((tmp_path / "prepared" / "meta.json").read_text())
    train = torch.load(tmp_path / "prepared" / "train.pt", weights_only=True)["images"].double() / 255
    assert meta["mean"][0] == pytest.approx(train.mean().item(), rel=1e-6)
    assert meta["std"][0] == pytest.approx(train.std(unbiased=False).item(), rel=1e-6)
    assert not list(tmp_path.glob(".prepared*"))  # no temp leftovers


def test_imagefolder_gets_a_carved_test_split(tmp_path: Path) -> None:
    src = make_imagefolder(tmp_path / "imgs", per_class=10)
    cfg = DataConfig(dataset="imagefolder", source_dir=str(src), test_fraction=0.2, val_fraction=0.25,
                     image_size=16)
    fetch(cfg, tmp_path / "raw")
    result = prepare(cfg, 0, tmp_path / "raw", tmp_path / "prepared")
    assert result.sizes == {"train": 18, "val": 6, "test": 6} and result.classes == ["cat", "dog", "fox"]
    assert json.loads((tmp_path / "prepared" / "meta.json").read_text())["num_channels"] == 3


def _dataset(n: int) -> InMemoryDataset:
    return InMemoryDataset(torch.arange(n, dtype=torch.uint8).view(n, 1, 1, 1).expand(n, 1, 4, 4).clone(),
                           torch.arange(n) % 10)


def test_train_shards_are_disjoint_and_cover_the_global_batches() -> None:
    ds = _dataset(100)
    seen = []
    for rank in range(2):
        shards = TrainShards(ds, 8, rank, 2, seed=0, pin_memory=False)
        assert len(shards) == 6
        seen.append([idx for _, _, idx in shards.loader(0)])
    flat = torch.cat([torch.cat(s) for s in seen])
    assert len(flat) == len(set(flat.tolist())) == 96  # 100 // (2 * 8) steps x 16, no repeats
    single = TrainShards(ds, 16, 0, 1, seed=0, pin_memory=False)
    for step, (_, _, idx) in enumerate(single.loader(0)):  # same global batch at world size 1 and 2
        assert set(idx.tolist()) == set(seen[0][step].tolist()) | set(seen[1][step].tolist())


def test_set_epoch_changes_the_order() -> None:
    shards = TrainShards(_dataset(64), 8, 0, 2, seed=0, pin_memory=False)
    orders = [torch.cat([idx for _, _, idx in shards.loader(epoch)]).tolist() for epoch in (0, 1, 0)]
    assert orders[0] != orders[1] and orders[0] == orders[2]
    assert shards.sampler.epoch == 0  # loader(epoch) is what calls set_epoch
    resumed = torch.cat([idx for _, _, idx in shards.loader(1, start=2)]).tolist()
    assert resumed == orders[1][2 * 8:]  # a resumed epoch: the same order, from its step


@pytest.mark.parametrize("n, world", [(10, 3), (7, 2), (5, 4), (12, 1)])
def test_eval_shards_count_every_sample_exactly_once(n: int, world: int) -> None:
    counted = []
    for rank in range(world):
        seen = 0
        for _, _, idx in eval_loader(_dataset(n), 2, rank, world, pin_memory=False):
            mask = real_sample_mask(seen, len(idx), rank, world, n)
            counted += idx[mask].tolist()
            seen += len(idx)
    assert sorted(counted) == list(range(n))


def test_augmentation_depends_on_sample_and_epoch_not_on_batch() -> None:
    images = torch.randint(0, 255, (6, 1, 12, 12), dtype=torch.uint8)
    t = BatchTransform([0.5], [0.25], crop_padding=2, hflip=True, seed=3, device=torch.device("cpu"),
                       channels_last=False)
    idx = torch.tensor([10, 11, 12, 13, 14, 15])
    full = t(images, idx, epoch=1)
    part = t(images[[4, 1]], idx[[4, 1]], epoch=1)  # other batch, other order, same samples
    assert torch.equal(part, full[[4, 1]])
    assert not torch.equal(t(images, idx, epoch=2), full)
    assert not torch.equal(full, t(images, idx, epoch=None))
    plain = t(images, idx, epoch=None)
    np.testing.assert_allclose(plain.numpy(), ((images.float() / 255 - 0.5) / 0.25).numpy(), rtol=1e-5, atol=1e-5)


def test_augmentation_keeps_images_with_zero_padding() -> None:
    images = torch.full((64, 1, 8, 8), 200, dtype=torch.uint8)
    t = BatchTransform([0.0], [1.0], crop_padding=2, hflip=False, seed=0, device=torch.device("cpu"),
                       channels_last=True)
    out = t(images, torch.arange(64), epoch=0)
    assert out.shape == (64, 1, 8, 8) and out.is_contiguous(memory_format=torch.channels_last)
    shifted = (out != out[0:1].max()).flatten(1).any(1)
    assert 0 < shifted.sum() < 64  # most crops move, the centred one does not


@pytest.mark.slow
@pytest.mark.skipif(not FASHION_DIR.is_dir(), reason="Debian's dataset-fashion-mnist is not installed")
def test_data_stages_on_real_fashion_mnist_via_dvc(tmp_path: Path) -> None:
    """`dvc repro prepare` in a fresh clone (no DVC cache): 60,000 + 10,000 images, then a no-op."""
    repo = clone_repo(tmp_path / "repo")
    first = run(["dvc", "repro", "prepare"], cwd=repo, timeout=600)
    assert "Running stage 'prepare'" in first.stdout
    meta = json.loads((repo / "data" / "prepared" / "meta.json").read_text())
    assert meta["sizes"]["train"] + meta["sizes"]["val"] == 60000 and meta["sizes"]["test"] == 10000
    assert meta["classes"][0] == "T-shirt/top" and meta["image_size"] == [28, 28]
    second = run(["dvc", "repro", "prepare"], cwd=repo)
    assert "Running stage" not in second.stdout and "didn't change" in second.stdout
