"""The study of a search: its storage opened (and checked to answer), its sampler (seeded per driver), created or
continued (with the metric and fixed params it started with), the trials a gone driver left RUNNING taken over (this
host's, under a lock) or failed and retried (a database's, silent), and the ``first`` trials enqueued once in all."""

from __future__ import annotations

import hashlib
import re
import socket
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ddpipe.config.schema import ConfigError
from ddpipe.core.errors import one_line
from ddpipe.core.processes import alive, named_host_lock, start_time
from ddpipe.core.trials import make_pruner, open_storage
from ddpipe.launch.cluster.queue import git
from ddpipe.search.space import Plan
from ddpipe.tracking.run_store import redact

# A database storage: the driver records a heartbeat of each trial it holds; one silent for GRACE_S (its driver on
# another host gone) is failed by the next driver (Optuna's fail_stale_trials) and retried once with the same params.
HEARTBEAT_S, GRACE_S, MAX_RETRY = 20, 120, 1
FIRST = "first"  # a trial's user attr: its index in search.first (see first_of)
STARTED_WITH = "started_with"  # the study's user attr: its metric and fixed params (see check_unchanged)


class SearchError(RuntimeError):
    """A study that is not there, or has nothing to show yet."""


def storage(plan: Plan, for_driver: bool = False) -> Any:
    """The study's storage, or a ConfigError naming ``search.storage`` when it does not answer or refuses us."""
    import optuna

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            options = {"heartbeat_interval": HEARTBEAT_S, "grace_period": GRACE_S, "heartbeat_stale_trial_callback":
                       optuna.storages.RetryHeartbeatStaleTrialCallback(MAX_RETRY)} \
                if for_driver and "://" in plan.storage else {}
            found = open_storage(plan.storage, **options)
            found.get_all_studies()  # a database that does not answer or refuses the credentials fails here
            return found
    except Exception as exc:
        shown = redact(plan.storage) if "://" in plan.storage else plan.storage
        raise ConfigError(f"search.storage = {shown!r} does not answer or refuses us ({one_line(exc, 300)}); expected "
                          "a reachable database (sqlite:///path.db, postgresql://user@host/db with PGPASSWORD or "
                          "~/.pgpass) or null (a journal file in the repository)") from None


def sampler_seed(seed: int, drawn: int, driver: dict[str, Any] | None) -> int:
    """The seed of one driver's sampler: ``seed``, the ``drawn`` trials the study held when the driver opened it,
    and the ``driver`` itself (host, pid, the pid's start time). A continued study draws new points (a sampler
    seeded as at its start would repeat its first random ones), and two drivers of one study, started at the same
    instant on one host or on two, draw apart (seeded from ``seed + drawn`` alone, they drew the same; issue 47).
    The price: a study is not drawn the same twice, as two drivers' interleaving never is either."""
    text = f"{seed}|{drawn}|{driver['host']}|{driver['pid']}|{driver['started']}" if driver else f"{seed}|{drawn}"
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "big")


def sampler(plan: Plan, drawn: int = 0, driver: dict[str, Any] | None = None) -> Any:
    """Optuna's sampler of ``search.sampler``, seeded by :func:`sampler_seed`. TPE with ``constant_liar``: the
    trials running meanwhile (this driver's other jobs, other drivers') count as if they had ended badly, so it
    proposes away from them rather than beside them (with nothing running it changes nothing)."""
    import optuna

    seed = sampler_seed(plan.seed, drawn, driver)
    if plan.settings.sampler == "grid":
        return optuna.samplers.GridSampler({k: d.grid() for k, d in plan.space.items()}, seed=seed)
    if plan.settings.sampler == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)  # constant_liar is marked so
        return optuna.samplers.TPESampler(seed=seed, constant_liar=True)


