"""What a rank reads: its shard of each epoch's shuffled order, and one DataLoader that serves it.

Order. An epoch's order is DistributedSampler's (``shuffle``, ``drop_last``: a permutation seeded by seed
+ epoch; rank ``r`` of ``W`` takes every ``W``-th sample from ``r``), cut into batches of
``batch_size_per_rank``, kept as one index tensor rather than a Python object per sample. Step ``s``'s
global batch is then positions ``[s*B*W, (s+1)*B*W)`` of the permutation at every world size with the same
global batch, so a run stopped at 2 processes can resume at 1 and take the same samples in every step.

Loading. One DataLoader per rank serves training batches and evaluation batches alike (:class:`Plan`
says which before each pass), with persistent workers that decode and crop encoded images
(:mod:`ddpipe.data.transforms`) from the memory-mapped store (:mod:`ddpipe.data.store`); pinned on
CUDA. A batch of raw images is one gather from the memory map (no workers by default). What a worker
does with a sample depends only on (seed, epoch, sample index), so workers, prefetching and resumes
never change a step.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, get_worker_info

from ddpipe.config.schema import Config
from ddpipe.core.devices import PrecisionPolicy
from ddpipe.data.augment import ImagePolicy, Mixing
from ddpipe.data.sampling import epoch_order
from ddpipe.data.store import EncodedSplit, Prepared, RawSplit, open_split
from ddpipe.data.transforms import BatchTransform, EncodedBatch, EvalCrop, TrainCrop, centre_box, decode


@dataclass(frozen=True)
class BatchKey:
    """One batch to serve: samples ``indices`` of ``split``, in the training view of ``epoch`` (None:
    the evaluation view) keyed by ``keys`` (None: the indices; ``ddpipe.data.sampling``), and with
    ``partners`` the MixUp/CutMix partner of each (``ddpipe.data.augment.Mixing``), in their own training views."""

    split: str
    epoch: int | None
    indices: torch.Tensor
    keys: torch.Tensor | None = None
    partners: torch.Tensor | None = None


class Splits(Dataset):
    """The prepared splits a loader reads, memory-mapped; ``__getitems__(key)`` gives a batch as
    (uint8 images ``[B, C, H, W]``, int64 labels, int64 sample keys), and with partners their images and labels
    and keys after those. Training views are ``size``; evaluation views ``eval_crop``'s (default: ``size``, the
    default crop)."""

    def __init__(self, prepared_dir: str | Path, meta: Prepared, names: tuple[str, ...], size: list[int],
                 train_crop: TrainCrop | None = None, policy: ImagePolicy | None = None,
                 eval_crop: EvalCrop | None = None, decode_later: bool = False) -> None:
        self.stored = {name: open_split(prepared_dir, name, meta) for name in names}
        self.channels, self.size, self.train_crop, self.policy = meta.num_channels, list(size), train_crop, policy
        self.eval_crop = eval_crop or EvalCrop(size[0])
        self.decode_later = decode_later  # encoded images: batches of files, decoded on the device (EncodedBatch)

    def __len__(self) -> int:
        return len(next(iter(self.stored.values())))

    def __getitem__(self, key: BatchKey) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.__getitems__(key)

    def __getitems__(self, key: BatchKey) -> tuple[torch.Tensor, ...]:
        keys = key.indices if key.keys is None else key.keys
        images, labels = self._read(key.split, key.indices, keys, key.epoch)
        if key.partners is None:
            return images, labels, keys
        return (images, labels, keys, *self._read(key.split, key.partners, key.partners, key.epoch), key.partners)

    def _read(self, name: str, indices: torch.Tensor, keys: torch.Tensor, epoch: int | None
              ) -> tuple[torch.Tensor | EncodedBatch, torch.Tensor]:
        split, idx = self.stored[name], indices.numpy()
        labels = torch.from_numpy(np.asarray(split.labels[idx]))
        if isinstance(split, RawSplit):
            images = torch.from_numpy(split.pixels(idx))
            if epoch is not None and self.policy is not None:  # the crop and flip follow, on the device
                for k, key in enumerate(keys.tolist()):
                    images[k] = self.policy(images[k], epoch, key)
        elif self.decode_later:
            return self._undecoded(split, idx, keys, epoch), labels
        else:
            size = self.size if epoch is not None else [self.eval_crop.size] * 2
            images = _batch_buffer((len(idx), self.channels, *size))
            for k, (i, key) in enumerate(zip(idx.tolist(), keys.tolist())):
                images[k] = self._view(split, i, key, epoch)
        return images, labels

    def _view(self, split: EncodedSplit, i: int, key: int, epoch: int | None) -> torch.Tensor:
        image = decode(split.blob(i), self.channels)
        if epoch is None or self.train_crop is None:
            return self.eval_crop(image)
        view = self.train_crop(image, key, epoch)
        return view if self.policy is None else self.policy(view, epoch, key)

    def _undecoded(self, split: EncodedSplit, idx: np.ndarray, keys: torch.Tensor, epoch: int | None
                   ) -> EncodedBatch:
        """The files of these samples end to end, each with the crop and flip its view takes (what
        :meth:`_view` does, but for the decoding)."""
        blobs = [split.blob(i) for i in idx.tolist()]
        ends = np.cumsum([len(b) for b in blobs], dtype=np.int64)
        data = _batch_buffer((int(ends[-1]) if len(ends) else 0,))
        flat, start = data.numpy(), 0
        for blob, end in zip(blobs, ends.tolist()):
            flat[start:end], start = blob, end
        train = epoch is not None and self.train_crop is not None
        plans = [self.train_crop.plan(*split.size(i), key, epoch) if train  # type: ignore[union-attr,arg-type]
                 else (centre_box(*split.size(i), self.eval_crop.ratio), False)
                 for i, key in zip(idx.tolist(), keys.tolist())]
        return EncodedBatch(data, torch.from_numpy(ends), torch.tensor([box for box, _ in plans], dtype=torch.long),
                            torch.tensor([flip for _, flip in plans], dtype=torch.bool),
                            self.train_crop.size if train else self.eval_crop.size,  # type: ignore[union-attr]
                            self.channels, self.policy if train else None, epoch if train else None,
                            keys if train else None)


def _batch_buffer(shape: tuple[int, ...]) -> torch.Tensor:
    """A uint8 batch to fill; in a loader worker, in shared memory already, so that handing it to the training
    process is no copy (what torch's default_collate does for the same reason)."""
    if get_worker_info() is None:
        return torch.empty(shape, dtype=torch.uint8)
    numel = 1
    for d in shape:
        numel *= d
    storage = torch.UntypedStorage._new_shared(numel)
    return torch.empty(0, dtype=torch.uint8).set_(storage).view(shape)


class Plan:
    """The batch sampler of a rank's one DataLoader: the keys of the next pass, set before each one (the
    DataLoader re-reads it at every ``iter``, persistent workers included)."""

    def __init__(self) -> None:
        self.keys: list[BatchKey] = []

    def __iter__(self) -> Iterator[BatchKey]:
        return iter(self.keys)

    def __len__(self) -> int:
        return len(self.keys)


def _ignore_stop_signals(worker_id: int) -> None:
    """worker_init_fn: a scheduler's stop signal reaches the whole process group, loader workers too
    (torchrun signals each worker's group), and torch's worker handler exits on SIGTERM, failing the very
    step the training process is checkpointing. The training process decides how to stop (ddpipe.distributed.preemption)
    and ends its workers itself; a worker whose training process died exits on its own (torch's watchdog)."""
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)


