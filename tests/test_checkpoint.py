"""Checkpoints: atomic writes, safe loading, fallback past corrupt files, RNG states that resume exactly,
and the Checkpointer every rank goes through."""

from __future__ import annotations

import os
import pickle
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from ddpipe.core.ranks import DistInfo
from ddpipe.engine import checkpoint as ckpt
from tests.conftest import ROOT, free_port, spawn, subprocess_env


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
        "import sys, torch; from pathlib import Path; from ddpipe.engine import checkpoint as c; "
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


def test_checkpointer_restores_every_part_and_the_rng(tmp_path: Path) -> None:
    """What one Checkpointer saved, another (a restarted run) loads back into fresh objects."""
    torch.manual_seed(3)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(8, 4)).sum().backward()
    optimizer.step()
    saver = ckpt.Checkpointer(tmp_path, "abcdef012345", keep=2, info=DistInfo())
    saver.save(ckpt.Position(1, 3), {"model": model, "optimizer": optimizer}, history=[{"epoch": 1}])
    expected = torch.rand(3)

    fresh_model = torch.nn.Linear(4, 2)
    fresh_optimizer = torch.optim.AdamW(fresh_model.parameters(), lr=0.1)
    pos, state = ckpt.Checkpointer(tmp_path, "abcdef012345", 2, DistInfo()).restore(
        {"model": fresh_model, "optimizer": fresh_optimizer})
    assert pos == ckpt.Position(1, 3) and state["history"] == [{"epoch": 1}]
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh_model.state_dict().values()))
    assert fresh_optimizer.state_dict()["state"][0]["step"] == 1
    assert torch.equal(torch.rand(3), expected)  # the RNG continues where the saved run left it
    assert ckpt.Checkpointer(tmp_path, "000000000000", 2, DistInfo()).restore({"model": fresh_model}) is None


def _at_a_store_away(rank: int, world_size: int, out: Path, endpoint: str) -> None:
    from ddpipe.core import objectstore
    from ddpipe.core.exits import StoreAway

    objectstore.STORE_OUTAGE_S, objectstore.RETRY_DELAYS_S = 0.0, (0.01,)  # a spawned process: set here
    os.environ.update(AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID="key", AWS_SECRET_ACCESS_KEY="secret")
    info = DistInfo(distributed=True, rank=rank, world_size=world_size, local_rank=rank, local_world_size=world_size,
                    backend="gloo", sums="gloo")
    saver = ckpt.Checkpointer("s3://ddpipe/away", "abcdef012345", keep=2, info=info)
    try:
        saver.save(ckpt.Position(1, 4), {"model": torch.nn.Linear(2, 2)})
        (out / f"{rank}.txt").write_text("went on")
    except StoreAway as stop:
        (out / f"{rank}.txt").write_text(str(stop))


def test_a_store_away_too_long_stops_every_rank_at_the_same_checkpoint(tmp_path: Path) -> None:
    """Global rank 0 alone writes the checkpoints; its store away for the stated time (ddpipe.core.objectstore's
    STORE_OUTAGE_S, 0 s here: the first write that fails), every rank stops at that checkpoint with rank 0's words."""
    spawn(_at_a_store_away, 2, tmp_path, f"http://127.0.0.1:{free_port()}")
    said = [(tmp_path / f"{rank}.txt").read_text() for rank in (0, 1)]
    assert said[0] == said[1], said
    assert "(s3://ddpipe/away, endpoint http://127.0.0.1:" in said[0] and "has been away for" in said[0], said
    assert "the checkpoint at step 4 of epoch 2 is not written" in said[0], said


