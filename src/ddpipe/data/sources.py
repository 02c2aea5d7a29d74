"""Where a dataset's files come from, how they are verified, and how they are parsed.

The official datasets (``fetch``): the first of ``data.source_dir`` (when it holds their files), the
directory Debian's ``dataset-<name>`` package installs, torchvision's download, copied into
``paths.raw``. Every file is checked against its published MD5 before it is used; ``read_arrays``
parses them into uint8 arrays ``[N, C, H, W]`` and int64 labels.

A folder of one's own (``imagefolder``): one sub-folder of images per class, read where it lies
(``data.source_dir``). The fetch stage only checks it and writes what it found (``source.json``) into
``paths.raw``; the prepare stage lists it again (:func:`list_imagefolder`) and reads the images.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import pickle
import shutil
import tarfile
import tempfile
from array import array
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ddpipe.config.schema import DataConfig
from ddpipe.data.images import IMAGE_SUFFIXES, is_image_name
from ddpipe.fsutil import atomic_dir, atomic_write_json

# Published MD5s of the official files (the same table torchvision checks).
# Debian's dataset-fashion-mnist re-gzips the files (new gzip headers, same content), so for
# Fashion-MNIST we also accept the MD5 of the decompressed IDX payload, recorded from that package.
CHECKSUMS: dict[str, dict[str, tuple[str, ...]]] = {
    "fashion_mnist": {
        "train-images-idx3-ubyte.gz": ("8d4fb7e6c68d591d4c3dfef9ec88bf0d", "f4a8712d7a061bf5bd6d2ca38dc4d50a"),
        "train-labels-idx1-ubyte.gz": ("25c81989df183df01b3e8a0aad5dffbe", "9018921c3c673c538a1fc5bad174d6f9"),
        "t10k-images-idx3-ubyte.gz": ("bef4ecab320f06d8554ea6380940ec79", "8181f5470baa50b63fa0f6fddb340f0a"),
        "t10k-labels-idx1-ubyte.gz": ("bb300cfdad3c16e7a12a480ee83cd310", "15d484375f8d13e6eb1aabb0c3f46965"),
    },
    "mnist": {
        "train-images-idx3-ubyte.gz": ("f68b3c2dcbeaaa9fbdd348bbdeb94873",),
        "train-labels-idx1-ubyte.gz": ("d53e105ee54ea40749a09fcbcd1e9432",),
        "t10k-images-idx3-ubyte.gz": ("9fb629c4189551a2d022fa330f9573f3",),
        "t10k-labels-idx1-ubyte.gz": ("ec29112dd5afa0611ce80d1b7f02629c",),
    },
    "cifar10": {
        "data_batch_1": ("c99cafc152244af753f735de768cd75f",),
        "data_batch_2": ("d4bba439e000b95fd0a9bffe97cbabec",),
        "data_batch_3": ("54ebc095f3ab1f0389bbae665268c751",),
        "data_batch_4": ("634d18415352ddfa80567beed471001a",),
        "data_batch_5": ("482c414d41f54cd18b22e5b47cb7c3cb",),
        "test_batch": ("40351d587109b95175f43aff81a1287e",),
        "batches.meta": ("5ff9c542aee3614f3951f8cda6e48888",),
        "cifar-10-python.tar.gz": ("c58f30108f718f92721af3b95e74349a",),
    },
}
CIFAR_ARCHIVE, CIFAR_FOLDER = "cifar-10-python.tar.gz", "cifar-10-batches-py"
DEBIAN_DIRS = {"fashion_mnist": "/usr/share/datasets/fashion-mnist", "mnist": "/usr/share/datasets/mnist"}
CLASSES = {
    "fashion_mnist": ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
                      "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"],
    "mnist": [str(i) for i in range(10)],
}


# What to do when the fetch stage's output (paths.raw), which prepare reads, is missing or incomplete.
RUN_FETCH_FIRST = "run the fetch stage first: `dvc repro fetch` or `python stages/fetch.py`"


class DataSourceError(RuntimeError):
    """The dataset's files are missing, corrupt, or cannot be parsed."""


