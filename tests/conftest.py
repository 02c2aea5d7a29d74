"""Shared fixtures: the real params.yaml shrunk to tiny runs, generated dataset files, and a
2-process gloo launcher for distributed unit tests."""

from __future__ import annotations

import gzip
import os
import pickle
import socket
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ddpipe.config import Config, load_config

ROOT = Path(__file__).resolve().parents[1]
PARAMS = ROOT / "params.yaml"
FASHION_DIR = Path("/usr/share/datasets/fashion-mnist")
VENV_BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny_overrides(tmp: Path) -> list[str]:
    """The real config, shrunk: every path under ``tmp``, tiny epochs, no progress bar."""
    return [
        f"paths.raw={tmp}/raw", f"paths.prepared={tmp}/prepared", f"paths.checkpoints={tmp}/ckpt",
        f"paths.model={tmp}/model.pt", f"paths.run_info={tmp}/run.json",
        f"paths.train_metrics={tmp}/train.json", f"paths.history={tmp}/history.csv",
        f"paths.test_metrics={tmp}/test.json", f"paths.confusion={tmp}/confusion.csv",
        f"paths.reports={tmp}/reports", "train.progress_bar=false", "num_epochs=2",
        f"mlflow.tracking_uri=sqlite:///{tmp}/mlflow.db",
        "model.width=8", "train.batch_size_per_rank=32", "train.eval_batch_size_per_rank=100",
    ]


@pytest.fixture
def tiny_cfg(tmp_path: Path):
    """``tiny_cfg(*extra)``: the real params.yaml + tiny overrides + ``extra``."""

    def make(*extra: str) -> Config:
        return load_config(tiny_overrides(tmp_path) + list(extra), params_file=PARAMS)

    return make


# ---------------------------------------------------------------------------------------------
# Generated dataset files


def write_idx(path: Path, array: np.ndarray) -> None:
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(struct.pack(">I", d) for d in array.shape)
    with gzip.open(path, "wb") as f:
        f.write(header + array.astype(np.uint8).tobytes())


def make_mnist_like(directory: Path, n_train: int = 200, n_test: int = 50, seed: int = 0) -> Path:
    """The four *-ubyte.gz files of an MNIST-format dataset with learnable class patterns."""
    rng = np.random.default_rng(seed)
    directory.mkdir(parents=True, exist_ok=True)
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        labels = np.arange(n) % 10
        rng.shuffle(labels)
        images = rng.integers(0, 60, size=(n, 28, 28))
        for i, y in enumerate(labels):  # class y: a bright bar at row band y
            images[i, 2 * y + 4: 2 * y + 7, 4:24] = 220
        write_idx(directory / f"{prefix}-images-idx3-ubyte.gz", images)
        write_idx(directory / f"{prefix}-labels-idx1-ubyte.gz", labels)
    return directory


def make_cifar_like(directory: Path, per_batch: int = 20, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    folder = directory / "cifar-10-batches-py"
    folder.mkdir(parents=True, exist_ok=True)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {"data": rng.integers(0, 256, size=(per_batch, 3072), dtype=np.uint8),
                 "labels": [int(v) for v in np.arange(per_batch) % 10]}
        (folder / name).write_bytes(pickle.dumps(batch))
    meta = {"label_names": ["airplane", "automobile", "bird", "cat", "deer",
                            "dog", "frog", "horse", "ship", "truck"]}
    (folder / "batches.meta").write_bytes(pickle.dumps(meta))
    return directory


def make_imagefolder(directory: Path, classes: tuple[str, ...] = ("cat", "dog", "fox"), per_class: int = 10,
                     mode: str = "RGB", size: int = 20) -> Path:
    from PIL import Image

    rng = np.random.default_rng(0)
    for c in classes:
        (directory / c).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            shape = (size, size, 3) if mode == "RGB" else (size, size)
            Image.fromarray(rng.integers(0, 256, size=shape, dtype=np.uint8), mode=mode).save(
                directory / c / f"{i}.png")
    return directory


@pytest.fixture
def accept_test_checksums(monkeypatch: pytest.MonkeyPatch):
    """Make ``verify_file`` accept generated files for ``dataset`` (returns the patcher)."""
    from ddpipe import sources

    def accept(dataset: str, *directories: Path) -> None:
        table = dict(sources.CHECKSUMS)
        table[dataset] = {p.name: (sources.md5sum(p),) for d in directories for p in d.rglob("*") if p.is_file()}
        monkeypatch.setattr(sources, "CHECKSUMS", table)

    return accept


# ---------------------------------------------------------------------------------------------
# Running things


def run(cmd: list[str] | str, cwd: Path = ROOT, env: dict | None = None, timeout: int = 600,
        check: bool = True) -> subprocess.CompletedProcess:
    """Run a command with the venv first on PATH; fail with its output if ``check`` and it fails."""
    full_env = {**os.environ, "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}",
                "PYTHONUNBUFFERED": "1", **(env or {})}
    result = subprocess.run(cmd, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout,
                            shell=isinstance(cmd, str))
    if check and result.returncode != 0:
        raise AssertionError(f"{cmd} exited {result.returncode}\nstdout:\n{result.stdout[-4000:]}\n"
                             f"stderr:\n{result.stderr[-6000:]}")
    return result


def torchrun(nproc: int, *args: str, extra: tuple[str, ...] = ()) -> list[str]:
    return [str(VENV_BIN / "torchrun"), "--standalone", f"--nproc-per-node={nproc}", *extra,
            str(ROOT / "stages" / "train.py"), *args]


def _spawn_entry(rank: int, world_size: int, port: int, fn, args) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def spawn(fn, world_size: int, *args) -> None:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` gloo processes; fails if any rank fails."""
    import torch.multiprocessing as mp

    mp.spawn(_spawn_entry, args=(world_size, free_port(), fn, args), nprocs=world_size, join=True)
