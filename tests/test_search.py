"""The search over experiments: every bad input refused before any trial with the study unchanged; a trial pruned on
every rank after the same epoch; a real study of DVC experiments, continued, with its MLflow children and its best."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import yaml

from ddpipe.config.load import load_config
from ddpipe.config.schema import ConfigError
from ddpipe.core.environment import REPO_ROOT_ENV
from ddpipe.search.space import make_plan, override_text
from tests.conftest import (
    CLONE_ENV,
    GIT_ENV,
    PARAMS,
    clone_repo,
    commit_params,
    dead_pid,
    kill_all,
    prune_a_two_process_trial,
    run,
    same_weights,
    subprocess_env,
    training_processes,
    wait_for_step_checkpoint,
    weights,
)

LR = "search.space.train.base_lr=loguniform(1e-4, 1e-1)"


def _plan(tmp: Path, *overrides: str):
    return make_plan(load_config(list(overrides), params_file=PARAMS), tmp, PARAMS)


def test_a_search_section_becomes_a_plan(tmp_path: Path) -> None:
    plan = _plan(tmp_path, LR, "search.space.train.label_smoothing=uniform(0.0, 0.2)",
                 "search.space.model.name=choice(resnet_small, resnet_compact)",
                 "search.space.train.grad_accum_steps=int(1, 4)")
    assert {k: d.kind for k, d in plan.space.items()} == {"train.base_lr": "loguniform", "train.label_smoothing":
                                                          "uniform", "model.name": "choice",
                                                          "train.grad_accum_steps": "int"}
    assert plan.space["train.base_lr"].to_optuna().log and plan.space["train.grad_accum_steps"].grid() == [1, 2, 3, 4]
    assert plan.storage == str(tmp_path / "search" / "search" / "study.journal")  # null: a file in the repository
    # first: null is one trial at the params as they stand, unless the space leaves them out (model.name: auto)
    assert plan.first == [] and "model.name = 'auto'" in plan.notes[0]
    assert _plan(tmp_path, LR).first == [{"train.base_lr": 0.003}]
    assert _plan(tmp_path, LR, "search.storage=sqlite:///s.db").storage == f"sqlite:///{tmp_path / 's.db'}"
    assert [override_text(v) for v in (0.001, 3, True, "resnet18", "a b")] == ["0.001", "3", "true", "resnet18",
                                                                               "'a b'"]


@pytest.mark.parametrize("overrides, message", [
    ([LR.replace("base_lr", "base_lrr")], "search.space.train.base_lrr: unknown key 'train.base_lrr'"),
    (["search.space.train.base_lr=gauss(0, 1)"], "search.space.train.base_lr = 'gauss(0, 1)' is not accepted; "
                                                 "expected loguniform(low, high)"),
    (["search.space.train.base_lr=uniform(a, b)"], "expected uniform(low, high) of two numbers"),
    (["search.space.train.base_lr=uniform(0.1, 0.01)"], "'uniform(0.1, 0.01)' is not accepted; expected "
                                                        "uniform(low, high) with low < high"),
    (["search.space.train.base_lr=loguniform(0, 1)"], "'loguniform(0, 1)' is not accepted; expected loguniform(low, "
                                                      "high) with 0 < low"),
    (["search.space.model.name=choice(resnet_small, no_such_net)"],
     "search.space.model.name: 'no_such_net' is not accepted: model.name = 'no_such_net' is not accepted"),
    (["search.space.train.optimizer=choice(adamw, rmsprop)"], "'rmsprop' is not accepted: train.optimizer = "
                                                              "'rmsprop' is not accepted; expected one of adamw, sgd"),
    (["search.space.train.label_smoothing=uniform(0, 1.5)"], "train.label_smoothing = 1.5 is not accepted"),
    (["search.space.train.grad_accum_steps=uniform(1, 4)"], "expected int(low, high) or choice(...)"),
    (["search.space.paths.model=choice(a.pt, b.pt)"], "expected a training parameter"),
    ([LR, "search.metric=val_acc"], "search.metric = 'val_acc' is not accepted; expected an epoch metric the "
                                    "training logs: train_loss"),
    ([LR, "search.metric=ema_val_accuracy"], "train.ema_decay = null"),
    ([LR, "search.trials=0"], "search.trials = 0 is not accepted; expected an integer >= 1"),
    ([LR, "search.sampler=grid"], "search.sampler = 'grid' is not accepted with search.space.train.base_lr"),
    ([LR, "search.first=[{train.lr: 0.01}]"], "search.first[0].train.lr: 'train.lr' is not accepted; expected a "
                                              "key of search.space"),
    ([LR, "search.first=[{train.base_lr: -1}]"], "train.base_lr = -1.0 is not accepted; expected a number > 0.0"),
    ([LR, "search.storage=postgresql://me:secret@db/optuna"], "search.storage holds a password"),
    ([LR, "search.storage=redis://db"], "search.storage = 'redis://db' is not accepted"),
    ([LR, "search.study=a/b"], "search.study = 'a/b' is not accepted"),
    (["search.space={}"], "search.space = {} is not accepted"),
    # issue 47, item 6: a study whose values would not compare, or whose text does not parse
    ([LR, "search.metric=val_loss"], "search.direction = 'maximize' is not accepted with search.metric = 'val_loss' "
                                     "(lower is better); expected 'minimize'"),
    ([LR, "search.metric=train_accuracy", "search.direction=minimize"],
     "search.direction = 'minimize' is not accepted with search.metric = 'train_accuracy' (higher is better)"),
    (["search.space.seed=int(1, 5)"], "search.space.seed = 'int(1, 5)' is not accepted: seed decides the validation "
                                      "split"),
    (["search.space.data.val_fraction=uniform(0.05, 0.2)"],
     "search.space.data.val_fraction = 'uniform(0.05, 0.2)' is not accepted: data.val_fraction decides the validation"),
    (["search.space.train.val_every_n_steps=int(5, 20)"],
     "search.space.train.val_every_n_steps = 'int(5, 20)' is not accepted: train.val_every_n_steps decides what the "
     "pruner's"),
    (["search.space.model.name=choice(resnet_small, [x)"], "search.space.model.name = 'choice(resnet_small, [x)' is "
                                                          "not accepted; expected choice(x, y, ...) of plain values"),
])
def test_bad_input_is_refused_naming_key_value_and_what_is_accepted(tmp_path: Path, overrides: list[str],
                                                                     message: str) -> None:
    with pytest.raises(ConfigError) as err:
        _plan(tmp_path, *overrides)
    assert message in str(err.value)


def test_a_key_outside_the_search_section_is_refused_on_the_command_line(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """`run num_epochs=20` would reach the driver, not the trials (their params are params.yaml's): exit 2 naming
    it, nothing written."""
    from ddpipe.search.study_commands import main

    monkeypatch.setenv(REPO_ROOT_ENV, str(tmp_path))
    with pytest.raises(SystemExit) as exits:
        main(["run", LR, "num_epochs=20"])
    assert exits.value.code == 2
    assert "error: num_epochs=20: only search.* keys are accepted" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_a_storage_that_does_not_answer_fails_before_any_trial(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The command exits 2 naming search.storage; nothing was written (no study, no folder)."""
    from ddpipe.search.study_commands import main

    monkeypatch.setenv(REPO_ROOT_ENV, str(tmp_path))
    for storage in ("postgresql+psycopg://nobody@127.0.0.1:9/optuna", f"sqlite:///{tmp_path}/no/such/dir/s.db"):
        with pytest.raises(SystemExit) as exits:
            main(["run", LR, f"search.storage={storage}"])
        assert exits.value.code == 2
        shown = storage.replace("nobody@", "")  # printed without its user
        assert f"error: search.storage = '{shown}' does not answer or refuses us" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["run", LR.replace("1e-4", "0")])
    assert list(tmp_path.iterdir()) == []