def open_study(plan: Plan) -> Any:
    """Create the study, or continue it (same name, same storage); a new one gets the ``first`` trials."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)  # our own lines say what happens to each trial
    store = storage(plan, for_driver=True)
    study = optuna.create_study(study_name=plan.settings.study, storage=store, sampler=sampler(plan),
                                pruner=make_pruner(plan.settings.pruner, plan.settings.startup_trials),
                                direction=plan.settings.direction, load_if_exists=True)
    if study.direction.name.lower() != plan.settings.direction:
        raise ConfigError(f"search.direction = {plan.settings.direction!r} is not accepted for the existing study "
                          f"{plan.settings.study!r}, which maximizes or minimizes the other way; expected "
                          f"{study.direction.name.lower()!r}, or a new search.study")
    check_unchanged(plan, study)
    study.sampler = sampler(plan, len(study.get_trials(deepcopy=False)), driver_mark())
    if not study.get_trials(deepcopy=False):
        # Two drivers opening a new study at once both enqueue these; each carries its index, and the driver that
        # takes a copy that is not the first of its index fails it unrun (first_of): each runs once in all.
        for index, params in enumerate(plan.first):
            study.enqueue_trial(params, user_attrs={FIRST: index}, skip_if_exists=True)
    return study


def check_unchanged(plan: Plan, study: Any) -> None:
    """A new study records its metric and fixed params (:attr:`Plan.fixed`); a continued one must run with the same,
    or ConfigError naming what changed: a trial of another metric, or of other fixed params (another seed, dataset,
    epoch count), has a value that does not compare with the study's others, and the sampler would learn from both."""
    now = {"search.metric": plan.settings.metric, **plan.fixed}
    was = study.user_attrs.get(STARTED_WITH)
    if was is None:
        study.set_user_attr(STARTED_WITH, now)
        return
    changed = [key for key in now if key in was and was[key] != now[key]]  # a key new to the schema is no change
    if changed:
        shown = "; ".join(f"{key} = {now[key]!r} (its trials ran with {was[key]!r})" for key in changed[:5])
        raise ConfigError(f"search.study = {plan.settings.study!r} is continued with {shown}"
                          f"{' ...' if len(changed) > 5 else ''}: not accepted, its trials' values would not compare "
                          "with the new ones; expected the study's own values back, or a new search.study")


def first_of(study: Any, trial: Any) -> int | None:
    """When ``trial`` (just asked for) is a copy of a ``first`` trial that another driver enqueued too, the number of
    the trial that runs it (the lowest of that index); else None. Trial numbers are handed out by the storage, one
    at a time, and a waiting trial is taken by one driver only (Optuna's atomic WAITING -> RUNNING), so every driver
    agrees which copy runs and each copy is taken by exactly one."""
    index = trial.user_attrs.get(FIRST)
    if index is None:
        return None
    if study._storage.get_trial(trial._trial_id).system_attrs.get("failed_trial") is not None:
        return None  # a stale trial's retry (RetryHeartbeatStaleTrialCallback copies user attrs): it runs, always
    lowest = min(t.number for t in study.get_trials(deepcopy=False) if t.user_attrs.get(FIRST) == index)
    return lowest if lowest != trial.number else None


def load_study(plan: Plan) -> Any:
    """The existing study (for status and best), or SearchError; opening it creates nothing."""
    import optuna

    if "://" not in plan.storage and not Path(plan.storage).is_file():
        raise SearchError(f"no study {plan.settings.study!r} yet: {plan.storage} does not exist (python -m "
                          "ddpipe.search run starts it)")
    try:
        return optuna.load_study(study_name=plan.settings.study, storage=storage(plan))
    except KeyError:
        raise SearchError(f"no study {plan.settings.study!r} in {redact(plan.storage)} (ddpipe search run "
                          "starts it)") from None


def driver_mark() -> dict[str, Any]:
    """This driver as its trials record it: host, pid and the pid's start time (so a reused pid is not taken)."""
    import os

    return {"host": socket.gethostname(), "pid": os.getpid(), "started": start_time(os.getpid())}


