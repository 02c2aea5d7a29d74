"""``ddpipe search run``: ask the study for trials and run each as a DVC experiment, ``search.jobs`` at once,
until the study holds ``search.trials`` finished ones (completed or pruned); the same command again continues it.

Each trial is ``dvc exp run -n <study>-<number> -S key=value ... train``: a DVC experiment of
the train stage alone (never evaluate or export: the test split is for the chosen trial, once), run in a workspace of
its own (:mod:`ddpipe.launch.workspace`: a clone of the repository at HEAD with the working tree's changes, DVC's
cache shared), beside the others; on success its experiment ref is sent back to the repository. (``dvc exp run
--temp`` runs share one DVC stash, and one takes whichever entry is first in it: started together, a trial could run
another's params under its own trial.) Its MLflow run is a child of the study's parent run. The trial's training
learns its trial from :data:`~ddpipe.core.environment.TRIAL_ENV` in its environment, reports each epoch and may be
pruned: its stage then fails, so a pruned trial leaves no DVC experiment (its MLflow run, KILLED and tagged, and the
study keep it). All of Optuna's calls are made from this one thread; the experiments run as child processes, polled.

A trial stopped by a signal (SIGTERM, SIGUSR1: its training checkpoints the step and says so to the study) runs again
under its number, from that step: its checkpoints live in ``search/<study>/trial-<n>/checkpoints``, beside its
workspace (made again for each attempt, from the same commits). A driver that is stopped (SIGTERM, Ctrl-C) stops its
trials so, and one that is killed leaves them to stop so (their workers follow their launcher); either way their
trials stay RUNNING, and the next ``run`` on this host resumes each under its number (or records it, when its
experiment was finished), before it asks for new ones. Several drivers may run one study at once (``study``: seeded
apart, the ``first`` trials once, a dead driver's trial taken by one); a trial another finished is skipped (``tell``).
With a database, a trial whose heartbeat stopped (its driver, on any host, gone) is failed and run again by the
next driver to ask; a driver with nothing left waits while others' trials run, so that such a trial is still run.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import shutil
import signal
import subprocess
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddpipe.config.schema import ClusterConfig
from ddpipe.core.environment import REPO_ROOT_ENV, TRIAL_ENV
from ddpipe.core.errors import one_line
from ddpipe.core.exits import pruned_where
from ddpipe.core.logs import say_to
from ddpipe.core.processes import working_in
from ddpipe.core.trials import EXPORTED, trial_value
from ddpipe.launch import workspace
from ddpipe.launch.cluster.queue import exp_ref
from ddpipe.search import study as studies
from ddpipe.search import trial_jobs as on_cluster
from ddpipe.search.space import Plan, override_text
from ddpipe.search.study import FIRST, SearchError, driver_mark, first_of, held_note, open_study, orphans

POLL_S = 1.0
TRIAL_STAGE = "train"  # the one stage a trial runs (dvc.yaml's name of it)
MAX_FAILED_IN_A_ROW = 3  # a search whose trainings keep failing stops instead of failing every trial

logger = logging.getLogger(__name__)


class Stopped(BaseException):
    """The driver was sent SIGTERM or SIGUSR1: its trials stop at a step and the next ``run`` resumes them."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(signal.Signals(signum).name)


@dataclass
class Running:
    """A trial and the ``dvc exp run`` running its ``attempt`` (1, then one more each time it is resumed)."""

    trial: Any
    process: subprocess.Popen | on_cluster.ClusterTrial
    log: Path
    attempt: int

    @property
    def experiment(self) -> str:
        return self.trial.user_attrs["experiment"]


def experiment_name(study: str, number: int) -> str:
    return f"{study}-{number}"


def trial_folder(plan: Plan, number: int) -> Path:
    """A trial's own directory: its workspace, and its checkpoints beside it (they outlive an attempt's workspace)."""
    return plan.folder.resolve() / f"trial-{number}"


def trial_workspace(plan: Plan, number: int) -> Path:
    return trial_folder(plan, number) / "workspace"


def settings(plan: Plan, trial: Any) -> list[str]:
    """The trial's params as ``dvc exp run`` sets them: ``-S key=value ...`` (its MLflow parent, the study's run, comes
    with the trial's description: ddpipe.engine.pruning.trial_config)."""
    return [w for key, value in trial.params.items() for w in ("-S", f"{key}={override_text(value)}")]


