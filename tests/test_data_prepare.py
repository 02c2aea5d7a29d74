"""The prepare stage and the store it writes: raw and encoded splits, memory-mapped, atomic, the same bytes
on any number of cores; undecodable images; the class subset; the data stages on the real Fashion-MNIST."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from bench.imageset import generate
from ddpipe.config.schema import ConfigError, DataConfig
from ddpipe.data.fetching import fetch
from ddpipe.data.prepare import prepare
from ddpipe.data.store import EncodedSplit, PreparedDataError, RawSplit, load_meta, open_split
from ddpipe.data.verify import DataSourceError
from tests.conftest import FASHION_DIR, ROOT, clone_repo, make_imagefolder, make_mnist_like, run, subprocess_env


def _folder(tmp_path: Path, images: int = 60, classes: int = 3) -> DataConfig:
    src = generate(tmp_path / "imgs", images, classes)
    return DataConfig(dataset="imagefolder", source_dir=str(src), val_fraction=0.2, test_fraction=0.2)


def test_prepare_writes_memory_mappable_raw_splits(tmp_path: Path, accept_test_checksums) -> None:
    src = make_mnist_like(tmp_path / "src", n_train=200, n_test=50)
    accept_test_checksums("mnist", src)
    cfg = DataConfig(dataset="mnist", source_dir=str(src), val_fraction=0.25, max_train_samples=100)
    fetch(cfg, tmp_path / "raw")
    meta = prepare(cfg, 0, tmp_path / "raw", tmp_path / "prepared")
    assert meta.sizes == {"train": 100, "val": 50, "test": 50} and meta.encoding == "raw"
    assert meta.image_size == [28, 28] and meta.num_channels == 1
    for split, n in meta.sizes.items():
        stored = open_split(tmp_path / "prepared", split)
        assert isinstance(stored, RawSplit) and isinstance(stored.images, np.memmap)
        assert stored.images.shape == (n, 1, 28, 28) and stored.images.dtype == np.uint8
        assert stored.labels.dtype == np.int64 and len(stored.labels) == n
    train = np.asarray(open_split(tmp_path / "prepared", "train").images, dtype=np.float64) / 255
    assert meta.mean[0] == pytest.approx(train.mean(), rel=1e-12)
    assert meta.std[0] == pytest.approx(train.std(), rel=1e-9)
    assert load_meta(tmp_path / "prepared") == meta
    assert not list(tmp_path.glob(".prepared*"))  # no temp leftovers


def test_a_folder_of_varied_images_is_stored_encoded_as_it_comes(tmp_path: Path) -> None:
    cfg = _folder(tmp_path)
    meta = prepare(cfg, 0, tmp_path / "raw", tmp_path / "prepared", workers=2)
    assert meta.encoding == "encoded" and meta.num_channels == 3 and meta.image_size is None
    assert meta.classes == ["class_00", "class_01", "class_02"] and sum(meta.sizes.values()) == 60
    assert meta.source["not_images"] == 2 and meta.source["skipped_undecodable"] == []
    files = sorted(p.name for p in (tmp_path / "prepared").iterdir())
    assert files == ["meta.json"] + [f"{s}{x}" for s in ("test", "train", "val")
                                     for x in ("-00000.bin", ".index.npy", ".labels.npy")]
    train = open_split(tmp_path / "prepared", "train")
    assert isinstance(train, EncodedSplit)
    sizes = {train.size(i) for i in range(len(train))}
    assert len(sizes) > 10 and all(160 <= min(s) and max(s) <= 500 for s in sizes)  # each image its own size
    for i in range(len(train)):
        h, w = train.size(i)
        assert Image.open(io.BytesIO(train.blob(i).tobytes())).size == (w, h)


def test_same_size_small_images_are_stored_raw_unless_told(tmp_path: Path) -> None:
    src = make_imagefolder(tmp_path / "imgs", per_class=10, size=20)
    cfg = DataConfig(dataset="imagefolder", source_dir=str(src), val_fraction=0.2, test_fraction=0.2)
    assert prepare(cfg, 0, tmp_path / "raw", tmp_path / "a", workers=1).encoding == "raw"
    raw = open_split(tmp_path / "a", "train")
    first = np.asarray(Image.open(sorted((src / "cat").iterdir())[0]).convert("RGB")).transpose(2, 0, 1)
    assert np.array_equal(raw.images[0], first)  # train keeps source order: cat/0.png is not held out here
    forced = DataConfig(**{**cfg.__dict__, "encoding": "encoded"})
    assert prepare(forced, 0, tmp_path / "raw", tmp_path / "b", workers=1).encoding == "encoded"
    varied = _folder(tmp_path / "v")
    with pytest.raises(ConfigError, match="data.encoding = 'raw' is not accepted for .*: raw pixels need one size"):
        prepare(DataConfig(**{**varied.__dict__, "encoding": "raw"}), 0, tmp_path / "raw", tmp_path / "c")
    assert not (tmp_path / "c").exists()


def test_the_stored_bytes_do_not_depend_on_the_number_of_workers(tmp_path: Path) -> None:
    cfg = _folder(tmp_path, images=80)
    prepare(cfg, 3, tmp_path / "raw", tmp_path / "one", workers=1)
    prepare(cfg, 3, tmp_path / "raw", tmp_path / "two", workers=2)
    for p in (tmp_path / "one").iterdir():
        assert p.read_bytes() == (tmp_path / "two" / p.name).read_bytes(), p.name


def test_an_undecodable_image_fails_prepare_naming_it_or_is_skipped_and_listed(tmp_path: Path) -> None:
    cfg = _folder(tmp_path)
    prepare(cfg, 0, tmp_path / "raw", tmp_path / "prepared")
    before = {p.name: p.read_bytes() for p in (tmp_path / "prepared").iterdir()}
    good = sorted((Path(cfg.source_dir) / "class_01").glob("*.jpg"))[0]
    bad = good.with_name("broken.jpg")
    bad.write_bytes(good.read_bytes()[:300])
    with pytest.raises(DataSourceError, match=f"{bad}: cannot be decoded as an image: truncated: the JPEG data ends "
                                             "before the image does .* Nothing was written"):
        prepare(cfg, 0, tmp_path / "raw", tmp_path / "prepared")
    assert {p.name: p.read_bytes() for p in (tmp_path / "prepared").iterdir()} == before
    meta = prepare(DataConfig(**{**cfg.__dict__, "skip_bad_images": True}), 0, tmp_path / "raw",
                   tmp_path / "prepared")
    assert sum(meta.sizes.values()) == 60 and meta.source["images"] == 61
    assert len(meta.source["skipped_undecodable"]) == 1 and str(bad) in meta.source["skipped_undecodable"][0]


def test_every_file_left_out_of_a_folder_is_said_once_in_words(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """An image at the folder's root, a class folder without images, a zero-byte .jpg and a text file named .png:
    prepare says each once, in words, naming the file or folder."""
    cfg = _folder(tmp_path)
    src = Path(cfg.source_dir)
    good = sorted((src / "class_01").glob("*.jpg"))[0]
    (src / "loose.jpg").write_bytes(good.read_bytes())
    (src / "class_03").mkdir()
    (src / "class_01" / "zero.jpg").write_bytes(b"")
    (src / "class_02" / "labels.png").write_text("class_02: 20 images\n")
    meta = prepare(DataConfig(**{**cfg.__dict__, "skip_bad_images": True}), 0, tmp_path / "raw",
                   tmp_path / "prepared", workers=2)
    err = capsys.readouterr().err
    said = {
        f"1 image file(s) at the root of {src}, not in a class folder, are left out (loose.jpg)": 1,
        f"1 folder(s) of {src} hold no image and make no class: class_03/ (empty)": 1,
        f"{src / 'class_01' / 'zero.jpg'}: cannot be decoded as an image: the file is empty (0 bytes)": 1,
        f"{src / 'class_02' / 'labels.png'}: cannot be decoded as an image: not an image but text": 1,
    }
    assert {words: err.count(words) for words in said} == said
    warned = [line for line in err.splitlines() if any(words in line for words in said)]  # among its progress lines
    assert len(warned) == len(said) and all(line.startswith("prepare: warning: ") for line in warned), err
    assert meta.classes == ["class_00", "class_01", "class_02"] and sum(meta.sizes.values()) == 60
    assert (meta.source["root_images"], meta.source["empty_folders"]) == (1, ["class_03"])


def test_a_class_subset_is_prepared_and_recorded(tmp_path: Path, accept_test_checksums) -> None:
    src = make_mnist_like(tmp_path / "src", n_train=200, n_test=50)
    accept_test_checksums("mnist", src)
    cfg = DataConfig(dataset="mnist", source_dir=str(src), classes=["7", "2"])
    fetch(cfg, tmp_path / "raw")
    meta = prepare(cfg, 0, tmp_path / "raw", tmp_path / "prepared")
    assert meta.classes == ["7", "2"] and sum(meta.sizes.values()) == 50
    assert set(open_split(tmp_path / "prepared", "train").labels.tolist()) == {0, 1}
    folder = _folder(tmp_path / "f")
    meta = prepare(DataConfig(**{**folder.__dict__, "classes": 2}), 0, tmp_path / "raw", tmp_path / "p2")
    assert meta.classes == ["class_00", "class_01"] and sum(meta.sizes.values()) == 40


def test_a_damaged_store_is_named_with_the_remedy(tmp_path: Path) -> None:
    cfg = _folder(tmp_path)
    prepare(cfg, 0, tmp_path / "raw", tmp_path / "prepared")
    shard = tmp_path / "prepared" / "val-00000.bin"
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(PreparedDataError, match=f"{shard}: missing or shorter than its index says; run the prepare"):
        open_split(tmp_path / "prepared", "val")
    meta = json.loads((tmp_path / "prepared" / "meta.json").read_text())
    del meta["encoding"]
    (tmp_path / "prepared" / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(PreparedDataError, match="not this version's prepared data"):
        load_meta(tmp_path / "prepared")


@pytest.mark.slow
def test_a_killed_prepare_leaves_the_previous_output_whole(tmp_path: Path) -> None:
    src = generate(tmp_path / "imgs", 600, 3)
    args = ["python", "stages/prepare.py", "data.dataset=imagefolder", f"data.source_dir={src}",
            f"paths.prepared={tmp_path}/prepared"]
    run(args + ["data.classes=2"])
    before = {p.name: p.read_bytes() for p in (tmp_path / "prepared").iterdir()}
    proc = subprocess.Popen(args, cwd=ROOT, env=subprocess_env(), stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    assert proc.stderr is not None
    for line in proc.stderr:  # its messages: into the second pass, files being written
        if line.startswith("prepare: train: "):
            break
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    time.sleep(0.5)
    assert {p.name: p.read_bytes() for p in (tmp_path / "prepared").iterdir()} == before


@pytest.mark.slow
@pytest.mark.skipif(not FASHION_DIR.is_dir(), reason="Debian's dataset-fashion-mnist is not installed")
def test_data_stages_on_real_fashion_mnist_via_dvc(tmp_path: Path) -> None:
    """`dvc repro prepare` in a fresh clone (no DVC cache): 60,000 + 10,000 images, then a no-op."""
    repo = clone_repo(tmp_path / "repo")
    first = run(["dvc", "repro", "prepare"], cwd=repo, timeout=600)
    assert "Running stage 'prepare'" in first.stdout
    meta = json.loads((repo / "data" / "prepared" / "meta.json").read_text())
    assert meta["sizes"]["train"] + meta["sizes"]["val"] == 60000 and meta["sizes"]["test"] == 10000
    assert meta["classes"][0] == "T-shirt/top" and meta["image_size"] == [28, 28] and meta["encoding"] == "raw"
    second = run(["dvc", "repro", "prepare"], cwd=repo)
    assert "Running stage" not in second.stdout and "didn't change" in second.stdout