def test_a_database_that_hangs_fails_in_seconds_naming_the_storage(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A server that takes the connection and never answers: exit 2 naming search.storage after the connect
    timeout (here 2 s), not a wait without end; nothing written."""
    import socket
    import time

    from ddpipe.core import trials
    from ddpipe.search.study_commands import main

    monkeypatch.setenv(REPO_ROOT_ENV, str(tmp_path))
    monkeypatch.setattr(trials, "CONNECT_TIMEOUT_S", 2)
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(4)  # the kernel completes the handshake; nobody ever reads or writes
        url = f"postgresql+psycopg://nobody@127.0.0.1:{silent.getsockname()[1]}/optuna"
        t0 = time.monotonic()
        with pytest.raises(SystemExit) as exits:
            main(["run", LR, f"search.storage={url}"])
        waited = time.monotonic() - t0
    assert exits.value.code == 2 and waited < 30, waited
    err = capsys.readouterr().err
    assert f"error: search.storage = '{url.replace('nobody@', '')}' does not answer or refuses us" in err, err
    assert list(tmp_path.iterdir()) == []


def test_a_continued_study_keeps_its_metric_and_fixed_params(tmp_path: Path) -> None:
    """The study records what it started with; continued with another metric or another fixed param (one that shapes
    the training, outside the space), it is refused naming what changed; the same again, or a change to the space's
    own keys or the search section, continues it."""
    from ddpipe.search.study import open_study

    open_study(_plan(tmp_path, LR, "search.study=k", "num_epochs=3"))
    open_study(_plan(tmp_path, LR, "search.study=k", "num_epochs=3", "train.base_lr=0.01", "search.trials=7"))
    with pytest.raises(ConfigError, match=r"search.study = 'k' is continued with num_epochs = 4 \(its trials ran with "
                                          r"3\).*; expected the study's own values back, or a new search.study"):
        open_study(_plan(tmp_path, LR, "search.study=k", "num_epochs=4"))
    with pytest.raises(ConfigError, match=r"search.metric = 'train_accuracy' \(its trials ran with 'val_accuracy'\)"):
        open_study(_plan(tmp_path, LR, "search.study=k", "num_epochs=3", "search.metric=train_accuracy"))
    # validations inside epochs change what the pruner's steps are, though not the training
    with pytest.raises(ConfigError, match=r"train.val_every_n_steps = 50 \(its trials ran with 0\)"):
        open_study(_plan(tmp_path, LR, "search.study=k", "num_epochs=3", "train.val_every_n_steps=50"))


def test_trials_of_a_gone_driver_are_taken_over_under_their_numbers_once(tmp_path: Path) -> None:
    """A driver SIGKILLed leaves its trials RUNNING: the next run takes over those whose driver on this host is gone,
    to run them again under their numbers; a live driver's trial is left alone, and nothing is taken twice."""
    import socket

    import optuna

    from ddpipe.core.processes import start_time
    from ddpipe.search.study import driver_mark, open_study, orphans

    plan = _plan(tmp_path, LR, "search.first=[]")
    study = open_study(plan)
    dead = dead_pid()
    dists = {k: d.to_optuna() for k, d in plan.space.items()}
    orphan, live = study.ask(dists), study.ask(dists)
    orphan.set_user_attr("driver", {"host": socket.gethostname(), "pid": dead, "started": start_time(dead)})
    live.set_user_attr("driver", {**driver_mark(), "pid": os.getppid(), "started": start_time(os.getppid())})
    assert [t.number for t in orphans(study, plan.storage, lambda number: [])[0]] == [orphan.number]
    assert [t.state for t in study.trials] == [optuna.trial.TrialState.RUNNING] * 2 and len(study.trials) == 2
    assert study.trials[orphan.number].user_attrs["driver"] == driver_mark()
    assert orphans(study, plan.storage, lambda number: []) == ([], [])  # taken: nothing twice


def test_a_trials_workspace_is_the_working_tree_in_a_repository_of_its_own(tmp_path: Path) -> None:
    """A trial runs in a clone of its own (trials started together share no DVC stash): at HEAD, with the working
    tree's changes to tracked files and the index's new files, not its untracked ones; the user's repository is left
    as it was. An experiment named as a trial the study does not hold is refused before any trial."""
    from ddpipe.launch import workspace
    from ddpipe.search.study import SearchError, check_names, open_study

    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "params.yaml").write_text("lr: 1\n")
    (repo / "code.py").write_text("old\n")
    for cmd in (["git", "init", "-q"], ["git", "add", "-A"], ["git", "commit", "-qm", "base"]):
        run(cmd, cwd=repo, env=GIT_ENV)
    (repo / "code.py").write_text("new\n")
    (repo / "staged.py").write_text("staged\n")
    run(["git", "add", "staged.py"], cwd=repo, env=GIT_ENV)
    (repo / "untracked.txt").write_text("mine\n")
    before = run(["git", "status", "--porcelain"], cwd=repo).stdout

    head, changes = workspace.working_tree(repo)
    ws = tmp_path / "trial-0" / "workspace"
    workspace.make(ws, str(repo), head, changes)
    assert (ws / "code.py").read_text() == "new\n" and (ws / "staged.py").read_text() == "staged\n"
    assert not (ws / "untracked.txt").exists() and not ws.with_name("workspace.partial").exists()
    assert run(["git", "rev-parse", "HEAD"], cwd=ws).stdout.strip() == head
    assert run(["git", "status", "--porcelain"], cwd=repo).stdout == before  # the user's tree untouched
    assert run(["git", "stash", "list"], cwd=repo).stdout == ""

    plan = _plan(tmp_path, LR, "search.study=s", "search.first=[]")
    study = open_study(plan)
    check_names(plan, study, repo)  # nothing named s-<n>: fine
    run(["git", "update-ref", f"refs/exps/{head[:2]}/{head[2:]}/s-3", head], cwd=repo)
    with pytest.raises(SearchError, match=r"search.study = 's': DVC experiment\(s\) s-3 exist.*dvc exp remove s-3"):
        check_names(plan, study, repo)


