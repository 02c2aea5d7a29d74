"""Splits, the prepared-data files, and the in-memory fast path that feeds training.

Prepared data (``paths.prepared``): ``train.pt``, ``val.pt``, ``test.pt`` each hold
``{"images": uint8 [N, C, H, W], "labels": int64 [N]}`` (plain tensors: they load with
``torch.load(weights_only=True)``), and ``meta.json`` holds class names, shape, and the train
split's per-channel mean and std.

Training reads a whole split into memory once; a batch is gathered with one indexing op
(``__getitems__``), then normalised and augmented per batch on the training device. Augmentation
randomness is a hash of (seed, epoch, sample index), so it does not depend on which rank sees a
sample, nor on the world size.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, DistributedSampler

from ddpipe.config import ConfigError, DataConfig, TrainConfig
from ddpipe.fsutil import atomic_save, replace_dir
from ddpipe.sources import RawDataset, load_raw

SPLITS = ("train", "val", "test")


class PreparedDataError(RuntimeError):
    """The prepared data is missing or inconsistent."""


# ---------------------------------------------------------------------------------------------
# Splits


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


# ---------------------------------------------------------------------------------------------
# The prepare stage


@dataclass(frozen=True)
class Prepared:
    """What ``prepare`` wrote beside the splits (``meta.json``): the dataset, its classes and image
    shape, the training split's per-channel mean and std, and the size of each split."""

    dataset: str
    classes: list[str]
    num_channels: int
    image_size: list[int]
    mean: list[float]
    std: list[float]
    sizes: dict[str, int]


def prepare(cfg: DataConfig, seed: int, raw_dir: Path, out_dir: Path) -> Prepared:
    """Parse the fetched files, split them, and write the prepared splits atomically."""
    raw = load_raw(cfg, raw_dir)
    splits = make_splits(raw, cfg, seed)
    train_images = splits["train"][0]
    if len(train_images) == 0:
        raise PreparedDataError("the training split is empty")
    as_float = train_images.astype(np.float64) / 255.0
    mean = as_float.mean(axis=(0, 2, 3)).tolist()
    std = as_float.std(axis=(0, 2, 3)).clip(min=1e-3).tolist()
    meta = Prepared(
        dataset=cfg.dataset, classes=raw.classes, num_channels=int(train_images.shape[1]),
        image_size=[int(train_images.shape[2]), int(train_images.shape[3])], mean=mean, std=std,
        sizes={k: int(len(v[1])) for k, v in splits.items()},
    )
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir.parent, prefix=f".{out_dir.name}.tmp") as tmp:
        staging = Path(tmp) / "out"
        staging.mkdir()
        for name, (images, labels) in splits.items():
            tensors = {"images": torch.from_numpy(images), "labels": torch.from_numpy(labels)}
            atomic_save(staging / f"{name}.pt", lambda f, t=tensors: torch.save(t, f))
        (staging / "meta.json").write_text(json.dumps(asdict(meta), indent=2) + "\n")
        replace_dir(staging, out_dir)
    return meta


