"""How a dataset's files are verified: the official files' names and published MD5s, and the check every
file passes before it is used; the error raised on the way from a dataset's files to its arrays
(``DataSourceError``).
"""

from __future__ import annotations

import gzip
import hashlib
from pathlib import Path

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


class DataSourceError(RuntimeError):
    """The dataset's files are missing, corrupt, or cannot be parsed."""


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


def required_files(dataset: str) -> list[str]:
    if dataset == "cifar10":
        return [n for n in CHECKSUMS["cifar10"] if n != CIFAR_ARCHIVE]
    return list(CHECKSUMS[dataset])