def test_a_trials_experiment_carries_no_figure_it_did_not_make_and_says_in_dvc_exp_show_how_to_apply_it(
        tmp_path: Path) -> None:
    """A trial's experiment (faked: the workspace a trial runs in, committed as an experiment of its baseline without
    running it) holds no entry of the stages it never ran in dvc.lock and no file they made; in the test metrics'
    place, the one figure its row in `dvc exp show` lists: how to apply it (`dvc exp apply` of it exits 255 on the
    export's outputs, which DVC cannot check out: launch.workspace.hold_out)."""
    from ddpipe.launch import workspace

    repo = clone_repo(tmp_path / "repo")
    plan = _plan(repo, LR, "search.study=s", "search.first=[]")
    assert plan.apply_note == plan.held_out[0] == "metrics/test.json"
    assert workspace.drop_downstream(repo, "train") == ["evaluate", "export"]
    workspace.hold_out(repo, plan.held_out, plan.apply_note, "s-0")
    base = run(["git", "rev-parse", "HEAD"], cwd=repo).stdout.strip()
    run(["git", "add", "-A"], cwd=repo)
    tree = run(["git", "write-tree"], cwd=repo).stdout.strip()
    trial = run(["git", "commit-tree", tree, "-p", base, "-m", "s-0"], cwd=repo, env=GIT_ENV).stdout.strip()
    run(["git", "update-ref", f"refs/exps/{base[:2]}/{base[2:]}/s-0", trial], cwd=repo)
    run(["git", "reset", "-q", "--hard"], cwd=repo)

    tracked = run(["git", "ls-tree", "-r", "--name-only", trial], cwd=repo).stdout.split()
    assert not [f for f in tracked for held in plan.held_out[1:] if f == held or f.startswith(held + "/")]
    assert set(yaml.safe_load(run(["git", "show", f"{trial}:dvc.lock"], cwd=repo).stdout)["stages"]) == {
        "fetch", "prepare", "train"}
    rows = json.loads(run(["dvc", "exp", "show", "--json"], cwd=repo, env=CLONE_ENV).stdout)
    (row,) = [r for b in rows for e in b.get("experiments") or [] for r in e["revs"] if r["name"] == "s-0"]
    assert row["data"]["metrics"]["metrics/test.json"]["data"] == {
        "test": {"apply": "dvc exp apply s-0 (exits 255: evaluate and export never ran); dvc repro"}}


