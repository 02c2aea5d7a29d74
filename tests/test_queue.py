"""DVC's queue loses nothing: a queued experiment's checkpoints live in the repository, not in DVC's temporary copy
of it, so an experiment killed with `dvc queue kill` (SIGINT) or `dvc queue kill --force` (SIGKILL) and queued again
resumes at its step and ends with the weights of a training never stopped."""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import (
    CLONE_ENV,
    STOPPED,
    none_left_within,
    queue_status,
    run,
    same_weights,
    subprocess_env,
    weights,
)

CKPT = re.compile(r"-e(\d{4})-s(\d{6})\.pt$")
# Long enough to be killed inside (about a second an epoch here): 10 epochs of 128 steps, a step checkpoint every 8,
# each kept (neither is part of the trajectory)
QUEUED = {"train.base_lr": "0.002", "num_epochs": "10", "train.batch_size_per_rank": "8",
          "train.checkpoint_every_steps": "8", "train.keep_checkpoints": "1000"}


def _queue(clone: Path, name: str) -> None:
    """Experiment ``name`` (:data:`QUEUED`) queued, up to the train stage (what the test compares is the trained
    weights: no evaluate and export, which the suite tests elsewhere), and the queue started, once the previous
    attempt's worker is gone (:func:`_no_worker`). `dvc queue start` writes into a file, not a pipe: the worker it
    starts keeps its caller's stdout open until the queue is empty, and reading a pipe to its end would wait for the
    training."""
    _no_worker(clone)
    run(["dvc", "exp", "run", "--queue", "-n", name, *[a for k, v in QUEUED.items() for a in ("-S", f"{k}={v}")],
         "train"], cwd=clone, env=CLONE_ENV)
    with open(clone.parent / f"start-{name}.log", "w") as log:
        started = subprocess.run(["dvc", "queue", "start"], cwd=clone, env=subprocess_env(CLONE_ENV), stdout=log,
                                 stderr=subprocess.STDOUT, timeout=300)
    assert started.returncode == 0, (clone.parent / f"start-{name}.log").read_text()


def _no_worker(clone: Path, seconds: float = 60) -> None:
    """No DVC queue worker left in ``clone``. A worker whose queue went empty (its experiment killed) shuts down a few
    seconds later, and a task queued meanwhile can reach it and be dropped unrun: in CI at 6b4b39c, q3's task was
    received by q2's leaving worker and q3 stayed Queued for 900 s (DVC's shutdown race, treeverse/dvc#10427)."""
    deadline = time.time() + seconds
    while "Worker status: 0 active, 0 idle" not in (said := queue_status(clone, CLONE_ENV)):
        assert time.time() < deadline, f"a DVC queue worker still alive after {seconds:.0f} s:\n{said}"
        time.sleep(1)


def _step_checkpoint(clone: Path, epoch: int, seconds: float = 300) -> Path:
    """The first step checkpoint of ``epoch`` (counted from 1) under the repository's checkpoints of queued
    experiments (none in DVC's copy): a moment inside that epoch; polls every 10 ms."""
    deadline = time.time() + seconds
    while time.time() < deadline:
        if found := sorted((clone / "checkpoints" / "queued").glob(f"*/ckpt-*-e{epoch - 1:04d}-s*[1-9]*.pt")):
            assert not list((clone / ".dvc" / "tmp" / "exps").glob("*/checkpoints/ckpt-*"))
            return found[0]
        time.sleep(0.01)
    raise AssertionError(f"no step checkpoint of epoch {epoch} under {clone / 'checkpoints' / 'queued'}")


def _kill(clone: Path, name: str, force: bool, seconds: float = 30) -> None:
    """`dvc queue kill [--force] name` of an experiment whose training runs. DVC finds it among its worker's active
    tasks, which can lag the training it started: once in CI, with the experiment's step checkpoints appearing,
    `dvc queue kill --force` said "'q2' is not a valid running experiment name". Asked again until DVC knows it."""
    cmd = ["dvc", "queue", "kill", *(["--force"] if force else []), name]
    deadline = time.time() + seconds
    while (said := run(cmd, cwd=clone, env=CLONE_ENV, check=False)).returncode != 0 and time.time() < deadline:
        assert "is not a valid running experiment name" in said.stderr, said.stderr
        time.sleep(0.5)
    assert said.returncode == 0, f"{cmd}: {said.stderr}"


def _status(clone: Path, name: str, seconds: float = 900) -> str:
    """The queue's word for experiment ``name`` (Queued, Running, Success, Failed), once it has one of the last two
    (the third attempt trains 7 epochs: a minute on a busy host), at most ``seconds``."""
    deadline, said = time.time() + seconds, ""
    while time.time() < deadline:
        rows = [line for line in queue_status(clone, CLONE_ENV).splitlines()
                if f" {name} " in f" {line} "]
        said = rows[0] if rows else ""
        if "Success" in said or "Failed" in said:
            return said
        time.sleep(2)  # each look is a core-second of DVC's, taken from the training it waits for
    return said