def command(plan: Plan, trial: Any) -> list[str]:
    """The trial's ``dvc exp run`` of the train stage only (in its workspace): its params set, named after study and
    trial. Never evaluate or export: a trial is judged by validation, and the test split is for the chosen trial,
    once (issue 47)."""
    return ["dvc", "exp", "run", "-n", experiment_name(plan.settings.study, trial.number), *settings(plan, trial),
            TRIAL_STAGE]


def finished(study: Any) -> int:
    from optuna.trial import TrialState

    return len(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED)))


def run(plan: Plan, root: Path, say: Any = None, cluster: ClusterConfig | None = None) -> Any:
    """Run the search of ``plan`` in the repository at ``root`` until the study holds ``search.trials`` finished
    trials; returns the study. SIGTERM or SIGUSR1 stops it (:class:`Stopped`) as Ctrl-C does, trials resumable.
    ``cluster``: each trial a job on that scheduler (:mod:`ddpipe.search.trial_jobs`), not a process here. ``say``:
    where its lines go (default: this module's logger)."""
    say = say or say_to(logger)
    if cluster is not None:
        on_cluster.check(cluster, plan.storage)
    study = open_study(plan)
    studies.check_names(plan, study, root)
    plan.folder.mkdir(parents=True, exist_ok=True)
    # before close_stale, which would fail a database trial gone quiet; a trial whose training still runs is watched
    resume, watched = orphans(study, plan.storage, lambda number: working_in(trial_folder(plan, number)))
    if resume:
        say(f"search {plan.settings.study}: trial(s) {', '.join(str(t.number) for t in resume)} lost their driver: "
            "resumed under the same number from their checkpoints")
    for t in watched:
        say(f"search {plan.settings.study}: trial {t.number} lost its driver, and its training still runs (pids "
            f"{' '.join(map(str, working_in(trial_folder(plan, t.number))))}): left running, taken over when it ends")
    studies.take_stale(study, say)
    if note := held_note(study, plan.storage):
        say(note)
    running: list[Running] = []
    unsent: list[Any] = []  # finished trials whose experiment could not be sent back: kept, sent again at the end
    failed_in_a_row, looked, waited, outage = 0, time.time(), False, False
    previous = {sig: signal.signal(sig, _stop) for sig in (signal.SIGTERM, signal.SIGUSR1)}

    def held() -> list[int]:  # what the heartbeat's thread beats for: every trial this driver holds
        return [r.trial._trial_id for r in list(running)] + [t._trial_id for t in [*resume, *unsent, *watched]]

    try:
        with studies.Heartbeat(study, held, say):
            while True:
                try:  # a database that stops answering stops no training: the loop waits, and says so once
                    while len(running) < plan.settings.jobs and resume:
                        if (started := again(plan, study, root, resume[0], say, cluster)) is not None:
                            running.append(started)
                        resume.pop(0)
                    while (len(running) < plan.settings.jobs and failed_in_a_row < MAX_FAILED_IN_A_ROW
                           and finished(study) + studies.in_flight(study) < plan.settings.trials):
                        running.append(start(plan, study, root, say, cluster=cluster))
                    for t in [t for t in watched if not working_in(trial_folder(plan, t.number))]:
                        watched.remove(t)  # its training ended: sent and told if it finished, else run again
                        resume.append(study.trials[t.number])
                    if not running and not resume and not watched:
                        if (not studies.beating(study) or failed_in_a_row >= MAX_FAILED_IN_A_ROW
                                or studies.in_flight(study) <= len(unsent) or finished(study) >= plan.settings.trials):
                            break
                        if not waited:  # a database's trials held by drivers elsewhere: stay for any that go quiet
                            say(f"search {plan.settings.study}: waiting for trial(s) held by other drivers; one "
                                f"whose heartbeat stops for {studies.GRACE_S} s is run again here")
                            waited = True
                    time.sleep(POLL_S)
                    if studies.beating(study) and time.time() - looked >= studies.HEARTBEAT_S:
                        looked = time.time()
                        studies.take_stale(study, say)
                    for done in [r for r in running if r.process.poll() is not None]:
                        state = record(plan, study, root, done, say)  # held (and beaten) until told
                        running.remove(done)
                        if state in ("STOPPED", "UNSENT"):
                            (resume if state == "STOPPED" else unsent).append(study.trials[done.trial.number])
                        failed_in_a_row = failed_in_a_row + 1 if state == "FAIL" else 0
                    if outage:
                        say(f"search {plan.settings.study}: the study's storage answers again")
                    outage = False
                except Exception as exc:
                    if not studies.storage_failure(exc):
                        raise
                    if not outage:
                        say(f"warning: search {plan.settings.study}: the study's storage does not answer "
                            f"({one_line(exc, 200)}); the trainings go on, the driver tries again every {POLL_S:g} s")
                    outage = True
                    time.sleep(POLL_S)
    except BaseException as exc:  # Ctrl-C, SIGTERM or an error: the trainings stop at a step, their trials resumable
        for r in running:
            on_cluster.stop(r.process)
        if running:
            say(f"search {plan.settings.study}: {type(exc).__name__}: trial(s) "
                f"{', '.join(str(r.trial.number) for r in running)} stopped at their last step; the same command "
                "resumes them under their numbers")
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    for frozen in unsent:  # sent now, told COMPLETE; else left RUNNING, kept, for the next run (again())
        if not told_once_sent(plan, study, root, frozen, say):
            say(f"trial {frozen.number}: its DVC experiment is still not sent back; kept in "
                f"{trial_workspace(plan, frozen.number)}: the next `ddpipe search run` sends it and tells the study")
    if finished(study) < plan.settings.trials and (note := held_note(study, plan.storage)):
        say(note)  # it stops short of search.trials: say why once more, last
    if failed_in_a_row >= MAX_FAILED_IN_A_ROW:
        raise SearchError(f"search {plan.settings.study}: {failed_in_a_row} trials failed in a row; see their logs in "
                           f"{plan.folder} (ddpipe search status)")
    return study


