"""Shared fixtures: the real params.yaml shrunk to tiny runs, generated dataset files, and a
2-process gloo launcher for distributed unit tests."""

from __future__ import annotations

import contextlib
import functools
import gzip
import json
import os
import pickle
import random
import re
import shutil
import socket
import sqlite3
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
import torch

from ddpipe.config.load import load_config
from ddpipe.config.schema import Config, DistributedConfig
from ddpipe.core.environment import LOG_LEVEL_ENV
from ddpipe.core.logs import configure
from ddpipe.core.processes import processes_in
from ddpipe.engine.checkpoint import list_checkpoints
from ddpipe.launch.torchrun import torchrun_command

# The suite's own process computes with one thread, as the trainings and stages it starts do
# (distributed.threads_per_process=1 in tiny_overrides and CLONE_PARAMS): make test runs a test file per core, and a
# process with more threads than its share of the cores spins in OpenMP's barriers (beside one training, the export
# tests took 10x the time and 7x the CPU with a thread per core: BENCHMARKS.md, "The test suite").
torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parents[1]
PARAMS = ROOT / "params.yaml"
FASHION_DIR = Path("/usr/share/datasets/fashion-mnist")
VENV_BIN = Path(sys.executable).parent


def dead_pid() -> int:
    """The pid of a process that has ended and been reaped: what the marker of a killed holder names."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@functools.cache
def _store_template() -> Path:
    """An empty MLflow store whose migrations ran, made once per pytest process (in a folder of its own)."""
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    folder = Path(tempfile.mkdtemp(prefix="ddpipe-store-template-"))
    SqlAlchemyStore(f"sqlite:///{folder / 'mlflow.db'}", str(folder / "mlruns")).engine.dispose()
    return folder / "mlflow.db"


def migrated_store(folder: Path) -> None:
    """``folder``/mlflow.db as a new MLflow store is once a process has opened it there, unless one is there: a copy of
    :func:`_store_template`, its Default experiment's artifacts under ``folder``/mlruns as a store opened from
    ``folder`` keeps them. A new store's first opening runs MLflow's migrations, 1.25 s against 0.5 s for a migrated
    one (BENCHMARKS.md, "The test suite"), in the first process of each test that tracks."""
    db = folder / "mlflow.db"
    if db.exists():
        return
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(_store_template(), db)
    with sqlite3.connect(db) as con:
        con.execute("UPDATE experiments SET artifact_location = ? WHERE experiment_id = 0",
                    (str(folder / "mlruns" / "0"),))
    con.close()


def tiny_overrides(tmp: Path) -> list[str]:
    """The real config, shrunk: every path under ``tmp``, tiny epochs, no progress bar; its MLflow store
    (``tmp``/mlflow.db) already migrated (:func:`migrated_store`)."""
    migrated_store(tmp)
    return [
        f"paths.raw={tmp}/raw", f"paths.prepared={tmp}/prepared", f"paths.checkpoints={tmp}/ckpt",
        f"paths.model={tmp}/model.pt", f"paths.run_info={tmp}/run.json",
        f"paths.train_metrics={tmp}/train.json", f"paths.history={tmp}/history.csv",
        f"paths.test_metrics={tmp}/test.json", f"paths.confusion={tmp}/confusion.csv",
        f"paths.per_class={tmp}/per_class.csv",
        f"paths.reports={tmp}/reports", f"paths.onnx={tmp}/model.onnx", f"paths.onnx_int8={tmp}/model.int8.onnx",
        f"paths.export_metrics={tmp}/export.json", f"paths.export_host={tmp}/export_host.json",
        "train.progress_bar=false", "num_epochs=2",
        f"mlflow.tracking_uri=sqlite:///{tmp}/mlflow.db", f"mlflow.outbox={tmp}/outbox",
        "model.width=8", "train.batch_size_per_rank=32", "train.eval_batch_size_per_rank=100",
        # tests compare trajectories (world sizes, threads, resumes) by the weights they end with
        "train.model_epoch=last",
        # no pyfunc model logged into the run (a second of every training's end): the tests of the logged model,
        # its registration and its serving set mlflow.log_model=true
        "mlflow.log_model=false",
        # one thread: the same arithmetic whatever else trains on the host (make test runs a test file per core)
        "distributed.threads_per_process=1",
        # auto by the fixed table: the same network, batch and layout on every CPU (tests/test_autotune.py measures)
        "train.auto_by=table",
    ]


# ---------------------------------------------------------------------------------------------
# What the suite costs, printed at the end of every run (docs/architecture.md, "What a test may cost")

# The whole suite's share of CI's 25 minutes on an idle two-core machine (issue 72; set-up takes the rest); a run of
# the whole suite past it says so in its last lines, so the change that made it slower is seen where it lands.
SUITE_BUDGET_S = 24 * 60
FAST_BUDGET_S = 5 * 60  # make test-fast: the tests not marked slow, the run before a commit
SLOWEST_SHOWN = 10
SUITE_TIMES_ENV = "DDPIPE_SUITE_TIMES"  # a file: every test's set-up + call + teardown seconds, as JSON, at the end
_spent: dict[str, float] = {}
_started = [0.0]


# The longest test files, measured (BENCHMARKS, "The test suite": the tests' own times summed per file), handed out
# first: with a file per worker (make test: --dist loadfile --no-loadscope-reorder), the longest first leaves the
# least for one worker alone at the end. pytest-xdist's own order (most tests first) put test_server.py, the longest
# with 10 tests, among the last. A file missing here runs after these, in the order collected.
LONGEST_FIRST = ("test_server.py", "test_cluster.py", "test_preemption.py", "test_search.py", "test_cpu_kinds.py",
                 "test_training.py",
                 "test_faults.py", "test_tracking.py", "test_sweeps.py", "test_queue.py", "test_slurm.py",
                 "test_export.py", "test_ui.py", "test_exact.py", "test_inference.py")


def pytest_sessionstart(session: pytest.Session) -> None:
    _started[0] = time.monotonic()


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list) -> None:
    """The longest files first (:data:`LONGEST_FIRST`); a file's tests keep their order (a stable sort)."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Set-up, call and teardown of each test added up (a session fixture's set-up counts for its first user)."""
    _spent[report.nodeid] = _spent.get(report.nodeid, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    wall = time.monotonic() - _started[0]
    everything = config.args_source == pytest.Config.ArgsSource.TESTPATHS and not config.option.keyword
    budget = {"not image": SUITE_BUDGET_S, "not slow and not image": FAST_BUDGET_S}.get(config.option.markexpr) \
        if everything else None
    write = terminalreporter.write_line
    terminalreporter.section("what the suite cost")
    workers = getattr(config.option, "numprocesses", None)  # pytest-xdist's -n, resolved to a count
    if workers:
        write(f"suite: {workers} worker processes; the tests' own times add up to {sum(_spent.values()) / 60:.1f} min")
    write(f"suite: {len(_spent)} tests in {wall / 60:.1f} min wall" + (
        f" (budget {budget / 60:.0f} min on an idle two-core machine)" if budget else " (a selection: no budget)"))
    if budget and wall > budget:
        write(f"suite: OVER BUDGET by {(wall - budget) / 60:.1f} min: find what this change made slower in the "
              "slowest tests below (docs/architecture.md, \"What a test may cost\")")
    if os.environ.get(SUITE_TIMES_ENV):  # every test's seconds, for a comparison of two runs (BENCHMARKS.md)
        Path(os.environ[SUITE_TIMES_ENV]).write_text(json.dumps(dict(sorted(_spent.items())), indent=0))
    write(f"slowest {SLOWEST_SHOWN} (set-up + call + teardown):")
    for nodeid, seconds in sorted(_spent.items(), key=lambda kv: -kv[1])[:SLOWEST_SHOWN]:
        write(f"  {seconds:7.1f} s  {nodeid}")


@pytest.fixture(autouse=True)
def _mlflow_uris_restored(monkeypatch: pytest.MonkeyPatch) -> None:
    """``mlflow.set_tracking_uri`` in a test exports MLFLOW_TRACKING_URI to this process, and so to the
    subprocesses of every later test (where it wins over their ``mlflow.tracking_uri``): undo it."""
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI"):
        if name in os.environ:
            monkeypatch.setenv(name, os.environ[name])
        else:  # recorded as absent, so the undo removes whatever a test set
            monkeypatch.setenv(name, "")
            monkeypatch.delenv(name)


@pytest.fixture(autouse=True)
def _ddpipe_messages(monkeypatch: pytest.MonkeyPatch) -> None:
    """ddpipe's messages on stderr from INFO up, as its commands show them (ddpipe.core.logs.configure): a test reads
    a library function's notes and warnings where a user of the command would. A command's -q or -v puts its level in
    the environment (for the processes it starts): undone after each test, which starts without one."""
    monkeypatch.setenv(LOG_LEVEL_ENV, "")
    monkeypatch.delenv(LOG_LEVEL_ENV)
    configure()


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


def prepare_generated_folder(base: Path, count: int, val_fraction: float) -> Path:
    """A generated class-per-folder set of ``count`` JPEG/PNG files of many sizes (bench/imageset.py, 3 classes),
    prepared (encoded) into base/prepared with one worker."""
    from bench.imageset import generate
    from ddpipe.config.schema import DataConfig
    from ddpipe.data.prepare import prepare

    folder = generate(base / "imgs", count, 3)
    cfg = DataConfig(dataset="imagefolder", source_dir=str(folder), val_fraction=val_fraction)
    prepare(cfg, 0, base / "raw", base / "prepared", workers=1)
    return base / "prepared"


# A network of a user's own, for a mynets.py at a repository root (model.name mynets:TinyNet, 28x28 images)
OWN_NET = """
import torch
from torch import nn


