"""Dataset files: parsing each format from generated files, checksum verification, the order of
sources, and torchvision's download path exercised against a local HTTP server."""

from __future__ import annotations

import functools
import gzip
import http.server
import json
import pickle
import threading
from pathlib import Path

import numpy as np
import pytest

from ddpipe.config.schema import DataConfig
from ddpipe.data import fetching, verify
from ddpipe.data.fetching import fetch
from ddpipe.data.folders import list_imagefolder
from ddpipe.data.formats import read_arrays, read_cifar10, read_idx
from ddpipe.data.verify import DataSourceError, verify_file
from tests.conftest import FASHION_DIR, make_cifar_like, make_imagefolder, make_mnist_like, run, write_idx


def test_idx_roundtrip(tmp_path: Path) -> None:
    a = np.random.default_rng(0).integers(0, 256, size=(7, 28, 28))
    write_idx(tmp_path / "x.gz", a)
    np.testing.assert_array_equal(read_idx(tmp_path / "x.gz"), a)


def test_idx_truncated_or_bad_magic_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "train-images-idx3-ubyte.gz"
    write_idx(path, np.zeros((5, 28, 28)))
    data = gzip.decompress(path.read_bytes())
    path.write_bytes(gzip.compress(data[:-100]))
    with pytest.raises(DataSourceError, match=f"{path}: truncated"):
        read_idx(path)
    path.write_bytes(gzip.compress(b"\x01\x02\x03\x04" + data[4:]))
    with pytest.raises(DataSourceError, match="bad magic"):
        read_idx(path)


def test_mnist_format_parses(tmp_path: Path) -> None:
    make_mnist_like(tmp_path, n_train=30, n_test=10)
    raw = read_arrays(DataConfig(dataset="mnist"), tmp_path)
    assert raw.train_images.shape == (30, 1, 28, 28) and raw.train_images.dtype == np.uint8
    assert raw.test_labels.shape == (10,) and raw.test_labels.dtype == np.int64
    assert raw.classes == [str(i) for i in range(10)]


def test_cifar10_format_parses(tmp_path: Path) -> None:
    make_cifar_like(tmp_path, per_batch=20)
    raw = read_cifar10(tmp_path / "cifar-10-batches-py")
    assert raw.train_images.shape == (100, 3, 32, 32) and raw.test_images.shape == (20, 3, 32, 32)
    assert raw.classes[0] == "airplane" and raw.train_labels.dtype == np.int64


def test_cifar_pickle_with_code_is_refused(tmp_path: Path) -> None:
    make_cifar_like(tmp_path, per_batch=10)
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (Path.touch, (marker,))

    (tmp_path / "cifar-10-batches-py" / "test_batch").write_bytes(pickle.dumps({"data": Payload()}))
    with pytest.raises(DataSourceError, match="test_batch"):
        read_cifar10(tmp_path / "cifar-10-batches-py")
    assert not marker.exists()


def test_imagefolder_is_listed_in_class_then_path_order_without_other_files(tmp_path: Path) -> None:
    make_imagefolder(tmp_path, per_class=3, size=20)
    (tmp_path / "dog" / "extra").mkdir()
    (tmp_path / "dog" / "A.PNG").write_bytes((tmp_path / "dog" / "0.png").read_bytes())
    (tmp_path / "dog" / "extra" / "b.JPeG").write_bytes(b"not checked here")
    (tmp_path / "cat" / "notes.txt").write_text("x")
    (tmp_path / "cat" / ".DS_Store").write_bytes(b"x")
    (tmp_path / "empty").mkdir()
    table = list_imagefolder(tmp_path)
    assert table.classes == ["cat", "dog", "fox"] and table.not_images == 2
    assert [Path(table.path(i)).relative_to(tmp_path).as_posix() for i in range(len(table))] == [
        "cat/0.png", "cat/1.png", "cat/2.png", "dog/0.png", "dog/1.png", "dog/2.png", "dog/A.PNG",
        "dog/extra/b.JPeG", "fox/0.png", "fox/1.png", "fox/2.png"]
    assert table.labels.tolist() == [0, 0, 0, 1, 1, 1, 1, 1, 2, 2, 2]