def test_the_fingerprint_of_a_configuration_stays_what_it_was() -> None:
    """A run resumes only from checkpoints of its own fingerprint: if a refactor changed how the config
    and the data are hashed, every existing run would silently start fresh. The literal is what ddpipe
    computes for this input since the world size and per-rank batch gave way to the global batch and
    effective lr (a run resumes at another world size) and the data store's meta.json grew its encoding (it
    was 7ea22602640c before: those runs' data is in another format and must be prepared again). Keys added since
    (model.weights, fine-tuning) leave it unchanged at their defaults (checkpoint.ADDED_LATER), and so do the
    recipe's ``auto`` keys, which the run fingerprints as resolved (raw data: the values they had before)."""
    from dataclasses import asdict

    from ddpipe.config.keys import trajectory
    from ddpipe.config.schema import Config
    from ddpipe.data.store import Prepared
    from ddpipe.engine.resolved import resolve

    data = Prepared(dataset="fashion_mnist", classes=["a", "b"], num_channels=1, encoding="raw", image_size=[28, 28],
                    max_side=None, mean=[0.25], std=[0.5], sizes={"train": 100, "val": 10, "test": 10})
    # as the trainer makes it (Resolved.trajectory), with model.name as the literal was first computed: auto
    keys = {**resolve(Config(), torch.device("cpu"), data).trajectory(), "model.name": "auto"}
    assert ckpt.run_fingerprint(keys, 256, 0.0042, asdict(data)) == "94158c15c28b"
    finetuned = {**keys, "model.weights": "pretrained/a.pt"}  # a key added since, set: a new run
    assert ckpt.run_fingerprint(finetuned, 256, 0.0042, asdict(data)) != "94158c15c28b"
    same_run = {**keys, "train.batch_size_per_rank": "64"}  # 4 x 64 where it was 2 x 128
    assert ckpt.run_fingerprint(same_run, 256, 0.0042, asdict(data)) == \
        ckpt.run_fingerprint(keys, 256, 0.0042, asdict(data))
    assert ckpt.run_fingerprint(trajectory(Config()), 128, 0.0042, asdict(data)) != \
        ckpt.run_fingerprint(trajectory(Config()), 256, 0.0042, asdict(data))


def _saved_before_format_versions(directory: Path, fp: str, pos: ckpt.Position, state: dict) -> Path:
    """A checkpoint as save_checkpoint wrote it before checkpoints recorded their format (no format_version)."""
    path = ckpt.checkpoint_path(directory, fp, pos)
    torch.save({**state, "position": torch.tensor([pos.epoch, pos.step]), "fingerprint": fp}, path)
    return path


_EPOCH = {"epoch": 1, "train_loss": 0.9, "train_accuracy": 0.6, "val_loss": 0.8, "val_accuracy": 0.7, "lr": 0.01,
          "images_per_s": 100.0, "epoch_seconds": 2.0}
_SUMS = (12.5, 40.0, 64.0, 3.25)  # loss_sum, correct, count, seconds of an interrupted epoch


@pytest.mark.parametrize("written", ["last before versions", "before weight averaging", "before the world size",
                                     "before mid-epoch sums"])
