"""The prepare stage: a source's images -> the class subset -> seeded stratified splits -> the store.

An official dataset (parsed arrays of one small size) is written as raw pixels in slices. A folder is
read where it lies in two passes over its files, each spread over every core by worker processes that
hold one image at a time: the first decodes every image once (an undecodable one fails the stage, naming
it, before anything is written, or with ``data.skip_bad_images`` is left out and listed) and learns each
one's size and whether it is grey; the second writes each split in order, raw pixels or encoded files
(:mod:`ddpipe.data.images`). Work goes out in chunks, at most a few per worker at a time, and comes back
in order, so the files written are the same bytes whatever the number of cores, and memory is bounded
whatever the number of images. Everything is written into a staging directory that replaces
``paths.prepared`` only when complete: a killed prepare leaves the previous one whole.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import time
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from ddpipe.config.schema import ConfigError, DataConfig
from ddpipe.core.files import atomic_dir
from ddpipe.data import images
from ddpipe.data.encoding import SMALL_IMAGE_SIDE, data_encoding
from ddpipe.data.folders import FileTable, list_imagefolder
from ddpipe.data.formats import RawDataset, read_arrays
from ddpipe.data.images import BadImage, channel_sums, mean_std
from ddpipe.data.splits import make_splits, relabel, select_classes
from ddpipe.data.store import Prepared, PreparedDataError, RawWriter, ShardWriter, write_labels
from ddpipe.data.verify import DataSourceError

logger = logging.getLogger(__name__)

PROBE_CHUNK, ENCODE_CHUNK, ARRAY_CHUNK = 256, 32, 4096  # files (arrays: images) per piece of work
IN_FLIGHT_PER_WORKER = 3  # chunks handed out ahead per worker: enough to keep it busy, few to hold


def prepare(cfg: DataConfig, seed: int, raw_dir: Path, out_dir: Path, workers: int | None = None) -> Prepared:
    """Write the prepared splits of ``cfg.dataset`` into ``out_dir`` atomically; ``workers``: processes
    that decode (default: every core this process may use)."""
    with atomic_dir(out_dir) as staging:
        if cfg.dataset == "imagefolder":
            meta = _prepare_folder(cfg, seed, staging, workers or _cores())
        else:
            meta = _prepare_arrays(cfg, seed, Path(raw_dir), staging)
        if meta.sizes["train"] == 0:
            raise PreparedDataError("the training split is empty")
        meta.write(staging)
    return meta


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _say(message: str) -> None:
    logger.info(f"prepare: {message}")


def _warn(message: str) -> None:
    logger.warning(f"prepare: warning: {message}")


# ---------------------------------------------------------------------------------------------
# Official datasets: arrays of one small size


def _prepare_arrays(cfg: DataConfig, seed: int, raw_dir: Path, staging: Path) -> Prepared:
    raw = read_arrays(cfg, raw_dir)
    labels = np.concatenate([raw.train_labels, raw.test_labels])
    is_test = np.arange(len(labels)) >= len(raw.train_labels)
    kept = select_classes(cfg.classes, raw.classes, cfg.dataset)
    positions, labels = relabel(labels, kept)
    splits = make_splits(labels, is_test[positions], cfg, seed)
    chw = tuple(int(d) for d in raw.train_images.shape[1:])
    encoding = data_encoding(cfg, True, max(chw[1:]))[0]  # the official datasets: one small size, raw for auto
    sums = np.zeros((2, chw[0]), dtype=np.int64)
    for name, split in splits.items():
        rows = positions[split]
        write_labels(staging, name, labels[split])
        writer = RawWriter(staging, name, len(rows), chw) if encoding == "raw" else \
            ShardWriter(staging, name, len(rows))
        for start in range(0, len(rows), ARRAY_CHUNK):
            pixels = _array_rows(raw, rows[start:start + ARRAY_CHUNK])
            if name == "train":
                sums += channel_sums(pixels.transpose(0, 2, 3, 1))
            if isinstance(writer, RawWriter):
                writer.write(start, pixels)
            else:
                for image in pixels:
                    writer.add(images.encode_array(image), chw[1], chw[2])
        writer.close()
    mean, std = mean_std(sums, len(splits["train"]) * chw[1] * chw[2])
    return Prepared(dataset=cfg.dataset, classes=[raw.classes[i] for i in kept], num_channels=chw[0], encoding=encoding,
                    image_size=[chw[1], chw[2]] if encoding == "raw" else None,
                    max_side=None if encoding == "raw" else max(chw[1:]), mean=mean, std=std,
                    sizes={k: int(len(v)) for k, v in splits.items()},
                    source={"images": int(len(positions))})


def _array_rows(raw: RawDataset, rows: np.ndarray) -> np.ndarray:
    """Images at these positions of train + test (in order)."""
    n_train = len(raw.train_labels)
    train, test = rows[rows < n_train], rows[rows >= n_train] - n_train
    parts = [raw.train_images[train]] + ([raw.test_images[test]] if len(test) else [])
    return np.concatenate(parts) if len(parts) > 1 else parts[0]


# ---------------------------------------------------------------------------------------------
# A folder of one's own


def _prepare_folder(cfg: DataConfig, seed: int, staging: Path, workers: int) -> Prepared:
    table = list_imagefolder(Path(cfg.source_dir))
    kept = select_classes(cfg.classes, table.classes, f"data.source_dir = {cfg.source_dir!r}")
    positions, labels = relabel(table.labels, kept)
    _say(f"{len(table)} images in {len(table.classes)} class folders of {table.root} ({table.not_images} other "
         f"files skipped); keeping {len(kept)} classes: {len(positions)} images; {workers} worker process(es)")
    for sentence in table.left_out():
        _warn(sentence)
    ctx = multiprocessing.get_context("spawn")  # workers import only ddpipe.data.images: no copy of this process
    with ctx.Pool(workers) as pool:
        probed, bad = _probe(pool, workers, table, positions, cfg.skip_bad_images, staging / ".probed.npy")
        good = np.ones(len(positions), dtype=bool)
        good[[i for i, _ in bad]] = False
        positions, labels, rows = positions[good], labels[good], np.flatnonzero(good)
        if len(positions) == 0:
            raise PreparedDataError(f"data.source_dir = {cfg.source_dir!r}: no decodable image in the kept classes")
        grey = all(probed[np.sort(rows[a:a + 65536]), 2].all() for a in range(0, len(rows), 65536))
        encoding = _choose_encoding(cfg, probed, rows)
        splits = make_splits(labels, None, cfg, seed)
        for name, split in splits.items():
            write_labels(staging, name, labels[split])
            _write_split(pool, workers, table, positions[split], name, staging, encoding, grey, cfg,
                         tuple(int(v) for v in probed[rows[0], :2]))
    sums, pixels = _train_sums(probed, rows[splits["train"]])
    mean, std = mean_std(sums[:, :1] if grey else sums, pixels)
    size = [int(probed[rows[0], 1]), int(probed[rows[0], 0])]
    del probed
    (staging / ".probed.npy").unlink()
    return Prepared(
        dataset="imagefolder", classes=[table.classes[i] for i in kept], num_channels=1 if grey else 3,
        encoding=encoding, image_size=size if encoding == "raw" else None,
        max_side=None if encoding == "raw" else cfg.max_side, mean=mean, std=std,
        sizes={k: int(len(v)) for k, v in splits.items()},
        source={"source_dir": str(table.root), "images": int(len(good)), "not_images": table.not_images,
                "root_images": table.root_images, "empty_folders": [name for name, _ in table.empty_folders],
                "skipped_undecodable": [msg for _, msg in bad]},
    )


# What the first pass learns of each image: width, height, grey, then its channel sums and sums of squares
PROBED_COLUMNS = 3 + 2 * 3


def _probe(pool: Any, workers: int, table: FileTable, positions: np.ndarray, skip: bool, path: Path
           ) -> tuple[np.ndarray, list[tuple[int, str]]]:
    """Decode every kept image once: ``[n, PROBED_COLUMNS]`` int64 (memory-mapped into ``path``: it grows with
    the dataset) and the undecodable ones as (position in ``positions``, message). DataSourceError naming
    the first unless ``skip``."""
    probed = np.lib.format.open_memmap(path, mode="w+", dtype=np.int64, shape=(len(positions), PROBED_COLUMNS))
    bad: list[tuple[int, str]] = []
    chunks = _chunks(len(positions), PROBE_CHUNK)
    results = _ordered(pool, workers, images.probe_chunk,
                       ([table.path(p) for p in positions[a:b]] for a, b in chunks))
    started, done = time.monotonic(), 0
    for (a, b), result in zip(chunks, results):
        for i, r in enumerate(result, start=a):
            if isinstance(r, str):
                if not skip:
                    raise DataSourceError(f"{r}. Nothing was written; fix or remove the file, or set "
                                          "data.skip_bad_images=true to leave such files out (they are listed)")
                bad.append((i, r))
                _warn(f"skipped {r}")
            else:
                w, h, grey, sums = r
                probed[i, :3] = (w, h, grey)
                probed[i, 3:] = sums.reshape(-1)
        done = _progress("checked", b, len(positions), started, done)
    if skip:
        _say(f"{len(bad)} undecodable image(s) skipped")
    return probed, bad


def _train_sums(probed: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, int]:
    """The training images' channel sums ``[2, 3]`` and pixels per channel, a slice at a time."""
    sums, pixels = np.zeros((2, 3), dtype=np.int64), 0
    for a in range(0, len(rows), 65536):
        part = probed[np.sort(rows[a:a + 65536])]
        sums += part[:, 3:].sum(0).reshape(2, 3)
        pixels += int((part[:, 0] * part[:, 1]).sum())
    return sums, pixels


