"""Drivers of one study side by side (issue 47, item 2): seeded apart, the ``first`` trials run once in all, a dead
driver's trial taken over by exactly one, a trial another driver finished skipped, never a crash; and two whole
``run`` loops started at the same instant on a journal file, their trials a fake training (no DVC, no torch), end
with the study's trials, none run twice."""

from __future__ import annotations

import multiprocessing
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ddpipe.config.load import load_config
from ddpipe.search.space import make_plan
from tests.conftest import PARAMS, dead_pid

LR = "search.space.train.base_lr=loguniform(1e-4, 1e-1)"

# A trial's training, faked: it reports one epoch's value (larger nearer lr 0.01) to its trial, as the training's
# pruning hook does, and exits 0
FAKE_TRAINING = """
import json, math, os
import optuna
from ddpipe.core.environment import TRIAL_ENV
from ddpipe.core.trials import open_storage
spec = json.loads(os.environ[TRIAL_ENV])
study = optuna.load_study(study_name=spec["study"], storage=open_storage(spec["storage"]))
trial = optuna.trial.Trial(study, spec["trial_id"])
value = -abs(math.log10(trial.params["train.base_lr"]) + 2.0)
trial.report(value, 1)
trial.set_user_attr("exported", {"epoch": 1, "weights": "raw", "value": value})
"""


def _plan(tmp: Path, *overrides: str):
    return make_plan(load_config([LR, *overrides], params_file=PARAMS), tmp, PARAMS)


def _fake_trials(monkeypatch: pytest.MonkeyPatch, tmp: Path) -> None:
    """The driver's trials run FAKE_TRAINING in an empty folder instead of ``dvc exp run`` in a clone."""
    from ddpipe.search import driver

    def workspace(plan, trial, root, say):
        ws = driver.trial_workspace(plan, trial.number)
        ws.mkdir(parents=True, exist_ok=True)
        return ws

    monkeypatch.setattr(driver, "prepare_workspace", workspace)
    monkeypatch.setattr(driver, "command", lambda plan, trial: [sys.executable, "-c", FAKE_TRAINING])
    monkeypatch.setattr(driver, "send_back", lambda plan, root, number: "")
    monkeypatch.setattr(driver, "POLL_S", 0.1)


def _drive(plan, root: Path, barrier, log: Path) -> None:
    """One ``search run``'s loop in a forked process, started with the others at the barrier."""
    from ddpipe.search import driver

    with open(log, "w") as out:
        barrier.wait()
        driver.run(plan, root, say=lambda line: print(line, file=out, flush=True))


