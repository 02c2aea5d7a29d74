"""Sweeps as one unit: queued DVC experiments nested under one MLflow parent run, summarised as
mean ± std over seeds."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from ddpipe.tracking.sweeps import group_children, main, metric_key, table
from tests.conftest import CLONE_ENV, queue_status, run, subprocess_env


def _child(lr: str, seed: str, acc: float | None, f1: float = 0.5) -> SimpleNamespace:
    metrics = {} if acc is None else {"test_accuracy": acc, "test_macro_f1": f1}
    params = {"train.base_lr": lr, "seed": seed, "num_epochs": "2", "effective_lr": lr, "world_size": "1"}
    return SimpleNamespace(data=SimpleNamespace(params=params, metrics=metrics),
                           info=SimpleNamespace(status="FINISHED"))


def test_children_group_by_what_varies_besides_the_seed() -> None:
    children = [_child("0.001", "1", 0.80), _child("0.001", "2", 0.84), _child("0.01", "1", 0.90),
                _child("0.01", "2", 0.90), _child("0.01", "3", None)]  # the last is still running
    groups, varying = group_children(children)
    assert varying == ["train.base_lr"]  # effective_lr follows base_lr: derived, not a parameter
    assert [g.config for g in groups] == [{"train.base_lr": "0.01"}, {"train.base_lr": "0.001"}]
    mean, std = groups[1].mean_std("test_accuracy")
    assert mean == pytest.approx(0.82) and std == pytest.approx(0.0282843, abs=1e-6)  # sample std (n - 1)
    assert groups[0].mean_std("test_accuracy") == (pytest.approx(0.9), 0.0)
    rows = table(groups, varying)
    assert rows[0][:3] == ["train.base_lr", "runs", "seeds"] and rows[2][:3] == ["0.001", "2", "1,2"]
    assert rows[2][3] == "0.8200 ± 0.0283"
    assert metric_key("train.base_lr=0.001", "test_accuracy_mean") == "train.base_lr_0.001/test_accuracy_mean"


def test_an_unknown_sweep_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exits:
        main(["no-such-sweep", f"mlflow.tracking_uri=sqlite:///{tmp_path}/mlflow.db"])
    assert exits.value.code == 2
    assert "mlflow.sweep = 'no-such-sweep': no parent run" in capsys.readouterr().err


def test_a_searchs_study_is_refused_saying_its_trials_are_never_tested(tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture) -> None:
    """A search's parent run (its best trial tagged) holds trials that never ran the evaluate stage: the summary
    says so and where to look, instead of averaging test metrics no trial has."""
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    exp = client.create_experiment("ddpipe")
    parent = client.create_run(exp, tags={"ddpipe.sweep_parent": "true", "ddpipe.sweep": "lr",
                                          "ddpipe.search.best_trial": "1 (lr-1)"}).info.run_id
    client.create_run(exp, tags={"mlflow.parentRunId": parent, "ddpipe.sweep": "lr"})
    with pytest.raises(SystemExit) as exits:
        main(["lr", f"mlflow.tracking_uri=sqlite:///{tmp_path}/mlflow.db"])
    assert exits.value.code == 2
    assert "mlflow.sweep = 'lr' is the study of a search, whose trials are judged on validation and never tested" \
        in capsys.readouterr().err


@pytest.mark.slow
def test_a_queued_grid_is_one_parent_with_its_children_and_a_summary(repro_clone: Path) -> None:
    """`dvc exp run --queue -S mlflow.sweep=grid -S 'train.base_lr=...,...' -S 'seed=1,2'` queues 4
    experiments; `dvc queue start -j 2` runs two at a time (children start together, yet one parent);
    `ddpipe sweeps grid` prints and logs mean ± std per learning rate."""
    clone, env = repro_clone, CLONE_ENV
    run(["dvc", "exp", "run", "--queue", "-S", "mlflow.sweep=grid", "-S", "train.base_lr=0.001,0.003",
         "-S", "seed=1,2", "evaluate"], cwd=clone, env=env)  # up to the test metrics the summary reads: no export
    # Into a file, not a pipe: the process that starts each worker keeps the caller's stdout and stderr
    # open until its worker exits (once the queue is empty), so reading a pipe to its end would wait
    # for all four trainings instead of polling them below.
    with open(clone.parent / "queue-start.log", "w") as log:
        started = subprocess.run(["dvc", "queue", "start", "-j", "2"], cwd=clone, env=subprocess_env(env),
                                 stdout=log, stderr=subprocess.STDOUT, timeout=300)
    assert started.returncode == 0, (clone.parent / "queue-start.log").read_text()
    # until 4 experiment refs are back (git: milliseconds a look), asking DVC's queue itself (a core-second a look,
    # taken from the trainings) only every 30 s, for a queue that ends short of 4
    deadline, asked = time.time() + 1200, time.time()
    while time.time() < deadline:
        refs = run(["git", "for-each-ref", "--format=%(refname)", "refs/exps"], cwd=clone).stdout.split()
        if len(refs) >= 4 or time.time() - asked > 30:
            status, asked = queue_status(clone, env), time.time()
            if "Queued" not in status and "Running" not in status:
                break
        time.sleep(0.5)
    run(["dvc", "queue", "stop"], cwd=clone, env=env, check=False)
    assert status.count("Success") == 4, status

    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{clone}/mlflow.db")
    exp = client.get_experiment_by_name("ddpipe")
    parents = client.search_runs([exp.experiment_id], filter_string="attributes.run_name = 'grid'")
    assert len(parents) == 1
    children = client.search_runs([exp.experiment_id],
                                  filter_string=f"tags.`mlflow.parentRunId` = '{parents[0].info.run_id}'")
    assert len(children) == 4 and {c.info.status for c in children} == {"FINISHED"}
    assert sorted((c.data.params["train.base_lr"], c.data.params["seed"]) for c in children) == [
        ("0.001", "1"), ("0.001", "2"), ("0.003", "1"), ("0.003", "2")]

    summary = run(["ddpipe", "sweeps", "grid"], cwd=clone, env=env).stdout
    assert "sweep grid: 4 run(s) (4 FINISHED), 2 configuration(s)" in summary
    rows = [line for line in summary.splitlines() if line.startswith(("| 0.001 | 2 | 1,2 |", "| 0.003 | 2 | 1,2 |"))]
    assert len(rows) == 2 and all(row.count(" ± ") == 2 for row in rows)  # accuracy and macro-F1 per lr
    parent = client.get_run(parents[0].info.run_id)
    assert "train.base_lr_0.001/test_accuracy_mean" in parent.data.metrics
    assert "best_test_accuracy_mean" in parent.data.metrics
    assert {a.path for a in client.list_artifacts(parent.info.run_id)} >= {
        "sweep_summary.csv", "sweep_summary.md", "sweep_summary.png"}