@functools.cache
def _cache_dir(root: Path) -> str:
    return workspace.cache_dir(root)


def prepare_workspace(plan: Plan, trial: Any, root: Path, say: Any) -> Path:
    """The trial's workspace, made afresh: a clone of ``root`` at the commits its first attempt recorded (HEAD, and
    the working tree's changes then), its outputs checked out of the shared DVC cache."""
    commits = trial.user_attrs.get("workspace")
    if not commits or not all(workspace.has_commit(root, c) for c in commits if c):
        if commits:
            say(f"trial {trial.number}: the commits of its first attempt ({', '.join(c[:8] for c in commits if c)}) "
                "are gone from the repository: this attempt runs the working tree as it is now")
        commits = list(workspace.working_tree(root))
        trial.set_user_attr("workspace", commits)
    ws = trial_workspace(plan, trial.number)
    shutil.rmtree(ws, ignore_errors=True)  # an earlier attempt's (its DVC stash may hold an entry a kill left)
    try:
        workspace.make(ws, str(root), commits[0], commits[1], cache=_cache_dir(root))
        workspace.quiet_shell(["dvc", "checkout", "--quiet"], cwd=ws, check=False)  # what the cache has
        workspace.drop_downstream(ws, TRIAL_STAGE)  # the baseline's evaluate and export out (hold_out: how to apply it)
        workspace.hold_out(ws, plan.held_out, plan.apply_note, experiment_name(plan.settings.study, trial.number))
    except (RuntimeError, OSError) as exc:
        raise SearchError(f"trial {trial.number}: its workspace {ws} could not be made: {exc}") from exc
    return ws


def send_back(plan: Plan, root: Path, number: int) -> str:
    """The trial's DVC experiment, from its workspace into ``root``; "" when it is there, else why not."""
    name = experiment_name(plan.settings.study, number)
    ws = trial_workspace(plan, number)
    if exp_ref(root, name):
        return ""
    if not (ref := exp_ref(ws, name) if (ws / ".git").is_dir() else ""):
        return f"its DVC experiment {name} is not in its workspace {ws}"
    return "" if workspace.send_back(ws, str(root), ref) else f"git push of {ref} from {ws} to {root} failed"


def _stop(signum: int, frame: Any) -> None:
    raise Stopped(signum)