def test_drivers_started_together_never_run_the_same_params_and_end_the_study_together(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two drivers of one study (random sampler, one job each, 6 trials, one ``first`` trial) started at the same
    instant: 6 or 7 finished (at most one over per extra driver), none RUNNING, no learning rate twice, the first
    trial run once. Seeded from ``seed + len(trials)`` alone, both drew the same learning rates."""
    _fake_trials(monkeypatch, tmp_path)
    plan = _plan(tmp_path, "search.study=pair", "search.sampler=random", "search.trials=6", "search.jobs=1",
                 "search.pruner=none", "search.first=[{train.base_lr: 0.003}]")
    from ddpipe.search.study import load_study, open_study

    open_study(plan)  # made, its first trial enqueued: both drivers open it holding the same one trial
    fork = multiprocessing.get_context("fork")
    barrier = fork.Barrier(2)
    drivers = [fork.Process(target=_drive, args=(plan, tmp_path, barrier, tmp_path / f"driver-{i}.log"))
               for i in range(2)]
    for d in drivers:
        d.start()
    for d in drivers:
        d.join(120)
    logs = "\n".join((tmp_path / f"driver-{i}.log").read_text() for i in range(2))
    assert [d.exitcode for d in drivers] == [0, 0], logs
    trials = load_study(plan).get_trials(deepcopy=False)
    states = [t.state.name for t in trials]
    done = [t for t in trials if t.state.name == "COMPLETE"]
    assert "RUNNING" not in states and "WAITING" not in states, states
    assert len(done) in (6, 7), (states, logs)
    assert all(t.state.name == "COMPLETE" or "a second copy of search.first[0]" in t.user_attrs["failure"]
               for t in trials), logs
    rates = [t.params["train.base_lr"] for t in done]
    assert len(set(rates)) == len(rates), rates
    assert rates.count(0.003) == 1, rates
    assert {t.user_attrs["driver"]["pid"] for t in done} == {d.pid for d in drivers}, "both drivers ran trials"


def test_each_driver_draws_apart_and_tpe_lies_about_running_trials(tmp_path: Path) -> None:
    """Two drivers opening one study with the same history get different seeds; one driver, the same history, the
    same seed; TPE is built with constant_liar."""
    from ddpipe.search.study import driver_mark, sampler, sampler_seed

    me = driver_mark()
    other = {**me, "pid": me["pid"] + 1}
    assert sampler_seed(42, 3, me) == sampler_seed(42, 3, dict(me))
    assert len({sampler_seed(42, 3, me), sampler_seed(42, 3, other), sampler_seed(42, 4, me),
                sampler_seed(43, 3, me)}) == 4
    assert sampler(_plan(tmp_path), 0, me)._constant_liar is True


def test_a_first_trial_enqueued_by_two_drivers_runs_once(tmp_path: Path) -> None:
    """Both drivers of a new study enqueued search.first (they opened it at the same instant): the lowest copy of
    each index runs, a later copy is failed unrun saying which trial runs it, and the study is asked again."""
    from ddpipe.search.driver import ask
    from ddpipe.search.study import FIRST, open_study

    plan = _plan(tmp_path, "search.study=f", "search.first=[{train.base_lr: 0.003}, {train.base_lr: 0.01}]")
    study = open_study(plan)  # enqueues trials 0 and 1
    for index, params in enumerate(plan.first):  # the other driver's copies: trials 2 and 3
        study.enqueue_trial(params, user_attrs={FIRST: index})
    said: list[str] = []
    taken = [ask(plan, study, said.append) for _ in range(3)]
    assert [t.number for t in taken[:2]] == [0, 1]
    assert taken[2].number == 4 and FIRST not in taken[2].user_attrs  # the sampler's, after both copies
    frozen = study.get_trials(deepcopy=False)
    assert [t.state.name for t in frozen] == ["RUNNING", "RUNNING", "FAIL", "FAIL", "RUNNING"]
    assert frozen[3].user_attrs["failure"].startswith("a second copy of search.first[1]")
    assert said == ["trial 2: not run, a copy of trial 0 (search.first enqueued by two drivers at once)",
                    "trial 3: not run, a copy of trial 1 (search.first enqueued by two drivers at once)"]


def _take_over(plan, barrier, out) -> None:
    from ddpipe.search.study import open_study, orphans

    study = open_study(plan)
    barrier.wait()
    out.put([t.number for t in orphans(study, plan.storage, lambda number: [])[0]])
    barrier.wait()  # alive until every driver has looked: a driver gone meanwhile leaves its trials to the others


def test_a_dead_drivers_trials_are_taken_over_by_exactly_one_driver(tmp_path: Path) -> None:
    """Twelve trials of a driver that died; three drivers take over at the same instant: each trial is taken once
    (read and rewritten under one lock per study on this host), every one of them by someone."""
    import socket

    from ddpipe.core.processes import start_time
    from ddpipe.search.study import open_study

    plan = _plan(tmp_path, "search.study=o", "search.first=[]")
    study = open_study(plan)
    dead = dead_pid()
    mark = {"host": socket.gethostname(), "pid": dead, "started": start_time(dead)}
    for _ in range(12):
        study.ask({k: d.to_optuna() for k, d in plan.space.items()}).set_user_attr("driver", mark)
    fork = multiprocessing.get_context("fork")
    barrier, out = fork.Barrier(3), fork.Queue()
    takers = [fork.Process(target=_take_over, args=(plan, barrier, out)) for _ in range(3)]
    for t in takers:
        t.start()
    taken = [out.get(timeout=60) for _ in takers]
    for t in takers:
        t.join(30)
    assert sorted(n for got in taken for n in got) == list(range(12)), taken
    owners = {t.user_attrs["driver"]["pid"] for t in open_study(plan).get_trials(deepcopy=False)}
    assert owners <= {t.pid for t in takers} and dead not in owners


def test_a_trial_whose_driver_died_alone_is_left_to_its_live_training_then_taken_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Trial 0's driver is killed alone while its training runs on (a process working in the trial's folder, as a
    ``dvc exp run`` and its workers do): the next ``run`` neither removes its folder nor starts it again beside it; it
    says so, beats it, finishes the other trials, and takes trial 0 over once its training has ended: it sends and
    tells it, and the study ends with its 3 trials, trial 0 run by one attempt."""
    from optuna.trial import TrialState

    from ddpipe.search import driver
    from ddpipe.search.study import open_study

    _fake_trials(monkeypatch, tmp_path)
    plan = _plan(tmp_path, "search.study=w", "search.first=[]", "search.sampler=random", "search.trials=3",
                 "search.jobs=1", "search.pruner=none")
    study = open_study(plan)
    trial = study.ask({k: d.to_optuna() for k, d in plan.space.items()})
    dead = dead_pid()
    trial.set_user_attr("driver", {"host": driver.driver_mark()["host"], "pid": dead, "started": "0"})
    trial.set_user_attr("attempts", 1)
    folder = driver.trial_workspace(plan, 0)
    folder.mkdir(parents=True)
    (folder / "kept").write_text("the live training's")
    # the training its dead driver left: reports its epoch after 3 s (while the new driver runs trials 1 and 2), ends
    training = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3)\n" + FAKE_TRAINING], cwd=folder,
                                env={**__import__("os").environ, driver.TRIAL_ENV: __import__("json").dumps(
                                    {"storage": plan.storage, "study": "w", "trial_id": trial._trial_id})})
    started: list[int] = []
    real_start = driver.start
    monkeypatch.setattr(driver, "start", lambda *a, **k: started.append(k.get("resumed") is not None) or
                        real_start(*a, **k))
    said: list[str] = []
    try:
        driver.run(plan, tmp_path, say=said.append)
    finally:
        training.kill()
    text = "\n".join(said)
    assert f"trial 0 lost its driver, and its training still runs (pids {training.pid}" in text, text
    assert (folder / "kept").exists() or "trial 0: its DVC experiment w-0 was finished: completed" in text, text
    assert started == [False, False], (started, text)  # trials 1 and 2 started; trial 0 never again
    trials = open_study(plan).get_trials(deepcopy=False)
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 3, text
    assert trials[0].user_attrs["attempts"] == 1 and "trial 0: its DVC experiment w-0 was finished" in text, text