def _choose_encoding(cfg: DataConfig, probed: np.ndarray, rows: np.ndarray) -> str:
    sizes = np.unique(np.concatenate([np.unique(probed[np.sort(rows[a:a + 65536]), :2], axis=0)
                                      for a in range(0, len(rows), 65536)]), axis=0)
    one_size = len(sizes) == 1
    if cfg.encoding == "raw" and not one_size:
        shown = ", ".join(f"{w}x{h}" for w, h in sizes[:5].tolist()) + (", ..." if len(sizes) > 5 else "")
        raise ConfigError(f"data.encoding = 'raw' is not accepted for {cfg.source_dir}: raw pixels need one size "
                          f"for every image, found {len(sizes)} sizes ({shown}); accepted: auto or encoded")
    encoding, chosen = data_encoding(cfg, one_size, int(sizes.max(initial=0)))
    if chosen:
        why = "sizes vary" if not one_size else f"one size, {sizes[0][0]}x{sizes[0][1]}" + (
            "" if encoding == "raw" else f", larger than {SMALL_IMAGE_SIDE} px")
        _say(f"encoding auto -> {encoding} ({why})")
    return encoding


def _write_split(pool: Any, workers: int, table: FileTable, positions: np.ndarray, name: str, staging: Path,
                 encoding: str, grey: bool, cfg: DataConfig, raw_size: tuple[int, int]) -> None:
    """One split's images into the store, in order (``raw_size``: width, height of every raw image)."""
    chunks = _chunks(len(positions), ENCODE_CHUNK)
    paths = ([table.path(p) for p in positions[a:b]] for a, b in chunks)
    started, done = time.monotonic(), 0
    if encoding == "raw":
        w, h = raw_size
        writer: RawWriter | ShardWriter = RawWriter(staging, name, len(positions), (1 if grey else 3, h, w))
        for (a, b), pixels in zip(chunks, _ordered(pool, workers, images.pixels_chunk, ((p, grey) for p in paths))):
            writer.write(a, pixels)
            done = _progress(name, b, len(positions), started, done)
    else:
        writer = ShardWriter(staging, name, len(positions))
        work = ((p, grey, cfg.max_side, cfg.jpeg_quality) for p in paths)
        for (_, b), (blobs, sizes) in zip(chunks, _ordered(pool, workers, images.encode_chunk, work)):
            for blob, (height, width) in zip(blobs, sizes.tolist()):
                writer.add(blob, height, width)
            done = _progress(name, b, len(positions), started, done)
    writer.close()


