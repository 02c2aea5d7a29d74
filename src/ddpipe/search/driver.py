"""``python -m ddpipe.search run``: ask the study for trials and run each as a DVC experiment, ``search.jobs`` at once,
until the study holds ``search.trials`` finished ones (completed or pruned); the same command again continues it.

Each trial is ``dvc exp run --temp -n <study>-<number> -S key=value ... -S mlflow.sweep=<study>``: a DVC experiment
of its own, run in a temporary workspace beside the others (``--temp``: DVC runs several at once, as its queue's
workers do), its MLflow run a child of the study's parent run. The trial's training learns its trial from
:data:`~ddpipe.engine.pruning.TRIAL_ENV` in its environment, reports each epoch and may be pruned: its stage then
fails, so a pruned trial leaves no DVC experiment (its MLflow run, KILLED and tagged, and the study keep it). All of
Optuna's calls are made from this one thread; the experiments run as child processes, polled.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddpipe.engine.pruning import TRIAL_ENV
from ddpipe.search.space import Plan, override_text
from ddpipe.search.study import SearchError, close_stale, driver_mark, give_back, open_study

POLL_S = 1.0
MAX_FAILED_IN_A_ROW = 3  # a search whose trainings keep failing stops instead of failing every trial


@dataclass
class Running:
    """A trial and the ``dvc exp run`` running it."""

    trial: Any
    process: subprocess.Popen
    log: Path

    @property
    def experiment(self) -> str:
        return self.trial.user_attrs["experiment"]


def experiment_name(study: str, number: int) -> str:
    return f"{study}-{number}"


def command(plan: Plan, trial: Any) -> list[str]:
    """The trial's ``dvc exp run``: its params set, in a temporary workspace, named after study and trial."""
    cmd = ["dvc", "exp", "run", "--temp", "-n", experiment_name(plan.settings.study, trial.number)]
    for key, value in trial.params.items():
        cmd += ["-S", f"{key}={override_text(value)}"]
    return cmd + ["-S", f"mlflow.sweep={plan.settings.study}"]


def finished(study: Any) -> int:
    from optuna.trial import TrialState

    return len(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED)))


def run(plan: Plan, root: Path, say: Any = print) -> Any:
    """Run the search of ``plan`` in the repository at ``root`` until the study holds ``search.trials`` finished
    trials; returns the study."""
    study = open_study(plan)
    if closed := close_stale(study):
        say(f"search {plan.settings.study}: trial(s) {', '.join(map(str, closed))} had no driver any more: failed, "
            "queued again with the same params")
    plan.folder.mkdir(parents=True, exist_ok=True)
    running: list[Running] = []
    failed_in_a_row = 0
    try:
        while True:
            while (len(running) < plan.settings.jobs and failed_in_a_row < MAX_FAILED_IN_A_ROW
                   and finished(study) + len(running) < plan.settings.trials):
                running.append(start(plan, study, root, say))
            if not running:
                break
            time.sleep(POLL_S)
            heartbeat(study, running)
            for done in [r for r in running if r.process.poll() is not None]:
                running.remove(done)
                state = record(plan, study, done, say)
                failed_in_a_row = failed_in_a_row + 1 if state == "FAIL" else 0
    except BaseException:  # Ctrl-C or an error: the experiments stop with us, their trials are queued again
        for r in running:
            stop(r.process)
            give_back(study, study.trials[r.trial.number])
        raise
    if failed_in_a_row >= MAX_FAILED_IN_A_ROW:
        raise SearchError(f"search {plan.settings.study}: {failed_in_a_row} trials failed in a row; see their logs in "
                           f"{plan.folder} (python -m ddpipe.search status)")
    return study


def start(plan: Plan, study: Any, root: Path, say: Any) -> Running:
    """Ask the study for the next trial and start its experiment."""
    trial = study.ask({key: d.to_optuna() for key, d in plan.space.items()})
    name = experiment_name(plan.settings.study, trial.number)
    trial.set_user_attr("driver", driver_mark())
    trial.set_user_attr("experiment", name)
    spec = {"storage": plan.storage, "study": plan.settings.study, "trial": trial.number,
            "trial_id": trial._trial_id,  # Optuna's id of the trial (Trial(study, trial_id) opens it in the training)
            "metric": plan.settings.metric, "pruner": plan.settings.pruner,
            "startup_trials": plan.settings.startup_trials}
    log = plan.folder / f"trial-{trial.number}.log"
    cmd = command(plan, trial)
    say(f"trial {trial.number}: {' '.join(cmd)}  (log: {log})")
    with open(log, "w") as out:
        process = subprocess.Popen(cmd, cwd=root, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   env={**os.environ, TRIAL_ENV: json.dumps(spec)})
    return Running(trial, process, log)


def heartbeat(study: Any, running: list[Running]) -> None:
    """A database's heartbeat of every running trial (a journal file has none: see close_stale)."""
    store = study._storage  # the storage the study was opened with (Optuna keeps no public handle on it)
    if getattr(store, "get_heartbeat_interval", lambda: None)():
        for r in running:
            store.record_heartbeat(r.trial._trial_id)


def stop(process: subprocess.Popen) -> None:
    """SIGTERM to ``process`` and every process under it (the training's launcher checkpoints and exits); wait."""
    import psutil

    try:
        tree = [psutil.Process(process.pid), *psutil.Process(process.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        tree = []
    for p in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.terminate()
    process.wait()


def record(plan: Plan, study: Any, done: Running, say: Any) -> str:
    """Tell the study how ``done`` ended: COMPLETE with its best epoch's metric, PRUNED (the training said at which
    epoch), or FAIL; returns the state's name."""
    from optuna.trial import TrialState

    frozen = study.trials[done.trial.number]
    values = list(frozen.intermediate_values.values())
    number, code = done.trial.number, done.process.returncode
    if code == 0 and values:
        value = max(values) if plan.settings.direction == "maximize" else min(values)
        study.tell(done.trial, value)
        say(f"trial {number}: completed, {plan.settings.metric} {value:.4f}, DVC experiment {done.experiment}")
        return "COMPLETE"
    if "pruned_epoch" in frozen.user_attrs:
        study.tell(done.trial, state=TrialState.PRUNED)
        say(f"trial {number}: pruned after epoch {frozen.user_attrs['pruned_epoch']} (no DVC experiment)")
        return "PRUNED"
    tail = done.log.read_text(errors="replace").strip().splitlines()[-1:] if done.log.exists() else []
    why = f"dvc exp run exited {code}: {tail[0][:300] if tail else ''}" if code else \
        f"the training reported no {plan.settings.metric} (is {TRIAL_ENV} reaching it?)"
    done.trial.set_user_attr("failure", why)
    study.tell(done.trial, state=TrialState.FAIL)
    say(f"trial {number}: failed ({why}); log: {done.log}")
    return "FAIL"