def orphans(study: Any, where: str, still_running: Callable[[int], list[int]]) -> tuple[list[Any], list[Any]]:
    """The RUNNING trials whose driver on this host is gone (killed, or stopped by a signal), taken over by this
    driver (its mark, and a heartbeat in a database, so that no other driver fails them meanwhile). Returns them
    (FrozenTrials) in two lists: those of which nothing runs, which the caller runs again under their numbers; and
    those whose training still runs (``still_running(number)``: the pids of its processes on this host, found as
    :func:`ddpipe.core.processes.working_in` finds them), which the caller leaves running and takes once they end.

    A compare-and-set: the marks are read and rewritten under a lock on this host named after the study's storage
    ``where`` and its name, so of drivers taking over at once exactly one takes each trial (read, then written
    unguarded, two took one trial and rebuilt one workspace; issue 47). Only a driver on the trial's own host takes
    it, so a host's lock is enough; another host's are a database's, failed by heartbeat (:func:`close_stale`)."""
    from optuna.trial import TrialState

    idle, live = [], []
    store, beats = study._storage, beating(study)
    with named_host_lock("search-takeover", where, study.study_name):
        for trial in study.get_trials(states=(TrialState.RUNNING,)):  # read inside the lock: what the last holder wrote
            mark = trial.user_attrs.get("driver") or {}
            if mark.get("host") == socket.gethostname() and not alive(int(mark.get("pid", 0)), mark.get("started")):
                store.set_trial_user_attr(trial._trial_id, "driver", driver_mark())
                if beats:
                    store.record_heartbeat(trial._trial_id)
                (live if still_running(trial.number) else idle).append(trial)
    return idle, live


def held_elsewhere(study: Any) -> dict[int, str]:
    """The RUNNING trials whose driver's mark names another host: trial number -> that host. A database's heartbeat
    fails them once that driver is gone (:func:`close_stale`); a journal file has none, so no driver here can tell a
    dead driver there from a live one, and none takes them over (see :func:`held_note`)."""
    from optuna.trial import TrialState

    here = socket.gethostname()
    return {t.number: host for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
            if (host := (t.user_attrs.get("driver") or {}).get("host")) and host != here}


def held_note(study: Any, where: str) -> str | None:
    """What a driver says of the trials another host's driver holds in a journal file (``where``), which it leaves
    RUNNING and counts as in flight; None when there are none, or when the storage is a database (heartbeats)."""
    held = held_elsewhere(study)
    if not held or "://" in where:
        return None
    hosts = sorted(set(held.values()))
    return (f"search {study.study_name}: trial(s) {', '.join(map(str, sorted(held)))} are RUNNING under a driver on "
            f"{', '.join(hosts)}, not this host ({socket.gethostname()}): the journal file {where} has no heartbeat, "
            "so they are left to that driver and count as in flight. If it is gone, run `ddpipe search "
            f"run` on {hosts[0]}, which resumes them; drivers on several hosts keep the study in a database "
            "(search.storage=postgresql://...), whose heartbeat hands a dead host's trials to the others")


def beating(study: Any) -> bool:
    """Whether ``study``'s storage keeps a heartbeat of its trials (a database opened by a driver; a journal file has
    none): what lets a dead driver's trial on any host be told from a live one's (:func:`close_stale`)."""
    store = study._storage  # the storage the study was opened with (Optuna keeps no public handle on it)
    return bool(getattr(store, "get_heartbeat_interval", lambda: None)())


def close_stale(study: Any) -> list[int]:
    """Fail the RUNNING trials of a database whose heartbeat stopped (another host's driver, gone), each queued again
    once with its params (Optuna's fail_stale_trials and RetryHeartbeatStaleTrialCallback). Returns their numbers."""
    import optuna
    from optuna.trial import TrialState

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        before = {t.number for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))}
        optuna.storages.fail_stale_trials(study)
        still = {t.number for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))}
    return sorted(before - still)