def _progress(what: str, done: int, total: int, started: float, last: int) -> int:
    """A line every tenth of a large pass, and at its end."""
    if done == total or done - last >= max(1000, total // 10):
        rate = done / max(time.monotonic() - started, 1e-9)
        _say(f"{what}: {done}/{total} images ({rate:.0f} images/s)")
        return done
    return last


def _chunks(n: int, size: int) -> list[tuple[int, int]]:
    return [(a, min(a + size, n)) for a in range(0, n, size)]


def _ordered(pool: Any, workers: int, fn: Callable[..., Any], args: Iterator[Any]) -> Iterator[Any]:
    """``fn(*a)`` for each ``a`` (a single argument is wrapped) on the pool, results in order, with at most
    ``IN_FLIGHT_PER_WORKER`` chunks per worker handed out: bounded memory, every core busy. A BadImage
    from a worker (an image the first pass decoded, failing now) becomes a DataSourceError."""
    pending: deque = deque()
    limit = max(1, workers * IN_FLIGHT_PER_WORKER)
    for a in args:
        pending.append(pool.apply_async(fn, a if isinstance(a, tuple) else (a,)))
        if len(pending) >= limit:
            yield _get(pending.popleft())
    while pending:
        yield _get(pending.popleft())


def _get(result: Any) -> Any:
    try:
        return result.get()
    except BadImage as exc:
        raise DataSourceError(f"{exc}. Nothing was written") from None