class TinyNet(nn.Module):
    def __init__(self, in_channels: int, num_classes: int, hidden: int = 8) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(in_channels, hidden, 3, padding=1), nn.BatchNorm2d(hidden), nn.ReLU(),
                                  nn.MaxPool2d(2), nn.Flatten())
        self.head = nn.Linear(hidden * 14 * 14, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))
"""


@pytest.fixture
def accept_test_checksums(monkeypatch: pytest.MonkeyPatch):
    """Make ``verify_file`` accept generated files for ``dataset`` (returns the patcher)."""
    from ddpipe.data import verify

    def accept(dataset: str, *directories: Path) -> None:
        table = dict(verify.CHECKSUMS)
        table[dataset] = {p.name: (verify.md5sum(p),) for d in directories for p in d.rglob("*") if p.is_file()}
        monkeypatch.setattr(verify, "CHECKSUMS", table)

    return accept


def prepare_mnist_like(base: Path, n_train: int, n_test: int) -> Path:
    """Generated MNIST-format data (:func:`make_mnist_like`) fetched and prepared into base/prepared, 1/8 held out
    for validation."""
    from ddpipe.config.schema import DataConfig
    from ddpipe.data import verify
    from ddpipe.data.fetching import fetch
    from ddpipe.data.prepare import prepare

    src = make_mnist_like(base / "src", n_train=n_train, n_test=n_test)
    saved = verify.CHECKSUMS["mnist"]
    verify.CHECKSUMS["mnist"] = {p.name: (verify.md5sum(p),) for p in src.iterdir()}
    try:
        cfg = DataConfig(dataset="mnist", source_dir=str(src), val_fraction=0.125)
        fetch(cfg, base / "raw")
        prepare(cfg, 0, base / "raw", base / "prepared")
    finally:
        verify.CHECKSUMS["mnist"] = saved
    return base / "prepared"


@pytest.fixture(scope="session")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Generated MNIST-format data (1,200 train images, 200 test), fetched and prepared once per session. A verdict
    on the test split that the CPU's kernels can move (INT8 against fp32, ONNX against PyTorch) needs more test
    images than 200: :data:`JUDGED_TEST_IMAGES`."""
    return prepare_mnist_like(tmp_path_factory.mktemp("data"), 1200, 200)


