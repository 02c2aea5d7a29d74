"""The prepared data on disk (``paths.prepared``): a few large files per split, read memory-mapped.

    meta.json                    :class:`Prepared`: classes, channels, encoding, split sizes, mean and std
    <split>.labels.npy           int64 [N]
    raw encoding:
      <split>.images.npy         uint8 [N, C, H, W]: every image's pixels, one size for all
    encoded encoding:
      <split>.index.npy          int64 [N, 5]: shard, byte offset, byte length, height, width
      <split>-00000.bin, ...     the images' JPEG/PNG files back to back, shards of at most SHARD_BYTES

A sample is found by its index in the split, never through a per-sample Python object: a reader holds
a handful of ``numpy.memmap`` s, so a rank's own memory does not grow with the dataset, every rank and
loader worker on a node reads the same page cache, and DVC tracks a few large files per split.

Why a format of our own: FFCV's ``.beton`` needs a C build and its library is unmaintained since 2023;
MosaicML Streaming and LitData bring their own samplers (the order would no longer be DistributedSampler's,
the one that makes a step's global batch the same at every world size) and shared-memory state; WebDataset
tars cannot be indexed. Two kinds of ``.npy`` file and raw shards are what ``np.load(mmap_mode="r")`` and
``np.memmap`` read with no code of ours in between.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

SPLITS = ("train", "val", "test")
ENCODINGS = ("raw", "encoded")
SHARD_BYTES = 256 << 20  # a shard closes before it would pass this (one image larger than it gets a shard alone)
INDEX_COLUMNS = 5  # shard, offset, nbytes, height, width
REPREPARE = "run the prepare stage again (dvc repro --force prepare)"


class PreparedDataError(RuntimeError):
    """The prepared data is missing or inconsistent."""


@dataclass(frozen=True)
class Prepared:
    """``meta.json``: the dataset, its classes and channels, how the images are stored (``encoding``; raw
    images all have ``image_size`` [H, W], encoded ones keep their own size up to ``max_side``), the
    training split's per-channel mean and std (0-1 scale), and each split's size. ``source`` says what the
    prepare stage read: files seen, files skipped as not images, and images skipped as undecodable."""

    dataset: str
    classes: list[str]
    num_channels: int
    encoding: str
    image_size: list[int] | None
    max_side: int | None
    mean: list[float]
    std: list[float]
    sizes: dict[str, int]
    source: dict[str, Any] = field(default_factory=dict)

    def write(self, directory: Path) -> None:
        (Path(directory) / "meta.json").write_text(json.dumps(asdict(self), indent=2) + "\n")


def load_meta(prepared_dir: str | Path) -> Prepared:
    """``meta.json`` of the prepared data in ``prepared_dir``."""
    path = Path(prepared_dir) / "meta.json"
    if not path.is_file():
        raise PreparedDataError(f"{path}: missing; run the prepare stage first (dvc repro prepare)")
    try:
        meta = Prepared(**json.loads(path.read_text()))
    except (TypeError, ValueError) as exc:  # not JSON, or other keys than this version writes
        raise PreparedDataError(f"{path}: not this version's prepared data ({exc}); {REPREPARE}") from None
    if meta.encoding not in ENCODINGS:
        raise PreparedDataError(f"{path}: encoding {meta.encoding!r} is not one of {ENCODINGS}; {REPREPARE}")
    return meta


# ---------------------------------------------------------------------------------------------
# Writers (the prepare stage, into its staging directory)


def write_labels(directory: Path, split: str, labels: np.ndarray) -> None:
    np.save(Path(directory) / f"{split}.labels.npy", np.asarray(labels, dtype=np.int64))


class RawWriter:
    """A split's pixels, ``[N, C, H, W]`` uint8, written in slices into one memory-mapped ``.npy``."""

    def __init__(self, directory: Path, split: str, n: int, chw: tuple[int, int, int]) -> None:
        self.array = np.lib.format.open_memmap(Path(directory) / f"{split}.images.npy", mode="w+",
                                               dtype=np.uint8, shape=(n, *chw))

    def write(self, start: int, pixels: np.ndarray) -> None:
        self.array[start:start + len(pixels)] = pixels

    def close(self) -> None:
        self.array.flush()
        del self.array