def make_splits(raw: RawDataset, cfg: DataConfig, seed: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """train/val from the official training set, test kept apart (carved first for imagefolder)."""
    images, labels = raw.train_images, raw.train_labels
    if raw.test_images is None:
        keep, held = split_indices(labels, cfg.test_fraction, seed + 1)
        test = (images[held], labels[held])
        images, labels = images[keep], labels[keep]
    else:
        test = (raw.test_images, raw.test_labels)
    train_idx, val_idx = split_indices(labels, cfg.val_fraction, seed)
    if cfg.max_train_samples is not None and cfg.max_train_samples < len(train_idx):
        sub = stratified_pick(labels[train_idx], cfg.max_train_samples, seed + 2)
        train_idx = train_idx[sub]
    return {
        "train": (np.ascontiguousarray(images[train_idx]), labels[train_idx]),
        "val": (np.ascontiguousarray(images[val_idx]), labels[val_idx]),
        "test": (np.ascontiguousarray(test[0]), test[1]),
    }


# ---------------------------------------------------------------------------------------------
# Reading prepared data


def load_meta(prepared_dir: str | Path) -> Prepared:
    """``meta.json`` of the prepared data in ``prepared_dir``."""
    path = Path(prepared_dir) / "meta.json"
    if not path.is_file():
        raise PreparedDataError(f"{path}: missing; run the prepare stage first (dvc repro prepare)")
    try:
        return Prepared(**json.loads(path.read_text()))
    except (TypeError, ValueError) as exc:  # not JSON, or other keys than this version writes
        raise PreparedDataError(f"{path}: not this version's prepared data ({exc}); run the prepare stage again "
                                "(dvc repro --force prepare)") from None


class InMemoryDataset(Dataset):
    """A prepared split held in memory as uint8; ``__getitems__`` gathers a batch in one op."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        if len(images) != len(labels):
            raise PreparedDataError(f"{len(images)} images but {len(labels)} labels")
        self.images, self.labels = images, labels

    @classmethod
    def load(cls, prepared_dir: str | Path, split: str) -> InMemoryDataset:
        path = Path(prepared_dir) / f"{split}.pt"
        if not path.is_file():
            raise PreparedDataError(f"{path}: missing; run the prepare stage first (dvc repro prepare)")
        try:
            data = torch.load(path, weights_only=True)
            return cls(data["images"], data["labels"])
        except Exception as exc:  # a corrupt file raises whatever the unpickler trips on
            raise PreparedDataError(f"{path}: cannot be loaded ({type(exc).__name__}: {exc}); run the "
                                    "prepare stage again (dvc repro --force prepare)") from exc

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.__getitems__([i])

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        idx = torch.as_tensor(indices, dtype=torch.long)
        return self.images[idx], self.labels[idx], idx


def _keep_batch(batch: tuple) -> tuple:
    """collate_fn: ``__getitems__`` already returns a batch."""
    return batch


class TrainShards:
    """This rank's shuffled shard of the train split, batched.

    DistributedSampler with ``drop_last`` (every rank takes the same number of steps), batches of
    ``batch_size`` with the last incomplete one dropped, so that a step's global batch is the same
    set of samples at any world size with the same global batch size. ``loader(epoch, start, stop)``
    calls ``set_epoch(epoch)`` (a new shuffle and new shards every epoch) and serves that epoch's
    batches ``start:stop`` (a resumed epoch starts at its checkpointed step).
    """

    def __init__(self, dataset: InMemoryDataset, batch_size: int, rank: int, world_size: int, seed: int,
                 pin_memory: bool) -> None:
        self.dataset, self.batch_size, self.pin_memory = dataset, batch_size, pin_memory
        self.sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed,
                                          drop_last=True)

    def __len__(self) -> int:
        """Batches per epoch on this rank."""
        return len(self.sampler) // self.batch_size

    def batches(self, epoch: int) -> list[list[int]]:
        """This rank's batches (sample indices) of ``epoch``."""
        self.sampler.set_epoch(epoch)
        return list(BatchSampler(self.sampler, self.batch_size, drop_last=True))

    def loader(self, epoch: int, start: int = 0, stop: int | None = None) -> DataLoader:
        return _loader(self.dataset, self.batches(epoch)[start:stop], self.pin_memory)


@dataclass
class TrainingData:
    """What a training reads, for one rank: ``meta.json``, the train and validation splits in memory,
    this rank's shuffled shards of the training split, and the batch transform on the device."""

    meta: Prepared
    train_set: InMemoryDataset
    val_set: InMemoryDataset
    shards: TrainShards
    transform: BatchTransform

    @classmethod
    def load(cls, prepared_dir: str | Path, cfg: TrainConfig, seed: int, rank: int, world_size: int,
             device: torch.device, channels_last: bool, pin_memory: bool) -> TrainingData:
        meta = load_meta(prepared_dir)
        train_set = InMemoryDataset.load(prepared_dir, "train")
        check_global_batch(len(train_set), cfg, world_size)
        shards = TrainShards(train_set, cfg.batch_size_per_rank, rank, world_size, seed,
                             pin_memory=pin_memory)
        transform = BatchTransform(meta.mean, meta.std, cfg.random_crop_padding, cfg.hflip, seed, device, channels_last)
        return cls(meta, train_set, InMemoryDataset.load(prepared_dir, "val"), shards, transform)


def steps_per_epoch(num_samples: int, cfg: TrainConfig, world_size: int) -> int:
    """Optimizer steps in an epoch of ``num_samples`` (each rank's shard, its full batches, then
    ``grad_accum_steps`` of them a step, as :class:`TrainShards` serves them)."""
    return num_samples // world_size // cfg.batch_size_per_rank // cfg.grad_accum_steps


def check_global_batch(num_samples: int, cfg: TrainConfig, world_size: int) -> None:
    """ConfigError unless an epoch of ``num_samples`` has at least one optimizer step."""
    if steps_per_epoch(num_samples, cfg, world_size) < 1:
        raise ConfigError(
            f"train.grad_accum_steps = {cfg.grad_accum_steps} x train.batch_size_per_rank = "
            f"{cfg.batch_size_per_rank} x {world_size} process(es) exceeds the training split "
            f"({num_samples} samples); accepted: a global batch no larger than the split")


def eval_loader(
    dataset: InMemoryDataset, batch_size: int, rank: int, world_size: int, pin_memory: bool
) -> DataLoader:
    """This rank's shard of an evaluation split; DistributedSampler pads the shards to equal length
    with repeats, which :func:`real_sample_mask` excludes from the counts."""
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=False)
    return _loader(dataset, BatchSampler(sampler, batch_size, drop_last=False), pin_memory)