# Test images enough that a verdict on them rests on many images, not a few: export.max_int8_accuracy_drop's 1 point is
# 20 of them (on 200 it was two, and a 2-epoch model's near-ties moved 2 points by CPU kind)
JUDGED_TEST_IMAGES = 2000
# The generated classes are bars 2 rows apart, so the default 2-pixel random crop moves a bar onto its neighbour's rows:
# a 2-epoch model of them is one of near-ties (76-82 % on test), and its INT8 copy lost 2 points against fp32 where
# PyTorch computes in fp32 (a Cascade Lake Xeon, and this EPYC held to its kernels: tests/test_cpu_kinds.py) and gained
# 3 where it computes in bf16. Trained without the shift it answers the test images right with a margin: a model the
# export's checks can judge (their gates unchanged).
CONFIDENT_TRAINING = ("train.random_crop_padding=0",)


@pytest.fixture(scope="session")
def judged_prepared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Generated MNIST-format data with :data:`JUDGED_TEST_IMAGES` test images, for the verdicts the CPU's kernels can
    move: INT8 against fp32, ONNX against PyTorch, the served model against the evaluated one."""
    return prepare_mnist_like(tmp_path_factory.mktemp("judged"), 1200, JUDGED_TEST_IMAGES)


# the export stage where a test reads no latency: not timed (export.latency_runs=0), fewer calibration images
LIGHT_EXPORT = ("export.latency_runs=0", "export.calibration_images=64")
# ... and where it reads them: a few timed runs at a small batch
TIMED_EXPORT = ("export.latency_runs=3", "export.latency_batch_sizes=[1,8]", "export.calibration_images=64")


# For a test that reads no MLflow run: its trainings open no store and never import MLflow (BENCHMARKS.md,
# "Tracking": about 3 s less CPU of a tiny training's 7; docs/architecture.md, "What a test may cost").
UNTRACKED = "mlflow.enabled=false"


def args_for(tmp: Path, prepared: Path, *extra: str) -> list[str]:
    return [*tiny_overrides(tmp), f"paths.prepared={prepared}", "train.hflip=false", *extra]


def weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)["state_dict"]


def same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Bit-equal state dicts: the same keys, every tensor ``torch.equal``."""
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def max_rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """||a - b|| / ||a|| over all floating-point tensors of two state dicts taken together."""
    keys = [k for k, v in a.items() if v.is_floating_point()]
    num = sum(((a[k].double() - b[k].double()) ** 2).sum() for k in keys)
    den = sum((a[k].double() ** 2).sum() for k in keys)
    return float((num / den).sqrt())