@pytest.mark.parametrize("nodes", [1, 2], ids=["2 processes on 1 node", "2 nodes of 1 process"])
def test_a_two_process_trial_is_pruned_on_every_rank_after_the_same_epoch(tmp_path: Path, prepared: Path,
                                                                          nodes: int) -> None:
    """Rank 0 reports epoch 1 below the median of a finished trial; both ranks stop after it (on one node, or on two
    nodes of this host through a c10d rendezvous), the run is KILLED and says pruned, no model is written, the study
    records the epoch."""
    from mlflow import MlflowClient

    frozen, out = prune_a_two_process_trial(tmp_path, prepared, str(tmp_path / "study.journal"), "s", nodes)
    client = MlflowClient(f"sqlite:///{out}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("ddpipe").experiment_id])
    (pruned,) = [r for r in runs if "ddpipe.sweep_parent" not in r.data.tags]
    assert pruned.info.run_id == frozen.user_attrs["mlflow_run"] and pruned.info.status == "KILLED"
    assert "pruned after epoch 1 of 3" in pruned.data.tags["ddpipe.end_reason"]
    assert pruned.data.metrics["pruned_at_epoch"] == 1


def said(done: subprocess.CompletedProcess) -> str:
    """All a command said: its results (stdout), then its messages (stderr: the driver's lines, ``$ dvc ...``)."""
    return done.stdout + done.stderr


def _experiments(clone: Path) -> dict[str, dict]:
    """Each DVC experiment's name and params.yaml."""
    refs = run(["git", "for-each-ref", "--format=%(refname)", "refs/exps"], cwd=clone).stdout.split()
    return {ref.rsplit("/", 1)[1]: yaml.safe_load(run(["git", "show", f"{ref}:params.yaml"], cwd=clone).stdout)
            for ref in refs if ref.count("/") >= 4}


@pytest.mark.slow
def test_a_study_of_dvc_experiments_prunes_continues_and_names_its_best(repro_clone: Path) -> None:
    """4 trials, 2 at once, the third with a learning rate that cannot learn (pruned after epoch 1 of 2); then the
    same command with search.trials=5 ends with exactly 5. No trial touches the test split: each runs the train stage
    only, no MLflow run holds a test metric, no experiment the evaluate stage's metrics file, and no model version is
    registered though mlflow.registered_model_name is set; ``best --apply`` evaluates the chosen trial once, which
    registers one version and takes the alias."""
    import optuna
    from mlflow import MlflowClient

    clone = repro_clone
    commit_params(clone, {
        "mlflow.log_model": True, "mlflow.registered_model_name": "clf",
        "search.study": "lr", "search.trials": 4, "search.jobs": 2,
        "search.startup_trials": 1,
        "search.space": {"train.base_lr": "loguniform(1e-4, 1e-1)", "train.label_smoothing": "uniform(0.0, 0.2)"},
        "search.first": [{"train.base_lr": 0.003, "train.label_smoothing": 0.1},
                         {"train.base_lr": 0.01, "train.label_smoothing": 0.0},
                         {"train.base_lr": 1e-7, "train.label_smoothing": 0.1}]}, "a search")
    out = said(run(["python", "-m", "ddpipe.search", "run"], cwd=clone, env=CLONE_ENV, timeout=900))

    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(
        str(clone / "search" / "lr" / "study.journal")))
    study = optuna.load_study(study_name="lr", storage=storage)
    states = [t.state.name for t in study.trials]
    assert sorted(states) == sorted(s for s in states if s in ("COMPLETE", "PRUNED")) and len(states) == 4, out
    pruned = [t for t in study.trials if t.state.name == "PRUNED"]
    assert study.trials[2].state.name == "PRUNED" and all(max(t.intermediate_values) < 2 for t in pruned)
    experiments = _experiments(clone)
    for t in study.trials:
        name = f"lr-{t.number}"
        assert (name in experiments) == (t.state.name == "COMPLETE"), (name, list(experiments))
        if name in experiments:
            assert experiments[name]["train"]["base_lr"] == pytest.approx(t.params["train.base_lr"])
            assert experiments[name]["mlflow"]["sweep"] is None  # the study's sweep comes with the trial, not params
    assert {p.name for p in (clone / "search" / "lr").glob("*.png")} >= {"optimization_history.png",
                                                                        "parallel_coordinate.png"}

    run(["python", "-m", "ddpipe.search", "run", "search.trials=5"], cwd=clone, env=CLONE_ENV, timeout=600)
    study = optuna.load_study(study_name="lr", storage=storage)
    assert len(study.trials) == 5 and {t.state.name for t in study.trials} <= {"COMPLETE", "PRUNED"}

    client = MlflowClient(f"sqlite:///{clone}/mlflow.db")
    exp = client.get_experiment_by_name("ddpipe")
    (parent,) = client.search_runs([exp.experiment_id], filter_string="tags.`ddpipe.sweep_parent` = 'true'")
    children = client.search_runs([exp.experiment_id],
                                  filter_string=f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    assert sorted(c.info.run_name for c in children) == [f"lr-{n}" for n in range(5)]
    for c in children:  # each trial ran its own params (trials started together run in workspaces of their own)
        trial = study.trials[int(c.info.run_name.split("-")[1])]
        assert float(c.data.params["train.base_lr"]) == pytest.approx(trial.params["train.base_lr"]), c.info.run_name
    assert {c.info.status for c in children if c.info.run_name == "lr-2"} == {"KILLED"}
    assert not [k for c in children for k in c.data.metrics if k.startswith("test")]
    assert client.search_model_versions("name = 'clf'") == []
    refs = run(["git", "for-each-ref", "--format=%(refname)", "refs/exps"], cwd=clone).stdout.split()
    experiments = _experiments(clone)  # the fifth trial is one more experiment if it completed, none if pruned
    assert sorted(experiments) == sorted(f"lr-{t.number}" for t in study.trials if t.state.name == "COMPLETE")
    for ref in (r for r in refs if r.count("/") >= 4):  # the baseline's test figures are not carried as the trial's:
        held = json.loads(run(["git", "show", f"{ref}:metrics/test.json"], cwd=clone).stdout)["test"]  # how to apply
        assert list(held) == ["apply"] and held["apply"].startswith(f"dvc exp apply {ref.rsplit('/', 1)[1]} "), ref
        # nor dvc.lock's entries of the stages it never ran (evaluate, export): nothing it did not make
        lock = yaml.safe_load(run(["git", "show", f"{ref}:dvc.lock"], cwd=clone).stdout)
        assert set(lock["stages"]) == {"fetch", "prepare", "train"}, (ref, list(lock["stages"]))
    assert "optimization_history.png" in {a.path.rsplit("/", 1)[-1] for a in client.list_artifacts(
        parent.info.run_id, "search")}

    best = json.loads(run(["python", "-m", "ddpipe.search", "best", "--json"], cwd=clone, env=CLONE_ENV).stdout)
    top = study.best_trial
    assert best == {"number": top.number, "params": top.params, "value": top.value, "experiment": f"lr-{top.number}"}
    status = run(["python", "-m", "ddpipe.search", "status"], cwd=clone, env=CLONE_ENV).stdout
    assert "| 2 | PRUNED at epoch 1 |" in status and f"| lr-{top.number} |" in status
    # as in a fresh clone that ran the data stages only: the baseline's evaluate and export outputs not in the cache
    _uncache_stages(clone, ("evaluate", "export"))
    applied = said(run(["python", "-m", "ddpipe.search", "best", "--apply"], cwd=clone, env=CLONE_ENV, timeout=600))
    assert f"$ dvc exp apply lr-{top.number}" in applied and "$ dvc repro" in applied, applied
    assert "up to date" in run(["dvc", "status"], cwd=clone, env=CLONE_ENV).stdout.lower()
    assert json.loads((clone / "metrics" / "test.json").read_text())["test"]["accuracy"] > 0.5
    (chosen,) = [c for c in children if c.info.run_name == f"lr-{top.number}"]
    trials = client.search_runs([exp.experiment_id],
                                filter_string=f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    tested = [c.info.run_name for c in trials if "test_accuracy" in c.data.metrics]
    assert tested == [f"lr-{top.number}"], tested
    (version,) = client.search_model_versions("name = 'clf'")
    assert version.run_id == chosen.info.run_id and version.tags["export_passed"] == "true", version.tags
    assert client.get_model_version_by_alias("clf", "champion").version == version.version
    # issue 61, item 4: the trial's value is its exported model's, the figure the alias is decided by; params.yaml as
    # a plain training's (no sweep of the study: the train stage was not run again); the test recorded once
    assert float(version.tags["model_val_accuracy"]) == pytest.approx(top.value, abs=1e-6), version.tags
    assert yaml.safe_load((clone / "params.yaml").read_text())["mlflow"]["sweep"] is None
    assert "Running stage 'train'" not in applied and "Running stage 'evaluate'" in applied, applied
    again = said(run(["python", "-m", "ddpipe.search", "best", "--apply"], cwd=clone, env=CLONE_ENV, timeout=600))
    assert f"trial {top.number} was tested before" in again, again
    assert "Running stage 'train'" not in again and "Running stage 'evaluate'" not in again, again  # not tested again
    (tested,) = optuna.load_study(study_name="lr", storage=storage).user_attrs["tested"]
    status = run(["python", "-m", "ddpipe.search", "status"], cwd=clone, env=CLONE_ENV).stdout
    assert f"COMPLETE (tested by best --apply: test accuracy {tested['test_accuracy']:.4f})" in status, status
    assert tested["trial"] == top.number and tested["test_accuracy"] == pytest.approx(
        json.loads((clone / "metrics" / "test.json").read_text())["test"]["accuracy"])


def _uncache_stages(repo: Path, stages: tuple[str, ...]) -> None:
    """The objects of ``stages``' outputs (as HEAD's dvc.lock names them) out of ``repo``'s DVC cache, and the files
    out of its workspace: what a clone that never ran those stages has."""
    lock = yaml.safe_load((repo / "dvc.lock").read_text())
    for stage in stages:
        for out in lock["stages"][stage].get("outs", []):
            if md5 := out.get("md5"):
                (repo / ".dvc" / "cache" / "files" / "md5" / md5[:2] / md5[2:]).unlink(missing_ok=True)
            target = repo / out["path"]
            shutil.rmtree(target) if target.is_dir() else target.unlink(missing_ok=True)


def _launcher_of(driver: subprocess.Popen) -> psutil.Process:
    """The train stage's launcher (``python stages/train.py``) under the search's driver."""
    for p in psutil.Process(driver.pid).children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if "stages/train.py" in p.cmdline():
                return p
    raise AssertionError("no stages/train.py under the driver")


def _model_weights(clone: Path, experiment: str) -> dict:
    """The weights of ``experiment``'s model, from the DVC cache by its dvc.lock."""
    (ref,) = [r for r in run(["git", "for-each-ref", "--format=%(refname)", "refs/exps"], cwd=clone).stdout.split()
              if r.endswith(f"/{experiment}")]
    lock = yaml.safe_load(run(["git", "show", f"{ref}:dvc.lock"], cwd=clone).stdout)
    (md5,) = [o["md5"] for o in lock["stages"]["train"]["outs"] if o["path"].endswith("model.pt")]
    return weights(clone / ".dvc" / "cache" / "files" / "md5" / md5[:2] / md5[2:])


@pytest.mark.slow
def test_a_stopped_trial_and_a_killed_driver_resume_bit_equal_under_their_numbers(repro_clone: Path) -> None:
    """Trial 0's training SIGTERMed inside epoch 2: the driver runs it again under number 0 from its step checkpoint.
    Then the driver alone SIGKILLed inside trial 1's epoch 2 (issue 61, item 3): its training runs on, and the same
    command, run again at once, neither removes it nor starts it again beside it: it says so, waits, and records the
    experiment that training finished. The study ends with exactly 2 trials (trial 1 trained by one attempt), one
    MLflow run each, and both models are bit-equal to an uninterrupted study's."""
    import optuna
    from mlflow import MlflowClient

    clone = repro_clone
    commit_params(clone, {
        "num_epochs": 3, "mlflow.log_model": False,
        "train.checkpoint_every_steps": 2,  # a moment inside epoch 2 to stop at, however fast the host
        "distributed.threads_per_process": 1,  # the same arithmetic whatever else runs on the host
        "search.study": "r", "search.trials": 2, "search.jobs": 1,
        "search.space": {"train.base_lr": "loguniform(1e-4, 1e-1)"},
        "search.first": [{"train.base_lr": 0.003}, {"train.base_lr": 0.01}]}, "a search")
    folder, log = clone / "search" / "r", clone / "driver.log"
    with open(log, "w") as out:
        driver = subprocess.Popen([sys.executable, "-m", "ddpipe.search", "run"], cwd=clone, stdout=out,
                                  stderr=subprocess.STDOUT, env=subprocess_env(CLONE_ENV), start_new_session=True)
        try:
            wait_for_step_checkpoint(folder / "trial-0" / "checkpoints", 2, 2, lambda: driver.poll() is None)
            _launcher_of(driver).send_signal(signal.SIGTERM)
            wait_for_step_checkpoint(folder / "trial-1" / "checkpoints", 2, 2, lambda: driver.poll() is None)
            driver.kill()  # the driver alone: trial 1's dvc exp run and training go on
            driver.wait()
            assert training_processes(str(folder / "trial-1")), "trial 1's training did not outlive its driver"
            again = said(run([sys.executable, "-m", "ddpipe.search", "run"], cwd=clone, env=CLONE_ENV, timeout=600))
        finally:
            kill_all(str(clone))
    first = log.read_text()
    assert "trial 0: training stopped by SIGTERM at epoch 2" in first and "trial 0 (attempt 2)" in first, first[-3000:]
    assert "trial 1 lost its driver, and its training still runs" in again and "attempt 2" not in again, again
    assert "trial 1: its DVC experiment r-1 was finished: completed" in again, again

    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(folder / "study.journal")))
    study = optuna.load_study(study_name="r", storage=storage)
    assert [(t.state.name, t.user_attrs["attempts"]) for t in study.trials] == [("COMPLETE", 2), ("COMPLETE", 1)]
    assert not (folder / "trial-0").exists() and not (folder / "trial-1").exists()  # checkpoints go with the trial

    client = MlflowClient(f"sqlite:///{clone}/mlflow.db")
    children = client.search_runs([client.get_experiment_by_name("ddpipe").experiment_id],
                                  filter_string="tags.`mlflow.runName` LIKE 'r-%'")
    assert sorted((c.info.run_name, c.info.status) for c in children) == [("r-0", "FINISHED"), ("r-1", "FINISHED")]

    run([sys.executable, "-m", "ddpipe.search", "run", "search.study=u"], cwd=clone, env=CLONE_ENV, timeout=600)
    for n in (0, 1):
        assert same_weights(_model_weights(clone, f"r-{n}"), _model_weights(clone, f"u-{n}")), f"trial {n}"