def start(plan: Plan, study: Any, root: Path, say: Any, resumed: Any = None,
          cluster: ClusterConfig | None = None) -> Running:
    """Ask the study for the next trial (or take ``resumed``, a trial to run again) and start its experiment: here,
    or as a job of ``cluster``'s scheduler."""
    trial = resumed if resumed is not None else ask(plan, study, say)
    with contextlib.suppress(Exception):  # from the first instant (never beaten, it never goes stale); lost, the
        if studies.beating(study):       # heartbeat's thread beats it within HEARTBEAT_S
            study._storage.record_heartbeat(trial._trial_id)
    name = experiment_name(plan.settings.study, trial.number)
    attempt = int(trial.user_attrs.get("attempts", 0)) + 1
    trial.set_user_attr("driver", driver_mark())
    trial.set_user_attr("experiment", name)
    trial.set_user_attr("attempts", attempt)
    spec = {"storage": plan.storage, "study": plan.settings.study, "trial": trial.number,
            "trial_id": trial._trial_id,  # Optuna's id of the trial (Trial(study, trial_id) opens it in the training)
            "metric": plan.settings.metric, "pruner": plan.settings.pruner,
            "startup_trials": plan.settings.startup_trials, "attempt": attempt,
            "stage": TRIAL_STAGE, "held_out": list(plan.held_out),  # what a cluster's job runs (launch.cluster.job)
            "apply_note": plan.apply_note}
    if cluster is None or cluster.storage == "shared":  # nodes that share nothing resume in the job's workspace
        spec["checkpoints"] = str(trial_folder(plan, trial.number) / "checkpoints")
    if cluster is not None:
        job = on_cluster.start(root, name, settings(plan, trial), spec)
        say(f"trial {trial.number}{f' (attempt {attempt})' if attempt > 1 else ''}: {job.rec.scheduler} job "
            f"{job.rec.job}, experiment {name} (log: {job.log})")
        return Running(trial, job, job.log, attempt)
    log = plan.folder / f"trial-{trial.number}.log"
    ws = prepare_workspace(plan, trial, root, say)
    cmd = command(plan, trial)
    say(f"trial {trial.number}{f' (attempt {attempt})' if attempt > 1 else ''}: {' '.join(cmd)}  (log: {log})")
    env = {**os.environ, TRIAL_ENV: json.dumps(spec),
           REPO_ROOT_ENV: str(root),  # the MLflow store and outbox of the repository, not of the workspace
           "PYTHONPATH": os.pathsep.join(p for p in (str(ws / "src"), os.environ.get("PYTHONPATH")) if p)}
    with open(log, "a" if attempt > 1 else "w") as out:
        process = subprocess.Popen(cmd, cwd=ws, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   env=env)
    return Running(trial, process, log, attempt)


def ask(plan: Plan, study: Any, say: Any) -> Any:
    """The study's next trial for this driver: an enqueued one (``first``) or the sampler's. A copy of a ``first``
    trial that another driver, opening the new study at the same instant, enqueued too is failed unrun (its
    ``failure`` says which trial runs it) and the study asked again: each ``first`` trial runs once in all."""
    from optuna.trial import TrialState

    while True:
        with warnings.catch_warnings():  # a database's heartbeat is recorded here, not by Study.optimize: it is meant
            warnings.filterwarnings("ignore", "Heartbeat of storage is supposed to be used", UserWarning)
            warnings.filterwarnings("ignore", "Fixed parameter .* is out of range", UserWarning)  # run noted it
            trial = study.ask({k: d.to_optuna() for k, d in plan.space.items()})
        if (runs_it := first_of(study, trial)) is None:
            return trial
        trial.set_user_attr("failure", f"a second copy of search.first[{trial.user_attrs[FIRST]}] (two drivers "
                                       f"opened the new study at once): trial {runs_it} runs it")
        study.tell(trial, state=TrialState.FAIL)
        say(f"trial {trial.number}: not run, a copy of trial {runs_it} (search.first enqueued by two drivers at once)")


def tell(study: Any, trial: Any, say: Any, value: float | None = None, state: Any = None) -> bool:
    """``study.tell``; False, said, when another driver finished the trial first (a database driver that took it
    over after this one's heartbeat went quiet): skipped, never a crash that would stop this driver's other trials."""
    from optuna.exceptions import UpdateFinishedTrialError

    try:
        study.tell(trial, value, state=state)
        return True
    except (UpdateFinishedTrialError, ValueError):
        now = study._storage.get_trial(trial._trial_id)  # Optuna keeps no public handle on the storage
        if not now.state.is_finished():
            raise
        say(f"trial {trial.number}: already {now.state.name}, finished by another driver; not told again")
        return False