# ---------------------------------------------------------------------------------------------
# Running things


def subprocess_env(extra: dict | None = None) -> dict:
    """This environment with the venv first on PATH, unbuffered Python, and ``extra`` on top."""
    return {**os.environ, "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}",
            "PYTHONUNBUFFERED": "1", **(extra or {})}


def run(cmd: list[str] | str, cwd: Path = ROOT, env: dict | None = None, timeout: int = 600,
        check: bool = True) -> subprocess.CompletedProcess:
    """Run a command with the venv first on PATH; fail with its output if ``check`` and it fails."""
    result = subprocess.run(cmd, cwd=cwd, env=subprocess_env(env), capture_output=True, text=True, timeout=timeout,
                            shell=isinstance(cmd, str))
    if check and result.returncode != 0:
        raise failed(cmd, result)
    return result


def failed(cmd: list[str] | str, result: subprocess.CompletedProcess) -> AssertionError:
    """What :func:`run` raises for a command that failed: the command, its exit code and the ends of its output."""
    return AssertionError(f"{cmd} exited {result.returncode}\nstdout:\n{result.stdout[-4000:]}\n"
                          f"stderr:\n{result.stderr[-6000:]}")


TORN_READ = "unexpected error - Expecting value: line 1 column 1 (char 0)"


def queue_status(clone: Path, env: dict | None = None, tries: int = 5) -> str:
    """`dvc queue status`'s output. Its last line asks DVC's worker through kombu's filesystem transport, whose writer
    creates a message or exchange file before it locks and fills it, and whose reader of messages takes no lock: a read
    in between finds the file empty and DVC ends with ``TORN_READ`` (in CI at 03f1e6c, after printing the task table;
    treeverse/dvc#8014 is the same race). Asked again on that error only, at most ``tries`` times."""
    cmd = ["dvc", "queue", "status"]
    for left in range(tries - 1, -1, -1):
        said = run(cmd, cwd=clone, env=env, check=False)
        if said.returncode == 0 or TORN_READ not in said.stderr or not left:
            break
        time.sleep(0.2)
    if said.returncode != 0:
        raise failed(cmd, said)
    return said.stdout