def test_a_journal_trial_held_on_another_host_is_left_running_and_named(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A journal file has no heartbeat: a trial RUNNING under a driver on another host (a login node sharing the
    file) is neither taken over nor run again beside it; ``run`` finishes what it may, counts that trial as in flight
    and says, at its start and its end, which trial, which host and what to do."""
    from optuna.trial import TrialState

    from ddpipe.search import driver
    from ddpipe.search.study import open_study

    _fake_trials(monkeypatch, tmp_path)
    plan = _plan(tmp_path, "search.study=h", "search.first=[]", "search.sampler=random", "search.trials=3",
                 "search.jobs=1", "search.pruner=none")
    study = open_study(plan)
    study.ask({k: d.to_optuna() for k, d in plan.space.items()}).set_user_attr(
        "driver", {"host": "login-b.invalid", "pid": 4242, "started": "0"})
    said: list[str] = []
    driver.run(plan, tmp_path, say=said.append)
    states = [t.state for t in open_study(plan).get_trials(deepcopy=False)]
    assert states[0] == TrialState.RUNNING and states[1:] == [TrialState.COMPLETE] * 2, states
    notes = [line for line in said if "login-b.invalid" in line]
    assert len(notes) == 2 and all("trial(s) 0 are RUNNING" in n and "no heartbeat" in n for n in notes), said


def test_a_finished_trial_whose_experiment_cannot_be_sent_back_is_kept_named_and_sent_by_the_next_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Trial 1 finishes but its experiment's ``git push`` back fails, at its end and again at the run's end: it is not
    told FAIL and nothing of it is removed (its folder, its checkpoints); it stays RUNNING, ``status`` says why, and no
    other trial is run in its place. Its driver gone, the next ``run`` sends it and tells it COMPLETE."""
    from optuna.trial import TrialState

    from ddpipe.search import driver
    from ddpipe.search.report import status
    from ddpipe.search.study import open_study

    _fake_trials(monkeypatch, tmp_path)
    refused = "git push of refs/exps/x/u-1 from ws to repo failed"
    monkeypatch.setattr(driver, "send_back", lambda plan, root, number: refused if number == 1 else "")
    plan = _plan(tmp_path, "search.study=u", "search.first=[]", "search.sampler=random", "search.trials=3",
                 "search.jobs=1", "search.pruner=none")
    said: list[str] = []
    driver.run(plan, tmp_path, say=said.append)
    study = open_study(plan)
    trials = study.get_trials(deepcopy=False)
    assert [t.state for t in trials] == [TrialState.COMPLETE, TrialState.RUNNING, TrialState.COMPLETE], said
    assert trials[1].user_attrs["unsent"] == refused and driver.trial_folder(plan, 1).is_dir()
    assert f"trial 1: finished, but {refused}" in "\n".join(said) and "still not sent back" in said[-1], said
    assert f"RUNNING (finished, its experiment not sent back: {refused}; the next run sends it)" in status(study)

    study._storage.set_trial_user_attr(trials[1]._trial_id, "driver", {"host": driver.driver_mark()["host"],
                                                                         "pid": 2**22 + 11, "started": "0"})
    monkeypatch.setattr(driver, "send_back", lambda plan, root, number: "")
    driver.run(plan, tmp_path, say=said.append)
    trials = open_study(plan).get_trials(deepcopy=False)
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 3 and not driver.trial_folder(plan, 1).exists()
    assert any("trial 1: its DVC experiment u-1 was finished: completed" in line for line in said), said


def test_the_heartbeat_beats_from_its_own_thread_while_the_driver_is_busy_and_an_outage_stops_no_training(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A database study, an 8 s grace: sending trial 0's experiment back takes 10 s, while another driver looks for
    stale trials every 0.2 s; the heartbeat's own thread keeps every held trial alive, none is failed. Then the
    database stops answering the driver's loop for three polls and refuses every heartbeat: the driver says so once,
    its trainings go on, and the study ends with all its trials completed."""
    import sqlalchemy.exc
    from optuna.trial import TrialState

    from ddpipe.search import driver
    from ddpipe.search import study as studies

    _fake_trials(monkeypatch, tmp_path)
    monkeypatch.setattr(studies, "HEARTBEAT_S", 0.3)
    # a grace of 8 s: a beat held up by another connection's SQLite write lock on a loaded host (SQLite waits up to
    # 5 s for it) is no missed beat; the send-back outlasts it
    monkeypatch.setattr(studies, "GRACE_S", 8.0)
    monkeypatch.setattr(driver, "send_back", lambda plan, root, number: time.sleep(10 if number == 0 else 0) or "")
    plan = _plan(tmp_path, "search.study=hb", f"search.storage=sqlite:///{tmp_path}/study.db", "search.first=[]",
                 "search.sampler=random", "search.trials=2", "search.jobs=1", "search.pruner=none")
    elsewhere, closed, done = studies.open_study(plan), [], threading.Event()

    def another_driver() -> None:  # (one that fails a trial stops there, so that a failing driver ends)
        while not done.is_set() and not closed:
            closed.extend(studies.close_stale(elsewhere))
            time.sleep(0.2)

    watcher = threading.Thread(target=another_driver)
    watcher.start()
    said: list[str] = []
    try:
        driver.run(plan, tmp_path, say=said.append)
    finally:
        done.set()
        watcher.join()
    assert closed == [] and [t.state for t in elsewhere.get_trials(deepcopy=False)] == [TrialState.COMPLETE] * 2, said

    calls = {"n": 0}
    real_finished = driver.finished

    def flaky(study):  # noqa: ANN001, ANN202
        calls["n"] += 1
        if 3 <= calls["n"] <= 5:
            raise sqlalchemy.exc.OperationalError("SELECT", {}, Exception("could not connect to server"))
        return real_finished(study)

    def refused(self, trial_id):  # noqa: ANN001, ANN202
        raise sqlalchemy.exc.OperationalError("UPDATE", {}, Exception("could not connect to server"))

    monkeypatch.setattr(driver, "finished", flaky)
    monkeypatch.setattr(type(elsewhere._storage), "record_heartbeat", refused)
    said.clear()
    more = _plan(tmp_path, "search.study=hb", f"search.storage=sqlite:///{tmp_path}/study.db", "search.first=[]",
                 "search.sampler=random", "search.trials=4", "search.jobs=1", "search.pruner=none")
    driver.run(more, tmp_path, say=said.append)
    assert [t.state for t in elsewhere.get_trials(deepcopy=False)] == [TrialState.COMPLETE] * 4, said
    text = "\n".join(said)
    assert text.count("the study's storage does not answer") == 1 and "answers again" in text, said
    assert text.count("did not take the heartbeat") == 1, said


def test_a_trial_another_driver_finished_is_skipped_not_a_crash(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """This driver's trial ended, but another driver (a database's, after this one's heartbeat went quiet) had failed
    it meanwhile: ``record`` says so and returns SKIPPED; the trial keeps the other driver's verdict."""
    import optuna

    from ddpipe.search import driver
    from ddpipe.search.driver import Running, record
    from ddpipe.search.study import open_study

    monkeypatch.setattr(driver, "send_back", lambda plan, root, number: "")  # its experiment is back
    plan = _plan(tmp_path, "search.study=t", "search.first=[]")
    plan.folder.mkdir(parents=True)
    study, elsewhere = open_study(plan), open_study(plan)
    trial = study.ask({k: d.to_optuna() for k, d in plan.space.items()})
    trial.set_user_attr("experiment", "t-0")
    trial.report(0.5, 1)
    elsewhere.tell(trial.number, state=optuna.trial.TrialState.FAIL)
    for code in ("true", "false"):  # completed, then failed: both told too late
        done = subprocess.Popen([code])
        done.wait()
        said: list[str] = []
        assert record(plan, study, tmp_path, Running(trial, done, plan.folder / "t.log", 1), said.append) == "SKIPPED"
        assert said == ["trial 0: already FAIL, finished by another driver; not told again"]
    assert [t.state.name for t in study.get_trials(deepcopy=False)] == ["FAIL"]


def test_a_trial_trains_only_registers_nothing_and_carries_no_test_figures(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A trial's command runs the train stage alone; the files its workspace drops before it runs are exactly the
    evaluate and export stages' git-tracked outputs in dvc.yaml (so its experiment holds no test figure); its
    training registers no model version whatever mlflow.registered_model_name says, and keeps its checkpoints in the
    trial's own folder. Outside a search, the config is left as it is."""
    import json

    import optuna
    import yaml

    from ddpipe.core.environment import TRIAL_ENV
    from ddpipe.engine.pruning import trial_config
    from ddpipe.search.driver import command

    plan = _plan(tmp_path, "search.study=c", "search.first=[]")
    trial = optuna.create_study().ask({k: d.to_optuna() for k, d in plan.space.items()})
    cmd = command(plan, trial)
    assert cmd[:5] == ["dvc", "exp", "run", "-n", "c-0"] and cmd[-1] == "train" and "evaluate" not in cmd

    cfg = load_config(["mlflow.registered_model_name=clf"], params_file=PARAMS)
    stages = yaml.safe_load((PARAMS.parent / "dvc.yaml").read_text())["stages"]
    tracked = {getattr(cfg.paths, key.removeprefix("${paths.").removesuffix("}"))
               for stage in ("evaluate", "export") for kind in ("outs", "metrics", "plots")
               for entry in stages[stage].get(kind, []) if isinstance(entry, dict)
               for key, options in entry.items() if options.get("cache") is False}
    assert set(plan.held_out) == tracked and cfg.paths.test_metrics in tracked

    assert trial_config(cfg) is cfg
    monkeypatch.setenv(TRIAL_ENV, json.dumps({"checkpoints": str(tmp_path / "trial-0" / "checkpoints")}))
    in_trial = trial_config(cfg)
    assert in_trial.mlflow.registered_model_name is None and cfg.mlflow.registered_model_name == "clf"
    assert in_trial.paths.checkpoints == str(tmp_path / "trial-0" / "checkpoints")


# A trial's training of 9 epochs, faked: each epoch's validation accuracy (higher nearer lr 0.01, rising with the
# epochs) goes through the training's own pruning hook (SearchTrial: report, then ask the study's pruner); a pruned
# training ends as a pruned one does, its stage failed
FAKE_EPOCHS = """
import json, math, os, sys
from ddpipe.core.ranks import DistInfo
from ddpipe.core.history import EpochStats
from ddpipe.core.environment import TRIAL_ENV
from ddpipe.engine.pruning import SearchTrial, after_training, validation_number
spec = json.loads(os.environ[TRIAL_ENV])
trial = SearchTrial(spec, DistInfo())
quality = 1.0 - abs(math.log10(trial.trial.params["train.base_lr"]) + 2.0) / 3.0
history = []
for epoch in range(1, 10):
    acc = quality * (1.0 - 0.5 ** epoch)
    history.append(EpochStats(epoch, 1 - acc, acc, 1 - acc, acc, 0.01, 1.0, 1.0))
    if trial.should_stop(history[-1].logged(), validation_number(epoch, 0, 10, 0, 9), None):
        sys.exit(1)
after_training(DistInfo(), history, 9, "raw")  # the value of the model it hands on, as the training's end tells it
"""

# The same, 3 epochs of 10 steps validated after step 5 too (train.val_every_n_steps=5): the pruner's steps are the
# validations; a validation inside an epoch reads 0.2 higher than the epoch's end, which alone makes a trial's value
FAKE_STEPS = """
import json, math, os, sys
from ddpipe.core.ranks import DistInfo
from ddpipe.core.environment import TRIAL_ENV
from ddpipe.engine.pruning import SearchTrial, validation_number
trial = SearchTrial(json.loads(os.environ[TRIAL_ENV]), DistInfo())
quality = 1.0 - abs(math.log10(trial.trial.params["train.base_lr"]) + 2.0) / 3.0
for epoch in range(1, 4):
    for step in (5, 0):
        acc = quality * (1.0 - 0.5 ** epoch) + (0.2 if step else 0.0)
        if trial.should_stop({"val_accuracy": acc}, validation_number(epoch, step, 10, 5, 3), None):
            sys.exit(1)
trial.trial.set_user_attr("exported", {"epoch": 3, "weights": "raw", "value": acc})  # as the training's end tells it
"""


def test_validations_inside_epochs_let_the_pruner_stop_a_trial_in_its_first_epoch(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With train.val_every_n_steps the pruner is asked at every validation, numbered over the run (2 an epoch here):
    the trials worse than the first at its first validation are pruned there, at step 5 of epoch 1, and say so; a
    trial's value is the best of its epochs' ends (the weights it may export), never a validation inside one."""
    from ddpipe.engine.pruning import validation_number
    from ddpipe.search import driver
    from ddpipe.search.study import open_study

    assert [validation_number(e, s, 16, 5, 2).number for e, s in ((1, 5), (1, 10), (1, 15), (1, 0), (2, 5), (2, 0))] \
        == [1, 2, 3, 4, 5, 8]
    assert validation_number(2, 0, 16, 0, 2).number == 2 and validation_number(1, 0, 16, 16, 2).last == 2
    _fake_trials(monkeypatch, tmp_path)
    monkeypatch.setattr(driver, "command", lambda plan, trial: [sys.executable, "-c", FAKE_STEPS])
    plan = _plan(tmp_path, "search.study=inside", "search.sampler=random", "search.trials=4", "search.jobs=1",
                 "search.pruner=median", "search.startup_trials=1", "search.first=[{train.base_lr: 0.01}]",
                 "train.val_every_n_steps=5")
    said: list[str] = []
    driver.run(plan, tmp_path, say=said.append)
    trials = open_study(plan).get_trials(deepcopy=False)
    assert trials[0].state.name == "COMPLETE" and trials[0].value == pytest.approx(0.875)  # 1 - 0.5 ** 3
    assert sorted(trials[0].intermediate_values) == [1, 2, 3, 4, 5, 6]
    pruned = [t for t in trials if t.state.name == "PRUNED"]
    assert pruned and all((t.user_attrs["pruned_epoch"], t.user_attrs["pruned_step"]) == (1, 5) and
                          list(t.intermediate_values) == [1] for t in pruned), said
    assert any("pruned at step 5 of epoch 1" in line for line in said), said


# The 8 trials' learning rates, the best first: fixed, for Hyperband's decisions to be the same in every run (the random
# sampler of a driver is seeded apart per host and process)
FIXED_LRS = "search.first=[" + ", ".join(f"{{train.base_lr: {lr}}}" for lr in (
    0.01, 0.0002, 0.05, 0.0005, 0.1, 0.001, 0.0001, 0.003)) + "]"


def test_hyperband_prunes_trials_at_its_rungs_and_keeps_the_best(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """search.pruner=hyperband through a study's whole run (9-epoch trainings, faked; the best learning rate first):
    the first trial completes all 9 epochs (it sets Hyperband's max resource), the study ends with its 8 trials
    finished, some pruned, each after an epoch that is one of its bracket's rungs (1 or 3 of 9: min resource 1,
    reduction factor 3), and the best trial is the first."""
    from ddpipe.search import driver
    from ddpipe.search.study import open_study

    _fake_trials(monkeypatch, tmp_path)
    monkeypatch.setattr(driver, "command", lambda plan, trial: [sys.executable, "-c", FAKE_EPOCHS])
    plan = _plan(tmp_path, "search.study=hb", "search.sampler=random", "search.trials=8", "search.jobs=1",
                 "search.pruner=hyperband", FIXED_LRS)
    said: list[str] = []
    driver.run(plan, tmp_path, say=said.append)
    study = open_study(plan)
    trials = study.get_trials(deepcopy=False)
    states = [t.state.name for t in trials]
    assert len(trials) == 8 and set(states) == {"COMPLETE", "PRUNED"}, (states, said)
    assert max(trials[0].intermediate_values) == 9 and study.best_trial.number == 0
    pruned = [t for t in trials if t.state.name == "PRUNED"]
    assert pruned and all(t.user_attrs["pruned_epoch"] == max(t.intermediate_values) and
                          t.user_attrs["pruned_epoch"] in (1, 3) for t in pruned), \
        [(t.number, t.user_attrs.get("pruned_epoch"), sorted(t.intermediate_values)) for t in pruned]
    assert all(max(t.intermediate_values) == 9 for t in trials if t.state.name == "COMPLETE")


def test_a_database_trial_whose_driver_elsewhere_dies_is_run_again_after_its_heartbeat_not_before(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A database study (SQLite here; PostgreSQL alike) with two trials of a driver on another host: one it pruned
    just before it died, one RUNNING whose heartbeat that driver keeps until this driver, its own trials done, is
    waiting for it (a second more), then stops (it died). Only after the heartbeat has been silent for the grace
    period is the trial failed and its params run again here: the study ends with its 4 finished, the pruned trial
    still PRUNED."""
    import datetime
    import threading

    import optuna
    from optuna.trial import TrialState

    from ddpipe.search import driver
    from ddpipe.search import study as studies

    _fake_trials(monkeypatch, tmp_path)
    monkeypatch.setattr(studies, "HEARTBEAT_S", 0.5)
    monkeypatch.setattr(studies, "GRACE_S", 2)
    plan = _plan(tmp_path, "search.study=db", f"search.storage=sqlite:///{tmp_path}/study.db", "search.first=[]",
                 "search.sampler=random", "search.trials=4", "search.jobs=1", "search.pruner=none")
    study = studies.open_study(plan)
    elsewhere = {"host": "login-b.invalid", "pid": 4242, "started": "0"}
    space = {k: d.to_optuna() for k, d in plan.space.items()}
    pruned, held = study.ask(space), study.ask(space)
    for trial in (pruned, held):
        trial.set_user_attr("driver", elsewhere)
        study._storage.record_heartbeat(trial._trial_id)
    pruned.report(-3.0, 1)
    study.tell(pruned, state=TrialState.PRUNED)
    died: list[datetime.datetime] = []
    said: list[str] = []

    def beat() -> None:  # the other host's driver, alive until this one waits for it, and a second more
        deadline, waiting = time.time() + 300, None
        while time.time() < deadline and (waiting is None or time.time() < waiting + 1):
            study._storage.record_heartbeat(held._trial_id)
            if waiting is None and any("waiting for trial(s) held by other drivers" in line for line in said):
                waiting = time.time()
            time.sleep(0.2)
        died.append(datetime.datetime.now())  # Optuna's clock for a trial's start and end

    beater = threading.Thread(target=beat)
    beater.start()
    driver.run(plan, tmp_path, say=said.append)
    beater.join()
    trials = studies.open_study(plan).get_trials(deepcopy=False)
    states = [t.state for t in trials]
    assert states[:2] == [TrialState.PRUNED, TrialState.FAIL], (states, said)
    assert sum(s in (TrialState.COMPLETE, TrialState.PRUNED) for s in states) == 4 and TrialState.RUNNING not in states
    retried = optuna.storages.RetryHeartbeatStaleTrialCallback.retried_trial_number
    (again,) = [t for t in trials if retried(t) == held.number]
    assert again.state == TrialState.COMPLETE and again.params == held.params
    assert died and trials[1].datetime_complete >= died[0]  # failed once silent, never while its driver beat
    assert again.datetime_start >= trials[1].datetime_complete
    assert any("waiting for trial(s) held by other drivers" in line for line in said), said
    assert any("trial(s) 1 had no driver any more" in line for line in said), said
    assert optuna.load_study(study_name="db", storage=plan.storage).best_trial.number != 1


# A trial's training, faked: above a learning rate of 0.3 it diverges in epoch 1 (telling the study what the
# training's hook, ddpipe.engine.pruning.after_divergence, tells it: tests/test_faults.py, and failing, as the worker
# does); below, it reports one epoch's value, larger nearer lr 0.01
DIVERGING_TRAINING = """
import json, math, os, sys
import optuna
from optuna.storages import JournalStorage
from optuna.storages.journal import JournalFileBackend
from ddpipe.core.environment import TRIAL_ENV
spec = json.loads(os.environ[TRIAL_ENV])
study = optuna.load_study(study_name=spec["study"], storage=JournalStorage(JournalFileBackend(spec["storage"])))
trial = optuna.trial.Trial(study, spec["trial_id"])
lr = trial.params["train.base_lr"]
if lr > 0.3:
    for key, value in (("pruned_epoch", 1), ("pruned_step", 3), ("diverged", f"training diverged at epoch 1, step 3")):
        trial.set_user_attr(key, value)
    sys.exit(1)
trial.report(-abs(math.log10(lr) + 2.0), 1)
trial.set_user_attr("exported", {"epoch": 1, "weights": "raw", "value": -abs(math.log10(lr) + 2.0)})
"""


def test_diverging_trials_teach_the_study_instead_of_ending_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A range whose top decade diverges (loguniform(1e-4, 3), above 0.3): each diverged trial is told PRUNED where it
    diverged, saying so in ``status``; the study finishes its 30 trials (told FAIL, three in a row ended it), and TPE,
    which learns from pruned trials, spends fewer of them on the diverging end than random search does. Both samplers
    seeded from ``seed`` alone (not the driver's pid), so the comparison is the same on every run."""
    from ddpipe.search import driver, study
    from ddpipe.search.report import rows
    from ddpipe.search.study import load_study

    _fake_trials(monkeypatch, tmp_path)
    seeded = study.sampler_seed
    monkeypatch.setattr(study, "sampler_seed", lambda seed, drawn, mark: seeded(seed, drawn, None))
    monkeypatch.setattr(driver, "command", lambda plan, trial: [sys.executable, "-c", DIVERGING_TRAINING])
    diverged = {}
    for sampler in ("tpe", "random"):
        (tmp_path / sampler).mkdir()
        plan = _plan(tmp_path / sampler, "search.space.train.base_lr=loguniform(1e-4, 3)", f"search.study={sampler}",
                     f"search.sampler={sampler}", "search.trials=30", "search.pruner=none", "search.first=[]")
        said: list[str] = []
        driver.run(plan, tmp_path / sampler, say=said.append)
        trials = load_study(plan).get_trials(deepcopy=False)
        states = [t.state.name for t in trials]
        assert len(trials) == 30 and set(states) <= {"COMPLETE", "PRUNED"}, (states, said)
        high = [t for t in trials if t.params["train.base_lr"] > 0.3]
        assert all(t.state.name == "PRUNED" and t.user_attrs["diverged"].startswith("training diverged") for t in high)
        assert all(t.state.name == "COMPLETE" for t in trials if t not in high)
        shown = [row[1] for row in rows(load_study(plan))[1:]]
        assert shown.count("PRUNED at step 3 of epoch 1 (diverged)") == len(high), shown
        assert any("pruned at step 3 of epoch 1 (its training diverged)" in line for line in said), said
        diverged[sampler] = len(high)
    print(f"trials of 30 above lr 0.3 (diverged): {diverged}")
    assert diverged["tpe"] < diverged["random"], diverged