def again(plan: Plan, study: Any, root: Path, frozen: Any, say: Any,
          cluster: ClusterConfig | None = None) -> Running | None:
    """Run a stopped trial (a FrozenTrial, RUNNING) again under its number, from its checkpoints; or, when its
    experiment was finished and only the telling was lost with its driver, record it (returns None)."""
    import optuna

    if "pruned_epoch" in frozen.user_attrs:  # pruned (or diverged) while its driver was gone: told so now
        if tell(study, optuna.trial.Trial(study, frozen._trial_id), say, state=optuna.trial.TrialState.PRUNED):
            at = pruned_where(frozen.user_attrs["pruned_epoch"], frozen.user_attrs.get("pruned_step", 0))
            say(f"trial {frozen.number}: pruned {at} while its driver was gone (no DVC experiment)")
        shutil.rmtree(trial_folder(plan, frozen.number), ignore_errors=True)
        return None
    if EXPORTED in frozen.user_attrs and told_once_sent(plan, study, root, frozen, say):
        return None
    return start(plan, study, root, say, resumed=optuna.trial.Trial(study, frozen._trial_id), cluster=cluster)


def told_once_sent(plan: Plan, study: Any, root: Path, frozen: Any, say: Any) -> bool:
    """A finished trial's experiment sent into ``root`` (there already, or now), the trial told COMPLETE and its
    folder removed; False, nothing changed, when it cannot be sent."""
    import optuna

    if send_back(plan, root, frozen.number):
        return False
    value = trial_value(frozen)
    if tell(study, optuna.trial.Trial(study, frozen._trial_id), say, value):
        say(f"trial {frozen.number}: its DVC experiment {experiment_name(plan.settings.study, frozen.number)} was "
            f"finished: completed, {plan.settings.metric} {value:.4f}")
    shutil.rmtree(trial_folder(plan, frozen.number), ignore_errors=True)
    return True


def record(plan: Plan, study: Any, root: Path, done: Running, say: Any) -> str:
    """How ``done`` ended, told to the study: COMPLETE (its exported model's metric), PRUNED (where its training was
    pruned or diverged), FAIL, or nothing if a signal stopped it (STOPPED: it runs again) or its experiment could not
    be sent back (UNSENT: kept, RUNNING, sent again); SKIPPED: another driver told it."""
    from optuna.exceptions import UpdateFinishedTrialError
    from optuna.trial import TrialState

    frozen = study.trials[done.trial.number]
    value = trial_value(frozen)  # its exported model's, recorded at its training's end
    number, code = done.trial.number, done.process.returncode
    stopped = frozen.user_attrs.get("stopped") or {}
    if code and stopped.get("attempt") == done.attempt and "pruned_epoch" not in frozen.user_attrs:
        say(f"trial {number}: training {stopped.get('at', 'stopped')}; it runs again under the same number from there")
        return "STOPPED"
    if code == 0 and value is not None and (lost := send_back(plan, root, number)):  # never deleted, told later
        with contextlib.suppress(UpdateFinishedTrialError):
            done.trial.set_user_attr("unsent", lost)
        say(f"trial {number}: finished, but {lost}; its workspace is kept, and the search sends it again")
        return "UNSENT"
    if code == 0 and value is not None:
        state = "COMPLETE" if tell(study, done.trial, say, value) else "SKIPPED"
        if state == "COMPLETE":
            say(f"trial {number}: completed, {plan.settings.metric} {value:.4f}, DVC experiment {done.experiment}")
    elif "pruned_epoch" in frozen.user_attrs:
        state = "PRUNED" if tell(study, done.trial, say, state=TrialState.PRUNED) else "SKIPPED"
        if state == "PRUNED":
            at = pruned_where(frozen.user_attrs["pruned_epoch"], frozen.user_attrs.get("pruned_step", 0))
            diverged = " (its training diverged)" if "diverged" in frozen.user_attrs else ""
            say(f"trial {number}: pruned {at}{diverged} (no DVC experiment)")
    else:
        tail = done.log.read_text(errors="replace").strip().splitlines()[-1:] if done.log.exists() else []
        why = f"dvc exp run exited {code}: {tail[0][:300] if tail else ''}" if code else \
            f"the training reported no {plan.settings.metric} of its model (is {TRIAL_ENV} reaching it?)"
        with contextlib.suppress(UpdateFinishedTrialError):  # finished by another driver: tell() says so
            done.trial.set_user_attr("failure", why)
        state = "FAIL" if tell(study, done.trial, say, state=TrialState.FAIL) else "SKIPPED"
        if state == "FAIL":
            say(f"trial {number}: failed ({why}); log: {done.log}")
    shutil.rmtree(trial_folder(plan, number), ignore_errors=True)  # its checkpoints: the trial is over
    return state