# A Python in which ddpipe cannot be imported (its editable install's path taken off sys.path: what a machine without
# ddpipe has), loading a logged model, which must bring ddpipe with it, and answering the images of a .npy file
WITHOUT_DDPIPE = """
import importlib.util, json, os, sys
sys.path[:] = [p for p in sys.path if p not in ("", ".") and os.path.realpath(p) not in sys.argv[1].split(os.pathsep)]
assert importlib.util.find_spec("ddpipe") is None, "ddpipe is still importable"
import mlflow.pyfunc, numpy as np
mlflow.set_tracking_uri(sys.argv[2])
model = mlflow.pyfunc.load_model(sys.argv[3])
answer = model.predict(np.load(sys.argv[4]))
served_by = sys.modules[type(model.unwrap_python_model()).__module__].__file__
print(json.dumps({"labels": answer["label"].tolist(), "served_by": served_by}))
"""


def predict_without_ddpipe(model_uri: str, tracking_uri: str, images: np.ndarray, workdir: Path) -> tuple[list, str]:
    """``model_uri``'s labels for ``images``, loaded in a Python where ddpipe is not importable (:data:`WITHOUT_DDPIPE`,
    from ``workdir``), and the file of the module whose class served it (the copy of ddpipe the model carries)."""
    workdir.mkdir(parents=True, exist_ok=True)
    np.save(workdir / "images.npy", images)
    where = os.pathsep.join(os.path.realpath(p) for p in (ROOT, ROOT / "src"))  # the checkout, its editable install
    said = run([sys.executable, "-c", WITHOUT_DDPIPE, where, tracking_uri, model_uri, str(workdir / "images.npy")],
               cwd=workdir, env={"MLFLOW_TRACKING_URI": ""}).stdout
    answer = json.loads(said.strip().splitlines()[-1])
    return answer["labels"], answer["served_by"]