@dataclass
class RawDataset:
    """A dataset as parsed from its files: uint8 images [N, C, H, W] and int64 labels."""

    train_images: np.ndarray
    train_labels: np.ndarray
    test_images: np.ndarray | None
    test_labels: np.ndarray | None
    classes: list[str]


# ---------------------------------------------------------------------------------------------
# Verification


def md5sum(path: Path, gunzip: bool = False) -> str:
    h = hashlib.md5()
    opener = gzip.open if gunzip else open
    with opener(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def verify_file(path: Path, dataset: str) -> None:
    """Raise DataSourceError naming ``path`` unless its MD5 is a published one."""
    expected = CHECKSUMS[dataset][path.name]
    if not path.is_file():
        raise DataSourceError(f"{path}: missing")
    got = md5sum(path)
    if got in expected:
        return
    if path.suffix == ".gz" and len(expected) > 1:
        try:
            if md5sum(path, gunzip=True) in expected[1:]:
                return
        except (OSError, EOFError, gzip.BadGzipFile) as exc:
            raise DataSourceError(f"{path}: corrupt or truncated gzip file ({exc})") from exc
    raise DataSourceError(
        f"{path}: checksum mismatch (MD5 {got}, expected {expected[0]}); the file is corrupt, "
        "truncated or not the official one. Delete it and fetch again."
    )


# ---------------------------------------------------------------------------------------------
# Fetch: put verified files into the fetch stage's output directory


def required_files(dataset: str) -> list[str]:
    if dataset == "cifar10":
        return [n for n in CHECKSUMS["cifar10"] if n != CIFAR_ARCHIVE]
    return list(CHECKSUMS[dataset])


def fetch(cfg: DataConfig, out_dir: Path, download_urls: dict[str, list[str]] | None = None) -> str:
    """Copy the dataset's verified files into ``out_dir`` (replaced whole, only on success).

    Returns a sentence saying where the files came from. ``download_urls`` overrides torchvision's
    mirrors (used by tests with a local server).
    """
    with atomic_dir(out_dir) as staging:
        if cfg.dataset == "imagefolder":
            origin = _fetch_imagefolder(cfg, staging)
        else:
            origin = _fetch_official(cfg, staging, download_urls)
    return origin


def _fetch_official(cfg: DataConfig, staging: Path, download_urls: dict[str, list[str]] | None) -> str:
    name = cfg.dataset
    tried: list[str] = []
    candidates = []
    if cfg.source_dir:
        candidates.append(("data.source_dir", Path(cfg.source_dir)))
    if name in DEBIAN_DIRS:
        candidates.append((f"Debian's dataset-{name.replace('_', '-')} package", Path(DEBIAN_DIRS[name])))
    for label, directory in candidates:
        if label == "data.source_dir" and not directory.is_dir():
            raise DataSourceError(f"data.source_dir = {cfg.source_dir!r}: not a directory")
        if _copy_verified(name, directory, staging):
            return f"{label} ({directory})"
        tried.append(f"{label}: {directory} has no copy")
        if label == "data.source_dir" and _holds_some(name, directory):
            raise DataSourceError(
                f"data.source_dir = {cfg.source_dir!r} holds part of the {name} files; expected all of "
                f"{', '.join(_expected_names(name))}"
            )
    if not cfg.download:
        raise DataSourceError(_no_data_message(name, tried + ["download: data.download=false"]))
    try:
        with tempfile.TemporaryDirectory() as dl:
            _download(name, Path(dl), (download_urls or {}).get(name))
            if _copy_verified(name, Path(dl), staging):
                return "torchvision's download"
    except DataSourceError:
        raise
    except Exception as exc:  # network errors come in many types (URLError, HTTPError, OSError)
        tried.append(f"download failed: {exc}")
        raise DataSourceError(_no_data_message(name, tried)) from exc
    raise DataSourceError(_no_data_message(name, tried + ["download gave incomplete files"]))


def _holds_some(name: str, directory: Path) -> bool:
    names = set(required_files(name)) | {CIFAR_ARCHIVE, CIFAR_FOLDER}
    return any((directory / n).exists() for n in names)


def _expected_names(name: str) -> list[str]:
    return [CIFAR_ARCHIVE + " (or its unpacked folder)"] if name == "cifar10" else required_files(name)


def _no_data_message(name: str, tried: list[str]) -> str:
    deb = f"apt-get install dataset-{name.replace('_', '-')}" if name in DEBIAN_DIRS else None
    ways = [f"set data.source_dir to a directory holding {', '.join(_expected_names(name))}"]
    if deb:
        ways.append(f"install Debian's package ({deb}), which puts them in {DEBIAN_DIRS[name]}")
    ways.append("allow the download (data.download=true) on a machine with internet access")
    return (
        f"no copy of the {name} dataset could be found ({'; '.join(tried)}). Provide it one of these "
        "ways:\n" + "\n".join(f"  {i + 1}. {w}" for i, w in enumerate(ways))
    )


def _copy_verified(name: str, directory: Path, staging: Path) -> bool:
    """Copy the dataset from ``directory`` into ``staging`` after verification.

    False if ``directory`` does not hold the files; DataSourceError if it holds bad ones.
    """
    if name == "cifar10":
        return _copy_cifar(directory, staging)
    files = [directory / n for n in required_files(name)]
    if not all(f.is_file() for f in files):
        return False
    for f in files:
        verify_file(f, name)
        shutil.copyfile(f, staging / f.name)
    return True


def _copy_cifar(directory: Path, staging: Path) -> bool:
    folder = directory / CIFAR_FOLDER if (directory / CIFAR_FOLDER).is_dir() else directory
    names = required_files("cifar10")
    if all((folder / n).is_file() for n in names):
        for n in names:
            verify_file(folder / n, "cifar10")
            shutil.copyfile(folder / n, staging / n)
        return True
    archive = directory / CIFAR_ARCHIVE
    if not archive.is_file():
        return False
    verify_file(archive, "cifar10")
    with tarfile.open(archive) as tar:
        for n in names:
            member = tar.getmember(f"{CIFAR_FOLDER}/{n}")
            src = tar.extractfile(member)
            assert src is not None
            with open(staging / n, "wb") as dst:
                shutil.copyfileobj(src, dst)
            verify_file(staging / n, "cifar10")
    return True


def _download(name: str, dest: Path, urls: list[str] | None) -> None:
    """torchvision's download of the official files into ``dest`` (checked by ``_copy_verified``)."""
    from torchvision import datasets
    from torchvision.datasets.utils import download_url

    if name == "cifar10":
        filenames = [CIFAR_ARCHIVE]
        mirrors = urls or [datasets.CIFAR10.url.rsplit("/", 1)[0]]
    else:
        tv = {"fashion_mnist": datasets.FashionMNIST, "mnist": datasets.MNIST}[name]
        filenames, mirrors = required_files(name), urls or tv.mirrors
    for filename in filenames:
        errors = []
        for mirror in mirrors:
            try:
                download_url(mirror.rstrip("/") + "/" + filename, str(dest), filename=filename)
                break
            except Exception as exc:  # try the next mirror
                errors.append(f"{mirror}: {exc}")
        else:
            raise OSError(f"{filename}: " + "; ".join(errors))


def _fetch_imagefolder(cfg: DataConfig, staging: Path) -> str:
    """Check the folder where it lies and record what it holds (``source.json``): no copy of the images."""
    table = list_imagefolder(_folder(cfg))
    counts = np.bincount(table.labels, minlength=len(table.classes)).tolist()
    atomic_write_json(staging / "source.json", {
        "source_dir": str(table.root), "classes": dict(zip(table.classes, counts)), "images": len(table),
        "not_images": table.not_images})
    return (f"data.source_dir ({table.root}: {len(table)} images in {len(table.classes)} classes, "
            f"{table.not_images} other files skipped; read there by the prepare stage)")


def _folder(cfg: DataConfig) -> Path:
    if not cfg.source_dir:
        raise DataSourceError(
            "data.dataset = 'imagefolder' needs data.source_dir: a directory with one sub-folder of "
            "images per class (track it with `dvc add`)"
        )
    return Path(cfg.source_dir)


@dataclass
class FileTable:
    """The images of a class-per-folder directory, in class then path order, without a Python object per
    file: relative paths packed into one byte array (``names`` split at ``offsets``), labels as int64. What
    the listing leaves out is counted: other files in the class folders (``not_images``), images at the root
    (``root_images``, the first few by name in ``root_examples``), and class folders without an image
    (``empty_folders``: each name with its count of other files)."""

    root: Path
    classes: list[str]
    names: np.ndarray
    offsets: np.ndarray
    labels: np.ndarray
    not_images: int
    root_images: int
    root_examples: list[str]
    empty_folders: list[tuple[str, int]]

    def __len__(self) -> int:
        return len(self.labels)

    def path(self, i: int) -> str:
        rel = bytes(self.names[self.offsets[i]:self.offsets[i + 1]]).decode("utf-8", "surrogateescape")
        return str(self.root / self.classes[self.labels[i]] / rel)

    def left_out(self) -> list[str]:
        """A sentence for each kind of silent drop: images at the root, class folders without an image."""
        said = []
        if self.root_images:
            shown = ", ".join(self.root_examples) + (", ..." if self.root_images > len(self.root_examples) else "")
            said.append(f"{self.root_images} image file(s) at the root of {self.root}, not in a class folder, are left "
                        f"out ({shown}); each class is a sub-folder: move them into theirs")
        if self.empty_folders:
            shown = ", ".join(f"{name}/ ({other} other file(s))" if other else f"{name}/ (empty)"
                              for name, other in self.empty_folders)
            said.append(f"{len(self.empty_folders)} folder(s) of {self.root} hold no image and make no class: {shown}")
        return said


ROOT_EXAMPLES = 3  # root images named in the message


def list_imagefolder(root: Path, key: str = "data.source_dir") -> FileTable:
    """Every image under each class folder of ``root`` (sub-folders too, as torchvision's ImageFolder; any
    suffix case), sorted; other files, images at the root and folders without an image are counted and
    skipped (:meth:`FileTable.left_out`). DataSourceError unless there are at least two classes with images."""
    if not root.is_dir():
        raise DataSourceError(f"{key} = {str(root)!r}: not a directory")
    # array('q'): 8 bytes a file, where a list of ints would take 36
    blob, offsets, labels, classes, not_images = bytearray(), array("q", [0]), array("q"), [], 0
    empty: list[tuple[str, int]] = []
    for folder in sorted(d.name for d in os.scandir(root) if d.is_dir() and not d.name.startswith(".")):
        found, other = _images_under(root / folder)
        not_images += other
        if not found:
            empty.append((folder, other))
            continue
        for name in sorted(found):
            blob += name.encode("utf-8", "surrogateescape")
            offsets.append(len(blob))
        labels.extend([len(classes)] * len(found))
        classes.append(folder)
    at_root, examples = _root_images(root)
    if len(classes) < 2:
        loose = f"; {at_root} image(s) lie at its root, outside any class folder" if at_root else ""
        raise DataSourceError(
            f"{key} = {str(root)!r}: expected one sub-folder of images per class "
            f"(at least 2 classes; image suffixes {sorted(IMAGE_SUFFIXES)}, any case), found {classes}{loose}"
        )
    return FileTable(root, classes, np.frombuffer(bytes(blob), dtype=np.uint8), np.asarray(offsets, dtype=np.int64),
                     np.asarray(labels, dtype=np.int64), not_images, at_root, examples, empty)


def _root_images(root: Path) -> tuple[int, list[str]]:
    """How many image files lie at ``root`` itself (not hidden), and the first ``ROOT_EXAMPLES`` of them by name."""
    count, examples = 0, []
    for entry in os.scandir(root):
        if entry.is_file() and is_image_name(entry.name) and not entry.name.startswith("."):
            count += 1
            examples = sorted([*examples, entry.name])[:ROOT_EXAMPLES]
    return count, examples


def _images_under(folder: Path) -> tuple[list[str], int]:
    """The image files under ``folder`` (paths relative to it; hidden files and folders skipped), and the number
    of its other files."""
    found, other = [], 0
    for parent, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        rel = os.path.relpath(parent, folder)
        for name in files:
            if is_image_name(name) and not name.startswith("."):
                found.append(name if rel == "." else os.path.join(rel, name))
            else:
                other += 1
    return found, other


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