def _loader(dataset: Dataset, batch_sampler, pin_memory: bool) -> DataLoader:
    return DataLoader(dataset, batch_sampler=batch_sampler, collate_fn=_keep_batch,
                      num_workers=0, pin_memory=pin_memory)


def real_sample_mask(first_position: int, batch_len: int, rank: int, world_size: int, n: int) -> torch.Tensor:
    """True for this batch's samples that are not DistributedSampler's padding: rank ``r``'s
    ``j``-th sample is global position ``r + j * world_size``, padding when that is >= n."""
    positions = rank + (first_position + torch.arange(batch_len)) * world_size
    return positions < n


# ---------------------------------------------------------------------------------------------
# Per-batch transform on the training device


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 31-bit integer hash (no int64 overflow, so CPU and CUDA agree bit for bit)."""
    for _ in range(3):
        x = ((x ^ (x >> 13)) * 1103515245 + 12345) & 0x7FFFFFFF
    return x


class BatchTransform:
    """uint8 batch -> normalised float batch, with seeded per-sample crops and flips for training."""

    def __init__(self, mean: list[float], std: list[float], crop_padding: int, hflip: bool,
                 seed: int, device: torch.device, channels_last: bool) -> None:
        mean_t = torch.tensor(mean, dtype=torch.float32, device=device).view(1, -1, 1, 1)
        std_t = torch.tensor(std, dtype=torch.float32, device=device).view(1, -1, 1, 1)
        self.scale, self.shift = 1.0 / (255.0 * std_t), -mean_t / std_t
        self.crop_padding, self.hflip, self.seed = crop_padding, hflip, seed
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format

    def __call__(self, images: torch.Tensor, indices: torch.Tensor, epoch: int | None) -> torch.Tensor:
        """``epoch=None``: evaluation (no augmentation)."""
        if epoch is not None and (self.crop_padding or self.hflip):
            images = self._augment(images, indices.to(images.device), epoch)
        x = images.float().mul_(self.scale).add_(self.shift)
        return x.contiguous(memory_format=self.memory_format)

    def _augment(self, images: torch.Tensor, indices: torch.Tensor, epoch: int) -> torch.Tensor:
        key = _mix(_mix(torch.full_like(indices, self.seed & 0x7FFFFFFF)) ^ epoch)
        key = _mix(key ^ indices)
        b, _, h, w = images.shape
        if self.crop_padding:
            p = self.crop_padding
            padded = torch.nn.functional.pad(images, (p, p, p, p))
            dy, dx = _mix(key ^ 1) % (2 * p + 1), _mix(key ^ 2) % (2 * p + 1)
            rows = (dy[:, None] + torch.arange(h, device=images.device))[:, :, None]
            cols = (dx[:, None] + torch.arange(w, device=images.device))[:, None, :]
            batch = torch.arange(b, device=images.device)[:, None, None]
            images = padded[batch, :, rows, cols].permute(0, 3, 1, 2)  # [B, H, W, C] -> [B, C, H, W]
        if self.hflip:
            flip = (_mix(key ^ 3) & 1).bool().view(-1, 1, 1, 1)
            images = torch.where(flip, images.flip(-1), images)
        return images