class ShardWriter:
    """A split's encoded images, appended in order into shards of at most ``shard_bytes``, and its index."""

    def __init__(self, directory: Path, split: str, n: int, shard_bytes: int = SHARD_BYTES) -> None:
        self.directory, self.split, self.shard_bytes = Path(directory), split, shard_bytes
        # memory-mapped: a dataset's index is written to its file, not held by the prepare process
        self.index = np.lib.format.open_memmap(self.directory / f"{split}.index.npy", mode="w+", dtype=np.int64,
                                               shape=(n, INDEX_COLUMNS))
        self.count, self.shard, self.offset = 0, -1, shard_bytes  # the first add opens shard 0
        self.file = None

    def add(self, blob: bytes, height: int, width: int) -> None:
        if self.offset and self.offset + len(blob) > self.shard_bytes:
            self._next_shard()
        assert self.file is not None
        self.file.write(blob)
        self.index[self.count] = (self.shard, self.offset, len(blob), height, width)
        self.count, self.offset = self.count + 1, self.offset + len(blob)

    def _next_shard(self) -> None:
        if self.file is not None:
            self.file.close()
        self.shard, self.offset = self.shard + 1, 0
        self.file = open(self.directory / shard_name(self.split, self.shard), "wb")  # noqa: SIM115

    def close(self) -> None:
        assert self.count == len(self.index), f"{self.count} of {len(self.index)} images written"
        if self.file is not None:
            self.file.close()
        self.index.flush()
        del self.index


def shard_name(split: str, shard: int) -> str:
    return f"{split}-{shard:05d}.bin"


# ---------------------------------------------------------------------------------------------
# Readers (memory-mapped; pickled as their paths, so a spawned loader worker maps the files itself)


def _open_npy(path: Path) -> np.ndarray:
    if not path.is_file():
        raise PreparedDataError(f"{path}: missing; run the prepare stage first (dvc repro prepare)")
    try:
        return np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError) as exc:
        raise PreparedDataError(f"{path}: cannot be read ({exc}); {REPREPARE}") from None


class StoredSplit:
    """One prepared split, memory-mapped: ``labels`` and, by encoding, the pixels or the encoded files."""

    encoding = ""

    def __init__(self, directory: str | Path, split: str) -> None:
        self.directory, self.split = Path(directory), split
        self.labels = _open_npy(self.directory / f"{split}.labels.npy")
        self._open()

    def _open(self) -> None:
        raise NotImplementedError

    def __len__(self) -> int:
        return len(self.labels)

    def __getstate__(self) -> dict[str, Any]:
        return {"directory": self.directory, "split": self.split}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["directory"], state["split"])  # type: ignore[misc]


class RawSplit(StoredSplit):
    """Pixels of one size for every image: a batch is one gather from the memory map."""

    encoding = "raw"

    def _open(self) -> None:
        self.images = _open_npy(self.directory / f"{self.split}.images.npy")
        if self.images.ndim != 4 or len(self.images) != len(self.labels):
            raise PreparedDataError(f"{self.directory / self.split}.images.npy: shape {self.images.shape} does not "
                                    f"match {len(self.labels)} labels; {REPREPARE}")

    def pixels(self, indices: np.ndarray) -> np.ndarray:
        """uint8 ``[B, C, H, W]`` of these samples (a copy out of the page cache)."""
        return self.images[np.asarray(indices)]


class EncodedSplit(StoredSplit):
    """JPEG/PNG files in shards: ``blob(i)`` is sample ``i``'s file, a view into its shard's memory map."""

    encoding = "encoded"

    def _open(self) -> None:
        path = self.directory / f"{self.split}.index.npy"
        self.index = _open_npy(path)
        if self.index.shape != (len(self.labels), INDEX_COLUMNS):
            raise PreparedDataError(f"{path}: shape {self.index.shape} does not match {len(self.labels)} labels; "
                                    f"{REPREPARE}")
        count = int(self.index[:, 0].max()) + 1 if len(self.index) else 0
        ends = np.zeros(count, dtype=np.int64)  # how long each shard must be
        np.maximum.at(ends, self.index[:, 0], self.index[:, 1] + self.index[:, 2])
        self.shards = []
        for s in range(count):
            shard = self.directory / shard_name(self.split, s)
            if not shard.is_file() or shard.stat().st_size < ends[s]:
                raise PreparedDataError(f"{shard}: missing or shorter than its index says; {REPREPARE}")
            self.shards.append(np.memmap(shard, dtype=np.uint8, mode="r"))

    def blob(self, i: int) -> np.ndarray:
        shard, offset, nbytes = (int(v) for v in self.index[i, :3])
        return self.shards[shard][offset:offset + nbytes]

    def size(self, i: int) -> tuple[int, int]:
        """(height, width) of sample ``i`` as stored."""
        return int(self.index[i, 3]), int(self.index[i, 4])


def open_split(directory: str | Path, split: str, meta: Prepared | None = None) -> RawSplit | EncodedSplit:
    """The split ``split`` of the prepared data in ``directory``, memory-mapped."""
    meta = meta or load_meta(directory)
    return (RawSplit if meta.encoding == "raw" else EncodedSplit)(directory, split)
