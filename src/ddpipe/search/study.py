"""The study of a search: its storage opened (and checked to answer), its sampler, created or continued, the trials a
gone driver left RUNNING taken over (this host's) or failed and retried (a database's, silent), and the ``first``
trials enqueued once."""

from __future__ import annotations

import socket
import warnings
from pathlib import Path
from typing import Any

from ddpipe.config.schema import ConfigError
from ddpipe.core.errors import one_line
from ddpipe.core.processes import alive, start_time
from ddpipe.engine.pruning import make_pruner, open_storage
from ddpipe.search.space import Plan
from ddpipe.tracking.store import redact

# A database storage: the driver records a heartbeat of each trial it holds; one silent for GRACE_S (its driver on
# another host gone) is failed by the next driver (Optuna's fail_stale_trials) and retried once with the same params.
HEARTBEAT_S, GRACE_S, MAX_RETRY = 20, 120, 1


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


def sampler(plan: Plan, drawn: int = 0) -> Any:
    """Optuna's sampler of ``search.sampler``, seeded from ``seed`` and the ``drawn`` trials the study holds: a
    continued study draws new points (a sampler seeded as at its start would repeat its first random ones), and the
    same study with the same history draws the same."""
    import optuna

    seed = plan.seed + drawn
    if plan.settings.sampler == "grid":
        return optuna.samplers.GridSampler({k: d.grid() for k, d in plan.space.items()}, seed=seed)
    if plan.settings.sampler == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    return optuna.samplers.TPESampler(seed=seed)


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
    study.sampler = sampler(plan, len(study.get_trials(deepcopy=False)))
    if not study.get_trials(deepcopy=False):
        for params in plan.first:
            study.enqueue_trial(params, skip_if_exists=True)
    return study


def load_study(plan: Plan) -> Any:
    """The existing study (for status and best), or SearchError; opening it creates nothing."""
    import optuna

    if "://" not in plan.storage and not Path(plan.storage).is_file():
        raise SearchError(f"no study {plan.settings.study!r} yet: {plan.storage} does not exist (python -m "
                          "ddpipe.search run starts it)")
    try:
        return optuna.load_study(study_name=plan.settings.study, storage=storage(plan))
    except KeyError:
        raise SearchError(f"no study {plan.settings.study!r} in {redact(plan.storage)} (python -m ddpipe.search run "
                          "starts it)") from None


def driver_mark() -> dict[str, Any]:
    """This driver as its trials record it: host, pid and the pid's start time (so a reused pid is not taken)."""
    import os

    return {"host": socket.gethostname(), "pid": os.getpid(), "started": start_time(os.getpid())}


def orphans(study: Any) -> list[Any]:
    """The RUNNING trials whose driver on this host is gone (killed, or stopped by a signal), taken over by this
    driver (its mark, and a heartbeat in a database, so that no other driver fails them meanwhile): the caller runs
    each again under its number. Returns them (FrozenTrials)."""
    from optuna.trial import TrialState

    found = []
    store = study._storage  # the storage the study was opened with (Optuna keeps no public handle on it)
    beats = getattr(store, "get_heartbeat_interval", lambda: None)()
    for trial in study.get_trials(states=(TrialState.RUNNING,)):
        mark = trial.user_attrs.get("driver") or {}
        if mark.get("host") == socket.gethostname() and not alive(int(mark.get("pid", 0)), mark.get("started")):
            store.set_trial_user_attr(trial._trial_id, "driver", driver_mark())
            if beats:
                store.record_heartbeat(trial._trial_id)
            found.append(trial)
    return found


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