def test_a_checkpoint_written_before_format_versions_resumes_as_it_did(tmp_path: Path, written: str) -> None:
    """Checkpoints of format 0, the trainer's values as ddpipe.engine.loop wrote them at each step before format
    versions: the last (every entry named); before weight averaging (no sources in the selection, no average's
    columns in the history, the epoch's sums as a float64 tensor); before the world size was recorded; before
    mid-epoch checkpoints recorded the epoch's sums. Each resumes with what it meant."""
    from ddpipe.config.schema import TrainConfig
    from ddpipe.core.history import EpochStats
    from ddpipe.engine.meters import EpochProgress
    from ddpipe.engine.selection import ModelSelection

    torch.manual_seed(5)
    model = torch.nn.Linear(4, 2)
    best = {k: v + 1.0 for k, v in model.state_dict().items()}
    selection = {"best_epoch": 1, "best_val_accuracy": 0.75, "best_weights": best}
    sums = torch.tensor(_SUMS, dtype=torch.float64)
    state = {"model": model.state_dict(), "rng": ckpt.rng_state(), "run_id": "abc123", "selection": selection,
             "history": [_EPOCH], "epoch_progress": sums, "world_size": 2}
    if written == "last before versions":
        state.update(selection={**selection, "best_source": "ema", "last_source": "raw"},
                     history=[{**_EPOCH, "ema_val_loss": 0.7, "ema_val_accuracy": 0.75}],
                     epoch_progress=EpochProgress(*_SUMS).as_state())
    if written in ("before the world size", "before mid-epoch sums"):
        del state["world_size"]
    if written == "before mid-epoch sums":
        del state["epoch_progress"]
    fp = "abcdef012345"
    _saved_before_format_versions(tmp_path, fp, ckpt.Position(1, 3), state)

    fresh, sel = torch.nn.Linear(4, 2), ModelSelection(TrainConfig(model_epoch="best"))
    pos, loaded = ckpt.Checkpointer(tmp_path, fp, 2, DistInfo()).restore({"model": fresh, "selection": sel})
    assert pos == ckpt.Position(1, 3) and loaded["run_id"] == "abc123"
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))
    last = written == "last before versions"
    assert (sel.best_epoch, sel.best_val_accuracy) == (1, 0.75)
    assert (sel.best_source, sel.last_source) == (("ema", "raw") if last else ("raw", "raw"))
    weights, epoch, source = sel.exported(fresh, 1)
    assert epoch == 1 and source == sel.best_source and all(torch.equal(weights[k], best[k]) for k in best)
    (stats,) = [EpochStats(**h) for h in loaded["history"]]
    assert stats == EpochStats(**_EPOCH, **({"ema_val_loss": 0.7, "ema_val_accuracy": 0.75} if last else {}))
    progress = EpochProgress.from_state(loaded["epoch_progress"])
    assert progress == (EpochProgress() if written == "before mid-epoch sums" else EpochProgress(*_SUMS))
    assert loaded["world_size"] == (2 if written in ("last before versions", "before weight averaging") else None)


def test_a_checkpoint_records_its_format_and_one_newer_than_this_code_stops_the_resume(tmp_path: Path) -> None:
    """A newer ddpipe's checkpoint of this run is neither read nor skipped for an older one: the resume stops,
    naming the file, its format and the newest this code reads."""
    fp = "abcdef012345"
    older = ckpt.save_checkpoint(tmp_path, fp, ckpt.Position(1, 0), {"v": torch.tensor([1.0])}, keep=3)
    assert torch.load(older, weights_only=True)["format_version"] == ckpt.CHECKPOINT_FORMAT
    assert ckpt.load_latest(tmp_path, fp)[1]["format_version"] == ckpt.CHECKPOINT_FORMAT
    newer = ckpt.checkpoint_path(tmp_path, fp, ckpt.Position(2, 0))
    version = ckpt.CHECKPOINT_FORMAT + 1
    torch.save({"v": torch.tensor([2.0]), "position": torch.tensor([2, 0]), "fingerprint": fp,
                "format_version": version}, newer)
    said = (f"{newer}: checkpoint format {version} is newer than this ddpipe reads (formats up to "
            f"{ckpt.CHECKPOINT_FORMAT})")
    with pytest.raises(ValueError, match=re.escape(said)):
        ckpt.load_latest(tmp_path, fp)
    assert older.exists() and newer.exists()


def test_a_queued_experiments_checkpoints_are_its_own_when_any_parameter_differs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """In DVC's copy of the repository (``$DVC_ROOT`` the user's), an experiment's checkpoints go to a folder of the
    repository named by all its parameters: the same experiment again finds its own (and resumes), one differing in
    any key, in the trajectory or not, another (tests/test_queue.py runs two such through DVC's queue)."""
    from ddpipe.config.load import load_config
    from ddpipe.engine.stage_outputs import anchored_checkpoints
    from tests.conftest import PARAMS

    repo, copy = tmp_path / "repo", tmp_path / "copy"
    copy.mkdir()
    monkeypatch.setenv("DVC_ROOT", str(repo))
    monkeypatch.chdir(copy)

    def place(*overrides: str) -> str:
        return anchored_checkpoints(load_config(list(overrides), params_file=PARAMS)).paths.checkpoints

    own = place()
    assert own == place() and Path(own).parent == repo / "checkpoints" / "queued"
    others = {place("train.model_epoch=last"), place("mlflow.sweep=left"), place("train.val_every_n_steps=50"),
              place("seed=7")}
    assert own not in others and len(others) == 4