def _study_with_experiments(repo: Path) -> None:
    """A study ``t`` of six trials in ``repo``'s journal and the DVC experiments its trials left, each saved for real
    with ``dvc exp save`` after an edit of params.yaml: trials 0, 1 (the best), 4 completed; 2 pruned (none); 3 failed
    after its experiment was saved; 5 running (its driver records it from its experiment); ``t-9``, no trial of the
    study; ``u-1``, another study's."""
    import optuna
    from optuna.trial import TrialState, create_trial

    from ddpipe.core.trials import open_storage

    params = yaml.safe_load(PARAMS.read_text())
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    for cmd in (["git", "init", "-q"], ["dvc", "init", "-q"], ["git", "add", "-A"], ["git", "commit", "-qm", "base"]):
        run(cmd, cwd=repo, env=GIT_ENV)
    (repo / "search" / "t").mkdir(parents=True)
    study = optuna.create_study(study_name="t", direction="maximize",
                                storage=open_storage(str(repo / "search" / "t" / "study.journal")))
    dist = {"train.base_lr": optuna.distributions.FloatDistribution(1e-4, 1e-1, log=True)}
    for number, state, value in ((0, TrialState.COMPLETE, 0.5), (1, TrialState.COMPLETE, 0.9),
                                 (2, TrialState.PRUNED, None), (3, TrialState.FAIL, None),
                                 (4, TrialState.COMPLETE, 0.7)):
        study.add_trial(create_trial(state=state, value=value, params={"train.base_lr": 0.001 * (number + 1)},
                                     distributions=dist, user_attrs={"experiment": f"t-{number}"}))
    study.ask(dist).set_user_attr("experiment", "t-5")
    for name in ("t-0", "t-1", "t-3", "t-4", "t-5", "t-9", "u-1"):
        params["train"]["base_lr"] = float(len(name) + int(name[-1])) / 1000
        (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
        run(["dvc", "exp", "save", "-q", "-n", name], cwd=repo, env=GIT_ENV)


def test_remove_keeps_the_best_trials_experiments_and_leaves_the_study_whole(
        tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """``remove --keep 1`` leaves the best trial's experiment, a running trial's and those that are no trial of the
    study; a bad --keep removes nothing (exit 2, naming it); --dry-run lists without removing; the study keeps every
    trial, ``status`` says which experiments went, and ``best`` names the kept one, or none after --keep 0."""
    from ddpipe.search.study_commands import main
    from tests.conftest import VENV_BIN

    repo = tmp_path / "repo"
    repo.mkdir()
    _study_with_experiments(repo)
    monkeypatch.chdir(repo)
    monkeypatch.setenv(REPO_ROOT_ENV, str(repo))
    monkeypatch.setenv("PATH", f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    everything = sorted(_experiments(repo))
    assert everything == ["t-0", "t-1", "t-3", "t-4", "t-5", "t-9", "u-1"]
    study = ["search.study=t", LR]

    for bad, shown in ((["--keep", "-1"], "--keep = '-1' is not"), (["--keep=x"], "--keep = 'x' is not"),
                       (["--keep"], "--keep without a value is not")):
        with pytest.raises(SystemExit) as exits:
            main(["remove", *study, *bad])
        assert exits.value.code == 2
        assert f"error: {shown} accepted; expected an integer >= 0" in capsys.readouterr().err
    assert sorted(_experiments(repo)) == everything

    assert main(["remove", "--keep", "1", "--dry-run", *study]) == 0
    out = capsys.readouterr().out
    assert "would remove 3 DVC experiment(s) (dry run: nothing removed): t-0, t-3, t-4" in out, out
    assert "left alone: t-5 (trial 5 is RUNNING)" in out and "left alone: t-9 (no trial 9 in study t)" in out
    assert sorted(_experiments(repo)) == everything

    assert main(["remove", "--keep", "1", *study]) == 0
    assert "removed 3 DVC experiment(s) in 1 call(s) of dvc exp remove: t-0, t-3, t-4" in capsys.readouterr().out
    assert sorted(_experiments(repo)) == ["t-1", "t-5", "t-9", "u-1"]
    assert main(["best", "--json", *study]) == 0
    assert json.loads(capsys.readouterr().out)["experiment"] == "t-1"
    assert main(["status", *study]) == 0
    table = capsys.readouterr().out
    assert table.count("| removed |") == 3 and "| t-1 |" in table and "| 2 | PRUNED |" in table
    assert "3 COMPLETE, 1 FAIL, 1 PRUNED, 1 RUNNING" in table  # the study keeps every trial

    assert main(["remove", "--keep=0", *study]) == 0
    assert "removed 1 DVC experiment(s) in 1 call(s) of dvc exp remove: t-1" in capsys.readouterr().out
    assert sorted(_experiments(repo)) == ["t-5", "t-9", "u-1"]
    assert main(["best", "--json", *study]) == 0
    assert json.loads(capsys.readouterr().out) == {"number": 1, "params": {"train.base_lr": 0.002}, "value": 0.9,
                                                   "experiment": None}
