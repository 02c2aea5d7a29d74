"""The train stage end to end on tiny data: world-size invariance, exact resume after a SIGKILL,
checkpoint safety, exact validation, and two trainings at once."""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from ddpipe import checkpoint as ckpt
from ddpipe.data import BatchTransform, InMemoryDataset
from ddpipe.distributed import DistInfo
from ddpipe.models import load_model
from ddpipe.training import evaluate_split
from tests.conftest import ROOT, args_for, max_rel_diff, run, spawn, subprocess_env, torchrun, weights


@pytest.mark.slow
def test_plain_process_trains_and_writes_every_output(tmp_path: Path, prepared: Path) -> None:
    run(["python", "stages/train.py", *args_for(tmp_path, prepared)])
    model, payload = load_model(tmp_path / "model.pt")
    assert payload["classes"] == [str(i) for i in range(10)]
    metrics = json.loads((tmp_path / "train.json").read_text())["train"]
    assert metrics["epochs"] == 2 and metrics["val_accuracy"] > 0.5  # the bars are easy to learn
    history = (tmp_path / "history.csv").read_text().splitlines()
    assert history[0].startswith("epoch,train_loss") and len(history) == 3
    assert [p.name for p in (tmp_path / "ckpt").iterdir()] and not list((tmp_path / "ckpt").glob(".*"))


@pytest.mark.slow
def test_one_and_two_processes_end_as_close_as_float_rounding_allows(tmp_path: Path, prepared: Path) -> None:
    """Issue 3's configuration: default AdamW and precision, lr_scaling=none, global batch 64 as 1 x 64
    and as 2 x 32, 2 epochs. DistributedSampler shards + SyncBatchNorm + keyed augmentation give the
    2-process run the 1-process run's samples, statistics and learning rate at every step, so the two
    may differ only by float rounding, and rounding differences grow chaotically in training (ReLU
    and max-pool decisions flip, AdamW normalises the changed gradients). The yardstick is the same
    1-process run with 1 thread instead of 2, which differs from it by nothing but rounding (the
    order of its sums). Measured here: on this test's data 6.1%, 7.0% and 79% (another seed); on
    Fashion-MNIST (2,048 samples, the default model) 18.5%, 18.9% and 91%. So issue 3's "within 1e-3"
    is below what rounding alone produces, and at this distance a real defect hides in the noise
    (2 processes without SyncBatchNorm: 28%); the test below is the one that tells them apart, and
    distributed.exact removes the rounding differences altogether (tests/test_exact.py: 0.0)."""
    common = ["train.lr_scaling=none", "train.hflip=true"]
    one, threads, two, other = (tmp_path / name for name in ("one", "one-thread", "two", "other-seed"))
    run(torchrun(1, *args_for(one, prepared, *common, "train.batch_size_per_rank=64",
                              "distributed.threads_per_process=2")))
    run(torchrun(1, *args_for(threads, prepared, *common, "train.batch_size_per_rank=64",
                              "distributed.threads_per_process=1")))
    run(torchrun(2, *args_for(two, prepared, *common, "train.batch_size_per_rank=32",
                              "distributed.threads_per_process=1")))
    run(torchrun(1, *args_for(other, prepared, *common, "train.batch_size_per_rank=64",
                              "distributed.threads_per_process=2", "seed=7")))
    reference = weights(one / "model.pt")
    world, rounding, seed = (max_rel_diff(reference, weights(d / "model.pt")) for d in (two, threads, other))
    print(f"relative weight difference: 1 vs 2 processes {world:.2e}, 2 vs 1 thread {rounding:.2e}, "
          f"another seed {seed:.2e}")
    assert world <= max(2 * rounding, 1e-3)  # no further apart than rounding alone takes one run
    assert seed > 3 * world  # and far closer than a different trajectory


@pytest.mark.slow
def test_one_and_two_processes_take_the_same_steps(tmp_path: Path, prepared: Path) -> None:
    """The discriminating version of the test above: 2 fp32 SGD steps (global batch 512), before
    rounding differences are amplified. 1 vs 2 processes must again be no further apart than 2
    threads vs 1 (measured 1.4e-4 and 1.2e-4), and a 2-process run without SyncBatchNorm (each rank
    normalising by its own 256 samples: a real defect) clearly further (1.0e-3)."""
    common = ["train.lr_scaling=none", "train.precision=fp32", "train.optimizer=sgd", "train.base_lr=0.01",
              "num_epochs=1"]
    runs = {
        "one": (1, "train.batch_size_per_rank=512", "distributed.threads_per_process=2"),
        "one-thread": (1, "train.batch_size_per_rank=512", "distributed.threads_per_process=1"),
        "two": (2, "train.batch_size_per_rank=256", "distributed.threads_per_process=1"),
        "two-unsynced": (2, "train.batch_size_per_rank=256", "distributed.threads_per_process=1",
                         "distributed.sync_batchnorm=false"),
    }
    for name, (nproc, *extra) in runs.items():
        run(torchrun(nproc, *args_for(tmp_path / name, prepared, *common, *extra)))
    reference = weights(tmp_path / "one" / "model.pt")
    world, rounding, unsynced = (max_rel_diff(reference, weights(tmp_path / d / "model.pt"))
                                 for d in ("two", "one-thread", "two-unsynced"))
    print(f"relative weight difference: 1 vs 2 processes {world:.2e}, 2 vs 1 thread {rounding:.2e}, "
          f"2 processes without SyncBatchNorm {unsynced:.2e}")
    assert world <= 3 * rounding
    assert unsynced > 4 * max(world, rounding)