def test_images_at_the_root_and_folders_without_images_are_counted_and_said(tmp_path: Path) -> None:
    """Left out of the classes, as before, but no longer without a word: how many, which, where."""
    make_imagefolder(tmp_path, per_class=2)
    for name in ("z.png", "a.JPG", "m.png", "b.png"):
        (tmp_path / name).write_bytes((tmp_path / "cat" / "0.png").read_bytes())
    (tmp_path / "README.txt").write_text("not an image, not a class")
    (tmp_path / "empty").mkdir()
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "labels.csv").write_text("x")
    table = list_imagefolder(tmp_path)
    assert table.classes == ["cat", "dog", "fox"] and len(table) == 6
    assert (table.root_images, table.root_examples, table.empty_folders) == (4, ["a.JPG", "b.png", "m.png"],
                                                                             [("empty", 0), ("notes", 1)])
    assert table.left_out() == [
        f"4 image file(s) at the root of {tmp_path}, not in a class folder, are left out (a.JPG, b.png, m.png, ...); "
        "each class is a sub-folder: move them into theirs",
        f"2 folder(s) of {tmp_path} hold no image and make no class: empty/ (empty), notes/ (1 other file(s))"]
    (tmp_path / "images").mkdir()
    for name in ("cat", "dog", "fox", "empty", "notes"):
        (tmp_path / name).rename(tmp_path / "images" / name)
    assert list_imagefolder(tmp_path / "images").left_out() == [
        f"2 folder(s) of {tmp_path / 'images'} hold no image and make no class: empty/ (empty), "
        "notes/ (1 other file(s))"]
    with pytest.raises(DataSourceError, match=r"found \['images'\]; 4 image\(s\) lie at its root"):
        list_imagefolder(tmp_path)


def test_fetch_of_a_folder_checks_it_and_copies_nothing(tmp_path: Path) -> None:
    src = make_imagefolder(tmp_path / "imgs", per_class=4)
    origin = fetch(DataConfig(dataset="imagefolder", source_dir=str(src)), tmp_path / "raw")
    assert "12 images in 3 classes" in origin
    assert [p.name for p in (tmp_path / "raw").iterdir()] == ["source.json"]
    assert json.loads((tmp_path / "raw" / "source.json").read_text())["classes"] == {"cat": 4, "dog": 4, "fox": 4}


def test_imagefolder_needs_class_folders(tmp_path: Path) -> None:
    with pytest.raises(DataSourceError, match="data.source_dir = 'data/source': expected one sub-folder"):
        fetch(DataConfig(dataset="imagefolder"), tmp_path / "out")  # the default: the repository's data/source
    with pytest.raises(DataSourceError, match="data.source_dir = '.*nowhere': not a directory"):
        fetch(DataConfig(dataset="imagefolder", source_dir=str(tmp_path / "nowhere")), tmp_path / "out")
    (tmp_path / "flat").mkdir()
    with pytest.raises(DataSourceError, match="one sub-folder of images per class"):
        fetch(DataConfig(dataset="imagefolder", source_dir=str(tmp_path / "flat")), tmp_path / "out")
    assert not (tmp_path / "out").exists()


REMEDY = "run the fetch stage first: `dvc repro fetch` or `python stages/fetch.py`"


@pytest.mark.parametrize("dataset", ["fashion_mnist", "cifar10"])
def test_reading_before_fetch_names_paths_raw_and_the_remedy(tmp_path: Path, dataset: str) -> None:
    """On a fresh clone the fetch stage's output does not exist yet: name the key, the directory and
    what to run (not data.source_dir, which only the fetch stage reads)."""
    missing = tmp_path / "raw"
    with pytest.raises(DataSourceError) as err:
        read_arrays(DataConfig(dataset=dataset), missing)
    assert str(err.value) == f"paths.raw = {str(missing)!r}: not a directory (the fetch stage's output); {REMEDY}"