@contextlib.contextmanager
def plain_mlflow_server(folder: Path) -> Iterator[str]:
    """A plain `mlflow server` on 127.0.0.1 (sqlite and artifacts under ``folder``), its URL once it answers; one
    process that answers, without MLflow's job runner, as deploy/tracking_server.py starts the team's: 2 processes and
    5 s of CPU to start, against MLflow's defaults' 15 and 31-35 s (BENCHMARKS.md, "Tracking")."""
    from deploy.tracking_server import NO_JOB_RUNNER

    port = free_port()
    proc = subprocess.Popen([str(VENV_BIN / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port),
                             "--backend-store-uri", f"sqlite:///{folder}/server.db", "--artifacts-destination",
                             str(folder / "server-artifacts"), "--workers", "1"],
                            cwd=folder, env=subprocess_env(NO_JOB_RUNNER), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_for_url(f"http://127.0.0.1:{port}/health", 120, proc)
        yield f"http://127.0.0.1:{port}"
    finally:
        os.killpg(proc.pid, 9)  # the whole session: the server and its uvicorn worker
        proc.wait(timeout=30)


def wait_for_url(url: str, seconds: float, proc: subprocess.Popen | None = None) -> None:
    """Until ``url`` answers (a server we started: ``proc``, whose early exit fails at once)."""
    import time
    import urllib.request

    deadline = time.time() + seconds
    while time.time() < deadline and (proc is None or proc.poll() is None):
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise AssertionError(f"{url} did not come up in {seconds} s" + (f" (exit code {proc.poll()})" if proc else ""))


FIRST_EPOCH = re.compile(r"epoch 1/\d+: .* ([\d.]+) s\n")
STOPPED = re.compile(r"stopped by (SIG\w+) at epoch (\d+), step (\d+)")


def sleep_into_second_epoch(log: Callable[[], str], running: Callable[[], bool], seconds: float = 300) -> None:
    """Wait for a training log's first epoch line, then sleep a random 10-60 % of that epoch's time: the
    moment for a stop signal to land at a random step of epoch 2 (of runs with at least 2 epochs)."""
    deadline = time.time() + seconds
    while not (first := FIRST_EPOCH.search(log())) and running() and time.time() < deadline:
        time.sleep(0.05)
    assert first and running(), f"no first epoch while the training ran:\n{log()[-3000:]}"
    time.sleep(random.uniform(0.1, 0.6) * float(first[1]))
    assert running(), f"the training ended before the signal:\n{log()[-3000:]}"


def wait_for_step_checkpoint(directory: Path, epoch: int, step: int, running: Callable[[], bool],
                             seconds: float = 300) -> None:
    """Until a checkpoint of ``step`` of ``epoch`` (counted from 1) or of a later position is in ``directory``: a
    moment inside that epoch or after it however fast its steps are (a training with ``train.checkpoint_every_steps``
    dividing ``step``), for a stop signal to land at a later step. A later one counts: with ``train.keep_checkpoints``
    the one of ``step`` may be pruned before a poll sees it, while the test ran something else. Polls every 10 ms."""
    def reached() -> bool:
        return any((pos.epoch, pos.step) >= (epoch - 1, step) for pos, _ in list_checkpoints(directory))

    deadline = time.time() + seconds
    while not reached() and running() and time.time() < deadline:
        time.sleep(0.01)
    assert reached() and running(), f"no checkpoint of epoch {epoch}, step {step} or later in {directory} while " \
        "the training ran"


def training_processes(marker: str) -> list[psutil.Process]:
    """The processes on this host whose command line names ``marker`` (a test's own directory) or a path below it, or
    that work in it or below it: a launcher, its torchrun, the workers and their loader workers (forked, the same
    command line), a DVC experiment's in its workspace (a search trial's, a queued one's). Paths compared whole
    (ddpipe.core.processes.processes_in): ``trial-1``'s are not ``trial-10``'s."""
    return processes_in(marker)


def none_left_within(marker: str, seconds: float) -> list[psutil.Process]:
    """Poll until no process of ``marker``'s training is left, at most ``seconds``; those still there."""
    deadline = time.time() + seconds
    while (left := training_processes(marker)) and time.time() < deadline:
        time.sleep(0.1)
    return left


def kill_all(marker: str) -> None:
    for p in training_processes(marker):
        try:
            p.kill()
        except psutil.Error:
            pass


def torchrun(nproc: int, *args: str, max_restarts: int = 0, shutdown_timeout_s: int = 60) -> list[str]:
    """The train stage's torchrun command (one node, ``nproc`` workers), from ddpipe.launch's builder."""
    return torchrun_command(DistributedConfig(max_restarts=max_restarts, shutdown_timeout_s=shutdown_timeout_s),
                            nproc, args)


def prune_a_two_process_trial(tmp: Path, prepared: Path, storage: str, study_name: str,
                              nodes: int = 1) -> tuple[Any, Path]:
    """A search's trial trained by 2 processes, on one node or on two nodes of this host (a c10d rendezvous on
    127.0.0.1), its study at ``storage`` (a journal file or a database URL whose password the environment holds):
    rank 0 reports epoch 1 below the median of a finished trial, and both ranks stop after it, nothing of a finished
    training left. Returns the trial as the study then holds it, and the training's directory."""
    import optuna

    from ddpipe.core.environment import TRIAL_ENV
    from ddpipe.core.trials import make_pruner, open_storage

    study = optuna.create_study(study_name=study_name, storage=open_storage(storage), direction="maximize",
                                pruner=make_pruner("median", 1))
    dist = optuna.distributions.FloatDistribution(1e-8, 1.0, log=True)
    study.add_trial(optuna.create_trial(params={"train.base_lr": 0.003}, distributions={"train.base_lr": dist},
                                        value=0.9, intermediate_values={1: 0.9, 2: 0.9, 3: 0.9}))
    trial = study.ask({"train.base_lr": dist})
    spec = {"storage": storage, "study": study_name, "trial": trial.number, "trial_id": trial._trial_id,
            "metric": "val_accuracy", "pruner": "median", "startup_trials": 1}
    out = tmp / "out"
    args = args_for(out, prepared, "num_epochs=3", "train.base_lr=1e-8", "distributed.threads_per_process=1",
                    f"mlflow.sweep={study_name}")
    if nodes == 1:
        commands = [torchrun(2, *args)]
    else:
        port = free_port()
        commands = [[sys.executable, "-m", "ddpipe.launch", *args, "distributed.nproc_per_node=1",
                     "distributed.nnodes=2", f"distributed.rdzv_endpoint=127.0.0.1:{port}",
                     "distributed.rdzv_id=pruned"]] * 2
    env = subprocess_env({TRIAL_ENV: json.dumps(spec)})
    launchers = [subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for cmd in commands]
    log = "".join(p.communicate(timeout=600)[0] for p in launchers)
    assert all(p.returncode != 0 for p in launchers), log[-4000:]
    said = f"trial {trial.number} of search '{study_name}' pruned after epoch 1 of 3"
    assert log.count(said) == 2, log[-4000:]  # each rank
    assert "epoch 2/3" not in log and not (out / "model.pt").exists()
    # epoch 1's figures as a running training's (what DVC showed while it ran), never a finished training's
    assert json.loads((out / "train.json").read_text())["train"]["running"] is True
    frozen = study.trials[trial.number]
    assert frozen.user_attrs["pruned_epoch"] == 1 and list(frozen.intermediate_values) == [1]
    return frozen, out


GIT_ENV = {"GIT_AUTHOR_NAME": "ddpipe tests", "GIT_AUTHOR_EMAIL": "tests@ddpipe.invalid",
           "GIT_COMMITTER_NAME": "ddpipe tests", "GIT_COMMITTER_EMAIL": "tests@ddpipe.invalid"}
# In a clone: commits need an identity, and runs go to the clone's own mlflow.db; DVC runs a stage's command through
# $SHELL: /bin/sh (dash, which forks the command), as where SHELL is unset (CI), on every host.
CLONE_ENV = {**GIT_ENV, "MLFLOW_TRACKING_URI": "", "SHELL": "/bin/sh"}
# threads pinned: a clone's weights are compared bit for bit, and a thread count shared with whatever
# else runs on the host (the default) changes the arithmetic
# A quick run's splits: 1,200 validation and 3,000 test images, which every pipeline of the suite evaluates on (3,000:
# the INT8 check's 1-point bound stays clear of the noise of a 2-epoch model's near-ties, over 3 standard deviations).
CLONE_PARAMS = {"data.max_train_samples": 1024, "data.val_fraction": 0.02, "data.max_test_samples": 3000,
                "model.width": 8, "num_epochs": 2, "train.batch_size_per_rank": 64, "train.progress_bar": False,
                "distributed.threads_per_process": 1, "train.auto_by": "table",  # as tiny_overrides
                # no test of a clone reads the export's latencies: none are timed (test_export times them)
                "export.latency_runs": 0, "export.calibration_images": 64,
                # nor a logged model (the trained one, the export's model_onnx): a test that does sets it back
                "mlflow.log_model": False}


def write_params(repo: Path, params: dict) -> None:
    """``params`` (dotted keys; a mapping or list replaces the key's whole value) into ``repo``'s params.yaml."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(repo / "params.yaml")
    for key, value in params.items():
        OmegaConf.update(cfg, key, value, merge=False)
    OmegaConf.save(cfg, repo / "params.yaml")


def commit_params(repo: Path, params: dict, message: str) -> None:
    """:func:`write_params`, then committed in ``repo`` (a clone) with ``message``."""
    write_params(repo, params)
    run(["git", "commit", "-qam", message], cwd=repo, env=GIT_ENV)


def clone_repo(dest: Path, params: dict | None = None) -> Path:
    """What a clone of this repo holds (tracked and unignored files) as a fresh git repo, with
    ``params`` (dotted keys) written into its params.yaml and committed."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.split()
    for f in files:
        if (ROOT / f).is_file():
            (dest / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, dest / f)
    if params:
        write_params(dest, params)
    migrated_store(dest)  # ignored by git, as a clone's own store is
    for cmd in (["git", "init", "-q"], ["git", "add", "-A"], ["git", "commit", "-qm", "clone"]):
        run(cmd, cwd=dest, env=GIT_ENV)
    return dest


def shared_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder every pytest-xdist worker of this run shares (the run's own folder when there are no workers)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session")
def reproduced_clone(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny-params clone on which `dvc repro` ran and whose dvc.lock is committed (copy it before
    changing it: see ``repro_clone``). Made once per run however many workers ask (the first, under a file lock;
    the others wait for it), since no test changes it."""
    from filelock import FileLock

    if not FASHION_DIR.is_dir():
        pytest.skip("Debian's dataset-fashion-mnist is not installed")
    folder = shared_dir(tmp_path_factory) / "reproduced"
    repo, done = folder / "repo", folder / "reproduced.done"
    with FileLock(f"{folder}.lock"):
        if not done.is_file():
            shutil.rmtree(folder, ignore_errors=True)  # a worker's that failed half-way
            clone_repo(repo, CLONE_PARAMS)
            run(["dvc", "repro"], cwd=repo, env=CLONE_ENV, timeout=900)
            run(["git", "add", "-A"], cwd=repo, env=GIT_ENV)
            run(["git", "commit", "-qm", "reproduced"], cwd=repo, env=GIT_ENV)
            done.touch()
    return repo


@pytest.fixture
def repro_clone(reproduced_clone: Path, tmp_path: Path) -> Path:
    """A private copy of ``reproduced_clone`` (DVC cache included) for one test to change."""
    dest = tmp_path / "repo"
    shutil.copytree(reproduced_clone, dest, symlinks=True)
    return dest


def _spawn_entry(rank: int, world_size: int, store: str, fn, args) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def spawn(fn, world_size: int, *args) -> None:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` gloo processes; fails if any rank fails. They meet through
    a file of their own (a FileStore), not a TCP port: a free port found here may be taken by another test's process
    before rank 0 listens on it (EADDRINUSE)."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="ddpipe-spawn-") as tmp:
        mp.spawn(_spawn_entry, args=(world_size, os.path.join(tmp, "store"), fn, args), nprocs=world_size, join=True)


def start_object_store(directory: Path) -> Path:
    """A local object store (SeaweedFS, as ``make remote`` starts it) of its own in ``directory``, on free ports (5 of
    them, and those 10000 above)."""
    from deploy.object_store import OFFSETS, _port_free, start

    for _ in range(50):
        port = free_port()
        if port < 55000 and all(_port_free(p) and _port_free(p + 10000) for p in range(port, port + len(OFFSETS) + 1)):
            break
    start(directory, port, "ddpipe")
    return directory


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A local object store of the test module's own (:func:`start_object_store`), stopped after its tests."""
    from deploy.object_store import stop

    directory = start_object_store(tmp_path_factory.mktemp("store"))
    yield directory
    stop(directory)


def object_store_env(directory: Path, port: int | None = None) -> dict[str, str]:
    """The environment a training reads its store from: the endpoint (that of ``port`` if given: a proxy) and keys."""
    from deploy.object_store import credentials, state

    keys, endpoint = credentials(directory), state(directory)["endpoint"]
    if port is not None:
        endpoint = f"http://127.0.0.1:{port}"
    return {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": keys["access_key_id"],
            "AWS_SECRET_ACCESS_KEY": keys["secret_access_key"]}


# ---------------------------------------------------------------------------------------------
# podman, as the Makefile's image targets run it

CONTAINERS_CONF = ROOT / "deploy" / "podman" / "containers.conf"


def podman(*args: str, check: bool = True, timeout: float = 1800) -> subprocess.CompletedProcess:
    """``podman ARGS`` with deploy/podman/containers.conf; fails with its output if ``check`` and it fails."""
    env = {**os.environ, "CONTAINERS_CONF": str(CONTAINERS_CONF)}
    out = subprocess.run(["podman", *args], capture_output=True, text=True, env=env, timeout=timeout)
    if check and out.returncode != 0:
        raise AssertionError(f"podman {' '.join(args[:3])} exited {out.returncode}:\n{out.stdout[-3000:]}"
                             f"\n{out.stderr[-3000:]}")
    return out


def podman_unavailable(*tools: str) -> str | None:
    """Why podman cannot build and run images here (None: it can): not root, podman, runc or ``tools`` missing, or
    ``podman info`` failing."""
    if os.geteuid() != 0:
        return "podman here runs as root (rootless needs subuids this host does not give)"
    missing = [tool for tool in ("podman", "runc", *tools) if not shutil.which(tool)]
    if missing:
        return f"{', '.join(missing)} not installed (as root: {'make image-deps' if tools else 'make system-deps'})"
    info = podman("info", check=False, timeout=120)
    return f"podman cannot run here: {info.stderr.strip()[-500:]}" if info.returncode != 0 else None