def _newest_checkpoint(directory: Path) -> list[Path]:
    return sorted(directory.glob("ckpt-*.pt")) if directory.exists() else []


@pytest.mark.slow
def test_sigkilled_worker_is_restarted_and_resumes_exactly(tmp_path: Path, prepared: Path) -> None:
    common = ["num_epochs=3", "train.checkpoint_every_steps=5", "train.batch_size_per_rank=16"]
    clean = tmp_path / "clean"
    run(torchrun(2, *args_for(clean, prepared, *common)))

    killed = tmp_path / "killed"
    env = subprocess_env()
    proc = subprocess.Popen(torchrun(2, *args_for(killed, prepared, *common), extra=("--max-restarts=1",)),
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 300
    while not _newest_checkpoint(killed / "ckpt") and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before its first checkpoint"
    workers = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    assert workers, "no worker processes found"
    os.kill(int(workers[-1]), signal.SIGKILL)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-5000:]
    assert "resuming from" in out
    assert max_rel_diff(weights(clean / "model.pt"), weights(killed / "model.pt")) < 1e-4


@pytest.mark.slow
def test_two_trainings_at_once_on_one_machine(tmp_path: Path, prepared: Path) -> None:
    env = subprocess_env()
    procs = [subprocess.Popen(torchrun(2, *args_for(tmp_path / f"run{i}", prepared, "num_epochs=1",
                                                    f"seed={i}")),
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in (1, 2)]
    for p in procs:
        out, _ = p.communicate(timeout=600)
        assert p.returncode == 0, out[-5000:]
    assert (tmp_path / "run1" / "model.pt").is_file() and (tmp_path / "run2" / "model.pt").is_file()


@pytest.mark.slow
def test_same_seed_twice_gives_the_same_metrics(tmp_path: Path, prepared: Path) -> None:
    for name in ("a", "b"):
        run(["python", "stages/train.py", *args_for(tmp_path / name, prepared, "num_epochs=1")])
    a, b = (json.loads((tmp_path / n / "train.json").read_text())["train"] for n in ("a", "b"))
    for key in ("train_loss", "train_accuracy", "val_loss", "val_accuracy"):
        assert a[key] == b[key], key


# ---------------------------------------------------------------------------------------------
# Checkpoints


def test_checkpoint_roundtrip_with_rng_state(tmp_path: Path) -> None:
    torch.manual_seed(7)
    state = {"model": {"w": torch.randn(3)}, "rng": ckpt.rng_state(), "history": [{"epoch": 1, "x": 0.5}]}
    expected = torch.rand(4)
    path = ckpt.save_checkpoint(tmp_path, "abcdef012345", ckpt.Position(1, 0), state, keep=2)
    assert path.name == "ckpt-abcdef012345-e0001-s000000.pt"
    pos, loaded = ckpt.load_latest(tmp_path, "abcdef012345")
    assert pos == ckpt.Position(1, 0)
    ckpt.set_rng_state(loaded["rng"])
    assert torch.equal(torch.rand(4), expected)


def test_keep_prunes_only_this_runs_checkpoints(tmp_path: Path) -> None:
    other = ckpt.save_checkpoint(tmp_path, "111111111111", ckpt.Position(1, 0), {"x": torch.ones(1)}, keep=1)
    for e in range(1, 5):
        ckpt.save_checkpoint(tmp_path, "222222222222", ckpt.Position(e, 0), {"x": torch.ones(1)}, keep=2)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [other.name, "ckpt-222222222222-e0003-s000000.pt", "ckpt-222222222222-e0004-s000000.pt"]


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty"])
def test_corrupt_newest_checkpoint_falls_back_to_the_previous(tmp_path: Path, damage: str) -> None:
    fp = "abcdef012345"
    ckpt.save_checkpoint(tmp_path, fp, ckpt.Position(1, 0), {"v": torch.tensor([1.0])}, keep=3)
    newest = ckpt.save_checkpoint(tmp_path, fp, ckpt.Position(2, 0), {"v": torch.tensor([2.0])}, keep=3)
    data = newest.read_bytes()
    newest.write_bytes({"truncate": data[: len(data) // 2], "garbage": os.urandom(len(data)), "empty": b""}[damage])
    pos, state = ckpt.load_latest(tmp_path, fp)
    assert pos == ckpt.Position(1, 0) and state["v"].item() == 1.0


def test_only_corrupt_checkpoints_fail_clearly(tmp_path: Path) -> None:
    fp = "abcdef012345"
    path = ckpt.checkpoint_path(tmp_path, fp, ckpt.Position(1, 0))
    path.write_bytes(b"not a checkpoint")
    with pytest.raises(ckpt.CheckpointError, match="none of this run's 1 checkpoint"):
        ckpt.load_latest(tmp_path, fp)


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_checkpoint_with_pickle_payload_is_refused_and_never_runs(tmp_path: Path) -> None:
    fp = "abcdef012345"
    marker = tmp_path / "payload-ran"
    good = ckpt.save_checkpoint(tmp_path, fp, ckpt.Position(1, 0), {"v": torch.tensor([1.0])}, keep=3)
    evil = ckpt.checkpoint_path(tmp_path, fp, ckpt.Position(2, 0))
    torch.save({"fingerprint": fp, "x": _Payload(marker)}, evil, pickle_module=pickle)
    pos, _ = ckpt.load_latest(tmp_path, fp)
    assert pos == ckpt.Position(1, 0) and good.exists()
    assert not marker.exists()


def test_killed_checkpoint_write_leaves_previous_intact(tmp_path: Path) -> None:
    """A write that dies midway leaves only a hidden temp file; the final path keeps the old bytes."""
    fp = "abcdef012345"
    path = ckpt.save_checkpoint(tmp_path, fp, ckpt.Position(1, 0), {"v": torch.tensor([1.0])}, keep=3)
    before = path.read_bytes()

    class Boom(Exception):
        pass

    def exploding_save(obj: object, f) -> None:
        f.write(b"partial bytes")
        raise Boom

    original = torch.save
    torch.save = exploding_save
    try:
        with pytest.raises(Boom):
            ckpt.save_checkpoint(tmp_path, fp, ckpt.Position(1, 0), {"v": torch.tensor([9.0])}, keep=3)
    finally:
        torch.save = original
    assert path.read_bytes() == before
    assert ckpt.load_latest(tmp_path, fp)[1]["v"].item() == 1.0
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


@pytest.mark.slow
def test_sigkill_during_a_checkpoint_write_leaves_the_previous_one_loadable(tmp_path: Path) -> None:
    """A real SIGKILL while rank 0 writes a (large) checkpoint: the final path never holds a partial
    file, the previous checkpoint still loads, and the leftover temp file is ignored."""
    fp = "abcdef012345"
    previous = ckpt.save_checkpoint(tmp_path, fp, ckpt.Position(1, 0), {"v": torch.tensor([1.0])}, keep=3)
    writer = subprocess.Popen([
        "python", "-c",
        "import sys, torch; from pathlib import Path; from ddpipe import checkpoint as c; "
        "c.save_checkpoint(Path(sys.argv[1]), sys.argv[2], c.Position(2, 0), "
        "{'v': torch.zeros(400_000_000, dtype=torch.uint8)}, keep=3)", str(tmp_path), fp],
        cwd=ROOT, env=subprocess_env())
    deadline = time.time() + 120
    while time.time() < deadline and not list(tmp_path.glob(".ckpt-*.tmp")):
        time.sleep(0.01)
    assert list(tmp_path.glob(".ckpt-*.tmp")), "the writer never started its temp file"
    os.kill(writer.pid, signal.SIGKILL)
    writer.wait(timeout=60)
    assert not ckpt.checkpoint_path(tmp_path, fp, ckpt.Position(2, 0)).exists()
    pos, state = ckpt.load_latest(tmp_path, fp)
    assert pos == ckpt.Position(1, 0) and state["v"].item() == 1.0 and previous.exists()


# ---------------------------------------------------------------------------------------------
# Exact distributed validation


def _eval_rank(rank: int, world: int, prepared: Path, out: Path) -> None:
    torch.manual_seed(0)
    from ddpipe.models import ResNetSmall

    model = ResNetSmall(1, 10, 8).eval()
    ds = InMemoryDataset.load(prepared, "val")
    ds = InMemoryDataset(ds.images[:143], ds.labels[:143])  # 143: not divisible by 2 or 3
    info = DistInfo(True, rank, rank, world, world, 1, torch.device("cpu"), "gloo")
    t = BatchTransform([0.3], [0.3], 0, False, 0, info.device, False)
    import contextlib

    loss, acc = evaluate_split(model, ds, t, info, 16, contextlib.nullcontext, False)
    if rank == 0:
        torch.save({"loss": loss, "acc": acc}, out)


@pytest.mark.parametrize("world", [2, 3])
def test_validation_counts_each_sample_once_at_any_world_size(prepared: Path, world: int, tmp_path: Path) -> None:
    spawn(_eval_rank, 1, prepared, tmp_path / "one.pt")
    spawn(_eval_rank, world, prepared, tmp_path / "many.pt")
    one, many = (torch.load(tmp_path / f, weights_only=True) for f in ("one.pt", "many.pt"))
    assert one["acc"] == pytest.approx(many["acc"], abs=1e-12)
    assert one["loss"] == pytest.approx(many["loss"], rel=1e-6)