def test_a_file_missing_from_the_fetch_output_is_named_with_the_remedy(tmp_path: Path) -> None:
    make_mnist_like(tmp_path, n_train=30, n_test=10)
    (tmp_path / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(DataSourceError) as err:
        read_arrays(DataConfig(dataset="mnist"), tmp_path)
    assert str(err.value) == f"{tmp_path / 't10k-labels-idx1-ubyte.gz'}: missing; {REMEDY}"


def test_prepare_stage_before_fetch_says_what_to_run(tmp_path: Path) -> None:
    result = run(["python", "stages/prepare.py", f"paths.raw={tmp_path}/raw", f"paths.prepared={tmp_path}/prepared"],
                 check=False, timeout=120)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert f"paths.raw = '{tmp_path}/raw': not a directory" in result.stderr and REMEDY in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_checksum_mismatch_names_the_file(tmp_path: Path) -> None:
    make_mnist_like(tmp_path / "src")
    with pytest.raises(DataSourceError) as err:
        fetch(DataConfig(dataset="mnist", source_dir=str(tmp_path / "src")), tmp_path / "out")
    assert "train-images-idx3-ubyte.gz: checksum mismatch" in str(err.value)
    assert not (tmp_path / "out").exists()  # nothing half-written


def test_source_dir_is_searched_first_then_the_next_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          accept_test_checksums) -> None:
    """data.source_dir (a dependency, so always a real directory) is looked in first: holding none of the
    files it is passed over, holding some of them is an error naming what is missing."""
    debian = make_mnist_like(tmp_path / "debian")
    accept_test_checksums("mnist", debian)
    monkeypatch.setattr(fetching, "DEBIAN_DIRS", {"mnist": str(debian)})
    (tmp_path / "empty").mkdir()
    origin = fetch(DataConfig(dataset="mnist", source_dir=str(tmp_path / "empty")), tmp_path / "out")
    assert origin.startswith("Debian's dataset-mnist package")
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "train-images-idx3-ubyte.gz").write_bytes((debian / "train-images-idx3-ubyte.gz").read_bytes())
    with pytest.raises(DataSourceError, match="holds part of the mnist files; expected all of"):
        fetch(DataConfig(dataset="mnist", source_dir=str(partial)), tmp_path / "out2")


def test_fetch_from_source_dir_copies_verified_files(tmp_path: Path, accept_test_checksums) -> None:
    src = make_mnist_like(tmp_path / "src")
    accept_test_checksums("mnist", src)
    out = tmp_path / "out"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    origin = fetch(DataConfig(dataset="mnist", source_dir=str(src)), out)
    assert "data.source_dir" in origin
    assert sorted(p.name for p in out.iterdir()) == sorted(verify.required_files("mnist"))


def test_fetch_cifar_from_archive(tmp_path: Path, accept_test_checksums) -> None:
    import tarfile

    make_cifar_like(tmp_path / "gen")
    src = tmp_path / "src"
    src.mkdir()
    with tarfile.open(src / "cifar-10-python.tar.gz", "w:gz") as tar:
        tar.add(tmp_path / "gen" / "cifar-10-batches-py", arcname="cifar-10-batches-py")
    accept_test_checksums("cifar10", tmp_path / "gen" / "cifar-10-batches-py", src)
    fetch(DataConfig(dataset="cifar10", source_dir=str(src)), tmp_path / "out")
    assert read_cifar10(tmp_path / "out").train_images.shape == (100, 3, 32, 32)


def test_offline_without_a_copy_lists_three_ways(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fetching, "DEBIAN_DIRS", {"mnist": str(tmp_path / "no-debian")})
    with pytest.raises(DataSourceError) as err:
        fetch(DataConfig(dataset="mnist", download=False), tmp_path / "out")
    message = str(err.value)
    assert "1. set data.source_dir" in message and "2. install Debian's package" in message
    assert "3. allow the download" in message


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def local_server(tmp_path: Path):
    served = tmp_path / "served"
    served.mkdir()
    handler = functools.partial(_QuietHandler, directory=str(served))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield served, f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()


def test_download_path_with_local_mirror(tmp_path: Path, local_server, accept_test_checksums,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    served, url = local_server
    make_mnist_like(served)
    accept_test_checksums("mnist", served)
    monkeypatch.setattr(fetching, "DEBIAN_DIRS", {})
    origin = fetch(DataConfig(dataset="mnist"), tmp_path / "out", download_urls={"mnist": [url]})
    assert origin == "torchvision's download"
    assert read_arrays(DataConfig(dataset="mnist"), tmp_path / "out").train_images.shape[0] == 200


def test_download_failure_is_reported_with_the_ways(tmp_path: Path, local_server,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    _, url = local_server  # serves nothing: 404 for every file
    monkeypatch.setattr(fetching, "DEBIAN_DIRS", {})
    with pytest.raises(DataSourceError, match="download failed"):
        fetch(DataConfig(dataset="fashion_mnist"), tmp_path / "out", download_urls={"fashion_mnist": [url]})


@pytest.mark.skipif(not FASHION_DIR.is_dir(), reason="Debian's dataset-fashion-mnist is not installed")
def test_debian_fashion_mnist_files_verify() -> None:
    for name in verify.required_files("fashion_mnist"):
        verify_file(FASHION_DIR / name, "fashion_mnist")
