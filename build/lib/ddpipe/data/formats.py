"""How a dataset's files are parsed: ``read_arrays`` parses the fetch stage's copy of an official dataset
(the MNISTs' IDX files, CIFAR-10's python batches) into uint8 arrays ``[N, C, H, W]`` and int64 labels.
"""

from __future__ import annotations

import gzip
import pickle
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ddpipe.config.schema import DataConfig
from ddpipe.data.verify import DataSourceError

CLASSES = {
    "fashion_mnist": ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
                      "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"],
    "mnist": [str(i) for i in range(10)],
}


# What to do when the fetch stage's output (paths.raw), which prepare reads, is missing or incomplete.
RUN_FETCH_FIRST = "run the fetch stage first: `dvc repro fetch` or `python stages/fetch.py`"


@dataclass
class RawDataset:
    """A dataset as parsed from its files: uint8 images [N, C, H, W] and int64 labels."""

    train_images: np.ndarray
    train_labels: np.ndarray
    test_images: np.ndarray | None
    test_labels: np.ndarray | None
    classes: list[str]


# ---------------------------------------------------------------------------------------------
# Parsing the fetched files


def read_arrays(cfg: DataConfig, raw_dir: Path) -> RawDataset:
    """Parse the fetch stage's copy of an official dataset (the MNISTs, CIFAR-10) into arrays."""
    raw_dir = Path(raw_dir)
    if not raw_dir.is_dir():
        raise DataSourceError(f"paths.raw = {str(raw_dir)!r}: not a directory (the fetch stage's output); "
                              f"{RUN_FETCH_FIRST}")
    if cfg.dataset in ("fashion_mnist", "mnist"):
        return RawDataset(
            read_idx(raw_dir / "train-images-idx3-ubyte.gz")[:, None],
            read_idx(raw_dir / "train-labels-idx1-ubyte.gz").astype(np.int64),
            read_idx(raw_dir / "t10k-images-idx3-ubyte.gz")[:, None],
            read_idx(raw_dir / "t10k-labels-idx1-ubyte.gz").astype(np.int64),
            list(CLASSES[cfg.dataset]),
        )
    return read_cifar10(raw_dir)


def read_idx(path: Path) -> np.ndarray:
    """Read a (gzipped) IDX file of unsigned bytes: the MNIST family's format."""
    try:
        with (gzip.open if path.suffix == ".gz" else open)(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise DataSourceError(f"{path}: missing; {RUN_FETCH_FIRST}") from None
    except (OSError, EOFError) as exc:
        raise DataSourceError(f"{path}: corrupt or truncated ({exc})") from exc
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] != 0x08:
        raise DataSourceError(f"{path}: not an IDX file of unsigned bytes (bad magic number)")
    ndim = data[3]
    dims = tuple(int.from_bytes(data[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim))
    offset = 4 + 4 * ndim
    expected = int(np.prod(dims))
    if len(data) - offset != expected:
        raise DataSourceError(
            f"{path}: truncated or padded: header says {dims} ({expected} bytes), file has {len(data) - offset}"
        )
    return np.frombuffer(data, dtype=np.uint8, offset=offset).reshape(dims).copy()


class _NumpyOnlyUnpickler(pickle.Unpickler):
    """CIFAR-10's batches are pickles; allow only what numpy arrays need, so a tampered file
    cannot run code."""

    ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
        ("numpy", "ndarray"), ("numpy", "dtype"), ("_codecs", "encode"),
    }

    def find_class(self, module: str, name: str):
        if (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}")


def _read_cifar_pickle(path: Path) -> dict:
    try:
        with open(path, "rb") as f:
            return _NumpyOnlyUnpickler(f, encoding="latin1").load()
    except FileNotFoundError:
        raise DataSourceError(f"{path}: missing; {RUN_FETCH_FIRST}") from None
    except Exception as exc:
        raise DataSourceError(f"{path}: cannot be parsed as a CIFAR-10 batch ({exc})") from exc


def read_cifar10(raw_dir: Path) -> RawDataset:
    """Parse CIFAR-10's python batches."""

    def batch(name: str) -> tuple[np.ndarray, np.ndarray]:
        d = _read_cifar_pickle(raw_dir / name)
        try:
            images = np.asarray(d["data"], dtype=np.uint8).reshape(-1, 3, 32, 32)
            labels = np.asarray(d["labels"], dtype=np.int64)
        except (KeyError, ValueError) as exc:
            raise DataSourceError(f"{raw_dir / name}: not a CIFAR-10 batch ({exc})") from exc
        return images, labels

    train = [batch(f"data_batch_{i}") for i in range(1, 6)]
    test_images, test_labels = batch("test_batch")
    classes = list(_read_cifar_pickle(raw_dir / "batches.meta")["label_names"])
    return RawDataset(
        np.concatenate([t[0] for t in train]), np.concatenate([t[1] for t in train]),
        test_images, test_labels, classes,
    )