@pytest.mark.slow
def test_a_queued_experiment_killed_twice_resumes_at_its_step_and_ends_as_if_never_stopped(repro_clone: Path) -> None:
    """Queued, started, `dvc queue kill` in epoch 2: within 10 s no process of it is left and its MLflow run is not
    RUNNING; queued again, it resumes in epoch 2 from the checkpoints kept in the repository; `dvc queue kill
    --force` in epoch 3, the same; queued a third time, it resumes and finishes, with the weights of the same
    training run straight through. About 100 s on an idle host: the three attempts go through DVC's queue (its worker,
    a copy of the repository each), which is what is tested; the straight training beside them is the reference."""
    from mlflow import MlflowClient

    clone, marker = repro_clone, str(repro_clone / ".dvc" / "tmp" / "exps")
    client = MlflowClient(f"sqlite:///{clone}/mlflow.db")
    experiment = client.get_experiment_by_name("ddpipe").experiment_id
    before = {r.info.run_id for r in client.search_runs([experiment])}  # the clone's own training
    newest = {}
    for name, epoch, force in (("q1", 2, False), ("q2", 3, True)):
        _queue(clone, name)
        _step_checkpoint(clone, epoch)
        _kill(clone, name, force)
        assert not none_left_within(marker, 10), f"processes of {name} left 10 s after `dvc queue kill`"
        runs = [r for r in client.search_runs([experiment]) if r.info.run_id not in before]
        assert runs and all(r.info.status == "KILLED" and r.data.tags.get("ddpipe.end_reason") for r in runs), \
            [(name, r.info.status, r.data.tags.get("ddpipe.end_reason")) for r in runs]
        assert "Failed" in _status(clone, name)
        kept = max(p.name for p in (clone / "checkpoints" / "queued").glob("*/ckpt-*.pt"))
        e, s = map(int, CKPT.search(kept).groups())
        newest[name] = f"at epoch {e + 1}, step {s}"  # the newest checkpoint, where the next attempt must resume
    _queue(clone, "q3")
    said = _status(clone, "q3")
    logs = {name: run(["dvc", "queue", "logs", name], cwd=clone, env=CLONE_ENV).stdout for name in ("q1", "q2", "q3")}
    assert "Success" in said, logs["q3"][-3000:]
    assert "KeyboardInterrupt" in logs["q1"]  # SIGINT is Ctrl-C: interrupted at once, its newest checkpoint kept
    (sig, epoch, step), = STOPPED.findall(logs["q2"])  # --force: DVC gone, the launcher stops the training at a step
    assert sig == "SIGTERM" and newest["q2"] == f"at epoch {epoch}, step {step}", logs["q2"][-3000:]
    for killed, again in (("q1", "q2"), ("q2", "q3")):
        assert f"resuming from {clone}/checkpoints/queued/" in logs[again] and newest[killed] in logs[again], \
            logs[again][-3000:]
    assert not STOPPED.search(logs["q3"])
    run(["dvc", "exp", "apply", "q3"], cwd=clone, env=CLONE_ENV)

    ref = clone.parent / "straight"  # the same training, never stopped: only its paths differ
    paths = {"checkpoints": "ckpt", "model": "model.pt", "run_info": "run.json", "train_metrics": "train.json",
             "history": "history.csv"}
    run(["python", "stages/train.py", *[f"{k}={v}" for k, v in QUEUED.items()],
         *[f"paths.{key}={ref / name}" for key, name in paths.items()], f"mlflow.tracking_uri=sqlite:///{ref}/mlflow.db",
         f"mlflow.outbox={ref}/outbox"], cwd=clone, env=CLONE_ENV)
    assert same_weights(weights(clone / "models" / "model.pt"), weights(ref / "model.pt"))


@pytest.mark.slow
def test_queued_experiments_differing_only_in_their_sweep_or_model_epoch_are_runs_of_their_own(
        repro_clone: Path) -> None:
    """Three experiments, one after the other through DVC's queue (issue 61, item 5): side-left and side-right differ
    only in ``mlflow.sweep``, side-left and side-last only in ``train.model_epoch`` (both outside the trajectory):
    each is an MLflow run of its own, under its own sweep, with a checkpoint folder of its own; a later one never
    resumed an earlier one's finished checkpoint and reopened its run."""
    from mlflow import MlflowClient

    clone = repro_clone
    experiments = {"side-left": "left", "side-right": "right", "side-last": "left"}
    for name, sweep in experiments.items():
        last = ["-S", "train.model_epoch=last"] if name == "side-last" else []
        run(["dvc", "exp", "run", "--queue", "-n", name, "-S", "seed=7", "-S", "num_epochs=1", "-S",
             f"mlflow.sweep={sweep}", *last, "train"], cwd=clone, env=CLONE_ENV)  # the runs are the training's
    with open(clone.parent / "start.log", "w") as log:
        started = subprocess.run(["dvc", "queue", "start", "-j", "1"], cwd=clone, env=subprocess_env(CLONE_ENV),
                                 stdout=log, stderr=subprocess.STDOUT, timeout=300)
    assert started.returncode == 0, (clone.parent / "start.log").read_text()
    for name in experiments:
        assert "Success" in _status(clone, name), name
    client = MlflowClient(f"sqlite:///{clone}/mlflow.db")
    runs = {r.info.run_name: r for r in client.search_runs([e.experiment_id for e in client.search_experiments()])}
    assert set(experiments) <= set(runs), sorted(runs)
    assert len({runs[name].info.run_id for name in experiments}) == 3
    assert runs["side-last"].data.params["train.model_epoch"] == "last"
    assert all(runs[name].data.tags["dvc_exp_name"] == name for name in experiments)
    sweep = {name: client.get_run(runs[name].data.tags["mlflow.parentRunId"]).data.tags["ddpipe.sweep"]
             for name in experiments}
    assert sweep == experiments
    assert len(list((clone / "checkpoints" / "queued").iterdir())) == 3