def _keep_batch(batch: tuple) -> tuple:
    """collate_fn: ``__getitems__`` already returns a batch."""
    return batch


class Loader:
    """One DataLoader over :class:`Splits` for a rank: ``serve(keys)`` yields those batches in order."""

    def __init__(self, splits: Splits, num_workers: int, pin_memory: bool) -> None:
        self.splits, self.plan = splits, Plan()
        self.loader = DataLoader(splits, batch_sampler=self.plan, collate_fn=_keep_batch, num_workers=num_workers,
                                 pin_memory=pin_memory, persistent_workers=num_workers > 0,
                                 worker_init_fn=_ignore_stop_signals if num_workers > 0 else None,
                                 prefetch_factor=2 if num_workers > 0 else None)

    def serve(self, keys: list[BatchKey]) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        self.plan.keys = keys
        yield from self.loader

    def close(self) -> None:
        """Stop the persistent workers (they would otherwise outlive the training loop until exit)."""
        iterator = getattr(self.loader, "_iterator", None)
        if iterator is not None and hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()
        self.loader._iterator = None


class TrainOrder:
    """This rank's batches of each epoch of a split of ``n`` samples, as DistributedSampler(shuffle=True,
    drop_last=True, seed) and BatchSampler(drop_last=True) would give them, as one tensor; with the split's
    ``labels``, of the class-balanced draw instead (``ddpipe.data.sampling``)."""

    def __init__(self, n: int, batch_size: int, rank: int, world_size: int, seed: int,
                 labels: np.ndarray | None = None) -> None:
        self.n, self.batch_size, self.rank, self.world_size, self.seed = n, batch_size, rank, world_size, seed
        self.labels = labels

    def __len__(self) -> int:
        """Batches per epoch on this rank."""
        return self.n // self.world_size // self.batch_size

    def batches(self, epoch: int) -> torch.Tensor:
        """``[len(self), batch_size]`` sample indices of ``epoch`` (a new shuffle and shards every epoch)."""
        return self.keyed_batches(epoch)[0]

    def keyed_batches(self, epoch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The sample indices of :meth:`batches` and their keys (``ddpipe.data.sampling``)."""
        order = epoch_order(self.n, self.seed, epoch, self.labels)
        cut = slice(self.rank, (self.n // self.world_size) * self.world_size, self.world_size)
        return tuple(t[cut][:len(self) * self.batch_size].view(len(self), self.batch_size)  # type: ignore[return-value]
                     for t in order)


def eval_batches(n: int, batch_size: int, rank: int, world_size: int) -> list[torch.Tensor]:
    """This rank's batches of an evaluation split of ``n``, as DistributedSampler(shuffle=False) shards it:
    padded to equal shards with repeats, which :func:`real_sample_mask` excludes from the counts."""
    total = -(-n // world_size) * world_size
    mine = torch.arange(rank, total, world_size) % max(n, 1)
    return list(mine.split(batch_size)) if n else []


def real_sample_mask(first_position: int, batch_len: int, rank: int, world_size: int, n: int) -> torch.Tensor:
    """True for this batch's samples that are not DistributedSampler's padding: rank ``r``'s
    ``j``-th sample is global position ``r + j * world_size``, padding when that is >= n."""
    positions = rank + (first_position + torch.arange(batch_len)) * world_size
    return positions < n


@dataclass(frozen=True)
class Views:
    """What the network sees of an image: the training input ``size`` [H, W], the evaluation input ``eval_size``
    and crop (``eval_crop_ratio`` of the shorter side), the random-resized crop's smallest area share."""

    size: list[int]
    eval_size: list[int]
    eval_crop_ratio: float
    min_crop_scale: float


@dataclass
class TrainingData:
    """What a training reads, for one rank: ``meta.json``, the sizes the network sees (training, evaluation),
    this rank's order of the training split, its DataLoader (training and validation batches), the batch
    transform and the MixUp/CutMix between samples (None: off)."""

    meta: Prepared
    size: list[int]
    eval_size: list[int]
    order: TrainOrder
    loader: Loader
    transform: BatchTransform
    mixing: Mixing | None
    rank: int
    world_size: int

    @classmethod
    def load(cls, cfg: Config, views: Views, batch_size_per_rank: int, meta: Prepared, compute: PrecisionPolicy, *,
             rank: int, world_size: int, num_workers: int, decode_on_device: bool = False) -> TrainingData:
        """``paths.prepared`` described by ``meta`` (its normalisation perhaps the pretrained weights'), read in
        ``views`` and ``batch_size_per_rank`` and augmented as ``cfg.train`` says, onto ``compute``'s device
        (encoded images decoded there with ``decode_on_device``, else in the loader's workers)."""
        size, tc = views.size, cfg.train
        raw = meta.encoding == "raw"
        crop = None if raw else TrainCrop(size[0], views.min_crop_scale, tc.hflip, cfg.seed)
        policy = ImagePolicy.from_config(tc, meta.mean, cfg.seed)
        splits = Splits(cfg.paths.prepared, meta, ("train", "val"), size, crop, policy,
                        EvalCrop(views.eval_size[0], views.eval_crop_ratio), decode_on_device)
        transform = BatchTransform(meta.mean, meta.std, tc.random_crop_padding if raw else 0, tc.hflip and raw,
                                   cfg.seed, compute.device, compute.channels_last)
        n = meta.sizes["train"]
        labels = np.asarray(splits.stored["train"].labels) if tc.sampler == "balanced" else None
        order = TrainOrder(n, batch_size_per_rank, rank, world_size, cfg.seed, labels)
        return cls(meta, size, views.eval_size, order, Loader(splits, num_workers, compute.pin_memory), transform,
                   Mixing.from_config(tc, n, cfg.seed), rank, world_size)

    def train_batches(self, epoch: int, start: int = 0, stop: int | None = None) -> Iterator[tuple]:
        """Batches ``start:stop`` of ``epoch`` on this rank (a resumed epoch starts at its checkpointed step):
        (images, labels, keys), and with mixing on the partners' images, labels and keys after them."""
        indices, keys = (t[start:stop] for t in self.order.keyed_batches(epoch))
        mixing = self.mixing
        return self.loader.serve([BatchKey("train", epoch, i, k, mixing.partners(k, epoch) if mixing else None)
                                  for i, k in zip(indices, keys)])

    def train_labels(self) -> np.ndarray:
        """The training split's labels (what ``train.class_weights: balanced`` counts)."""
        return np.asarray(self.loader.splits.stored["train"].labels)

    def eval_batches(self, split: str, batch_size: int) -> Iterator[tuple]:
        """This rank's padded shard of ``split`` (``val``) in the evaluation view."""
        n = self.meta.sizes[split]
        return self.loader.serve([BatchKey(split, None, b) for b in eval_batches(n, batch_size, self.rank,
                                                                                   self.world_size)])

    def examples(self, count: int) -> torch.Tensor:
        """The first ``count`` validation images as the network sees them in evaluation (uint8)."""
        n = min(count, self.meta.sizes["val"])
        images = self.loader.splits.__getitems__(BatchKey("val", None, torch.arange(n)))[0]
        return images.to("cpu") if isinstance(images, EncodedBatch) else images