def in_flight(study: Any) -> int:
    """The study's RUNNING trials: this driver's, those it will resume, and other drivers' (several drivers, on this
    host or others sharing a database, end the study together at ``search.trials``)."""
    from optuna.trial import TrialState

    return len(study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)))


def take_stale(study: Any, say: Callable[[str], None]) -> None:
    """A database's RUNNING trials whose heartbeat stopped (their driver, on any host, gone): failed, each queued again
    with its params, which the next ask of any driver takes (:func:`close_stale`)."""
    if closed := close_stale(study):
        say(f"search {study.study_name}: trial(s) {', '.join(map(str, closed))} had no driver any more: failed, "
            "queued again with the same params")


def storage_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is a study's database failing to answer (Optuna's storage error, SQLAlchemy's DBAPI errors: a
    server down, a network gone, a lock timed out), which may pass: the driver waits and tries again, its trainings
    going on."""
    import optuna

    kinds: list[type] = [optuna.exceptions.StorageInternalError]
    try:
        from sqlalchemy.exc import DBAPIError
        kinds.append(DBAPIError)
    except ImportError:
        pass
    return isinstance(exc, tuple(kinds))


class Heartbeat:
    """The heartbeat of the trials a driver holds (``held()``: their ids), recorded from a thread of its own every
    :data:`HEARTBEAT_S`, whatever the driver's loop is doing meanwhile (a slow ``git push``, ``dvc exp pull`` or
    clone): its live trials never look dead to the drivers elsewhere. A database that fails to take a beat is said once
    (through ``say``), tried again at the next beat, and said again when it answers; no training stops for it. A
    journal file keeps no heartbeat: nothing to do."""

    def __init__(self, study: Any, held: Callable[[], list[int]], say: Callable[[str], None]) -> None:
        self.study, self.held, self.say = study, held, say
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ddpipe-search-heartbeat", daemon=True)

    def __enter__(self) -> Heartbeat:
        if beating(self.study):
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=60)

    def _run(self) -> None:
        failing = False
        while True:
            try:
                for trial_id in self.held():
                    self.study._storage.record_heartbeat(trial_id)
                if failing:
                    self.say(f"search {self.study.study_name}: the study's storage answers again")
                failing = False
            except Exception as exc:  # a beat lost: said once; the trainings go on
                if not failing:
                    self.say(f"warning: search {self.study.study_name}: the study's storage did not take the "
                             f"heartbeat ({one_line(exc, 200)}); the trainings go on, trying again every "
                             f"{HEARTBEAT_S:g} s")
                failing = True
            if self._stop.wait(HEARTBEAT_S):
                return


def check_names(plan: Plan, study: Any, root: Path) -> None:
    """Before any trial: no DVC experiment of ``root`` is named as a trial of this study would be (``<study>-<n>``)
    unless it is that trial's (an earlier study of the same name, removed, left its experiments)."""
    pattern = re.compile(rf"{re.escape(plan.settings.study)}-(\d+)")
    numbers = {t.number for t in study.get_trials(deepcopy=False)}
    refs = git(root, "for-each-ref", "--format=%(refname)", "refs/exps", check=False).split()
    taken = sorted({name for r in refs if (m := pattern.fullmatch(name := r.rsplit("/", 1)[-1]))
                    and int(m.group(1)) not in numbers}, key=lambda n: int(n.rsplit("-", 1)[1]))
    if taken:
        raise SearchError(f"search.study = {plan.settings.study!r}: DVC experiment(s) {', '.join(taken[:5])}"
                          f"{' ...' if len(taken) > 5 else ''} exist, and the study in {plan.storage} has no such "
                          "trial (an earlier study of this name, removed?); remove them (dvc exp remove "
                          f"{' '.join(taken[:5])}) or name this study otherwise (search.study=...)")
