"""Where a dataset's files come from: the fetch stage puts them in ``paths.raw``.

The official datasets (``fetch``): the first of ``data.source_dir`` (when it holds their files), the
directory Debian's ``dataset-<name>`` package installs, torchvision's download, copied into
``paths.raw``. Every file is checked against its published MD5 (:mod:`ddpipe.data.verify`) before it is used.

A folder of one's own (``imagefolder``): one sub-folder of images per class, read where it lies
(``data.source_dir``). The fetch stage only checks it and writes what it found (``source.json``) into
``paths.raw``; the prepare stage lists it again (:func:`ddpipe.data.folders.list_imagefolder`) and reads the
images.
"""

from __future__ import annotations

import shutil
import tarfile
import tempfile
from pathlib import Path

import numpy as np

from ddpipe.config.schema import DataConfig
from ddpipe.core.files import atomic_dir, atomic_write_json
from ddpipe.data.folders import list_imagefolder
from ddpipe.data.verify import CIFAR_ARCHIVE, CIFAR_FOLDER, DataSourceError, required_files, verify_file

DEBIAN_DIRS = {"fashion_mnist": "/usr/share/datasets/fashion-mnist", "mnist": "/usr/share/datasets/mnist"}


# ---------------------------------------------------------------------------------------------
# Fetch: put verified files into the fetch stage's output directory


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
