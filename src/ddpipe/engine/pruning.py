"""A search's trial inside the training: after each validation, global rank 0 reports the epoch's metric to the
trial and asks its pruner once; the answer reaches every rank through the process group, so all ranks stop after the
same epoch (``ddpipe.core.exits.TrialPruned``), on every node, with no rank left waiting in a collective.

The training learns its trial from :data:`TRIAL_ENV`, which ``python -m ddpipe.search run`` sets for the
``dvc exp run`` of each trial (DVC passes its environment to the stage's command, torchrun to every worker). Without
it a training is no trial and this module does nothing: the experiment is the same as any other. The study's storage
and pruner are opened here, the one place both the search's driver and the training build them.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import warnings
from pathlib import Path
from typing import Any

from ddpipe.core.exits import TrialPruned
from ddpipe.core.ranks import DistInfo
from ddpipe.distributed import group as dd
from ddpipe.engine.meters import EpochStats

# A study's database that hangs (a firewall dropping packets, a server stuck): the driver says so naming
# search.storage, and a training's rank 0 fails with the error instead of every rank waiting out the collective
# timeout (issue 47)
CONNECT_TIMEOUT_S = 10
TRIAL_ENV = "DDPIPE_SEARCH_TRIAL"  # JSON: storage, study, trial (number), trial_id, metric, pruner, startup_trials,
# checkpoints (the trial's own directory, beside the experiment's workspace), attempt (the driver's count), stage (the
# one stage a trial runs) and held_out (the evaluate and export stages' tracked files, kept out of its experiment)
# The metrics a trial may be judged by: the epoch's own, as EpochStats logs them (the ema_ ones need train.ema_decay)
EPOCH_METRICS = tuple(f.name for f in dataclasses.fields(EpochStats) if f.name != "epoch")


def trial_spec() -> dict[str, Any] | None:
    """The search's description of the trial this process trains, or None outside a search."""
    raw = os.environ.get(TRIAL_ENV)
    return json.loads(raw) if raw else None


def trial_config(cfg: Any) -> Any:
    """``cfg`` as a search's trial trains it: no registered model version (``mlflow.registered_model_name`` None:
    only the chosen trial, evaluated once after the search, registers one; issue 47), and ``paths.checkpoints`` at
    the trial's own directory (search/<study>/trial-<n>/checkpoints), which outlives each attempt's workspace: a
    trial stopped by a signal or with its driver resumes there from its step under the same number. Outside a
    search, ``cfg`` as it is."""
    spec = trial_spec()
    if not spec:
        return cfg
    cfg = dataclasses.replace(cfg, mlflow=dataclasses.replace(cfg.mlflow, registered_model_name=None))
    if not spec.get("checkpoints"):
        return cfg
    return dataclasses.replace(cfg, paths=dataclasses.replace(cfg.paths, checkpoints=spec["checkpoints"]))


def open_storage(where: str, **rdb_options: Any) -> Any:
    """The study's Optuna storage: a database URL (``RDBStorage``, with ``rdb_options`` such as heartbeats) or the
    path of a journal file (``JournalStorage``, which several processes on this host share through a lock file). A
    database server that accepts the connection and never answers fails after :data:`CONNECT_TIMEOUT_S`."""
    import optuna

    if "://" in where:
        # SQLAlchemy before 2.1 opens postgresql:// with psycopg2, which ddpipe does not install; psycopg 3 is what its
        # server extra installs and MLflow's server uses (postgresql+psycopg://), so a plain URL goes through it
        if where.startswith("postgresql://") and importlib.util.find_spec("psycopg2") is None:
            where = "postgresql+psycopg://" + where.removeprefix("postgresql://")
        if where.split("+")[0].split(":")[0] in ("postgresql", "mysql"):
            rdb_options["engine_kwargs"] = {"connect_args": {"connect_timeout": CONNECT_TIMEOUT_S}}
        return optuna.storages.RDBStorage(where, **rdb_options)
    Path(where).parent.mkdir(parents=True, exist_ok=True)
    return optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(where))


def make_pruner(name: str, startup_trials: int) -> Any:
    """Optuna's pruner by the name ``search.pruner`` gives it; its steps are epochs, counted from 1."""
    import optuna

    if name == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=startup_trials, n_warmup_steps=0)
    if name == "hyperband":
        return optuna.pruners.HyperbandPruner(min_resource=1, max_resource="auto")
    return optuna.pruners.NopPruner()


class SearchTrial:
    """The trial this training is, on global rank 0 (the only rank that opens the study); the other ranks hold the
    description only and learn the decision from rank 0."""

    def __init__(self, spec: dict[str, Any], info: DistInfo) -> None:
        self.spec, self.info, self.trial = spec, info, None
        if info.is_main:
            import optuna

            study = optuna.load_study(study_name=spec["study"], storage=open_storage(spec["storage"]),
                                      pruner=make_pruner(spec["pruner"], int(spec["startup_trials"])))
            self.trial = optuna.trial.Trial(study, int(spec["trial_id"]))

    def should_stop(self, stats: EpochStats, run_id: str | None, num_epochs: int) -> str:
        """Report epoch ``stats.epoch``'s metric and ask the pruner once (rank 0; not after the last epoch, which
        leaves nothing to save); every rank gets rank 0's answer: why to stop, or "" to go on. A study that cannot be
        reached warns and lets the training go on."""
        why = ""
        if self.trial is not None:
            metric = self.spec["metric"]
            value = stats.logged().get(metric)
            try:
                self.trial.set_user_attr("epochs", stats.epoch)
                if run_id:
                    self.trial.set_user_attr("mlflow_run", run_id)
                if value is not None:
                    self.trial.report(float(value), stats.epoch)
                    if stats.epoch < num_epochs and self.trial.should_prune():
                        self.trial.set_user_attr("pruned_epoch", stats.epoch)
                        why = f": {metric} {value:.4f} ({self.spec['pruner']} pruner)"
            except Exception as exc:  # the study's store is down: the training is worth more than the search
                warnings.warn(f"search trial {self.spec['trial']}: could not report epoch {stats.epoch} to the study "
                              f"({type(exc).__name__}: {exc}); training goes on unpruned", RuntimeWarning,
                              stacklevel=2)
        return str(dd.broadcast_object(why, self.info))


_TRIALS: dict[int, SearchTrial] = {}  # per process: the trial is opened once, when first needed


def _this_trial(info: DistInfo) -> SearchTrial | None:
    spec = trial_spec()
    if spec is None:
        return None
    if os.getpid() not in _TRIALS:
        _TRIALS[os.getpid()] = SearchTrial(spec, info)
    return _TRIALS[os.getpid()]


def after_epoch(stats: EpochStats, tracker: Any, info: DistInfo, num_epochs: int) -> None:
    """Called on every rank after each epoch's validation and checkpoint: in a search's trial, report and maybe
    stop (raise :class:`TrialPruned` on every rank, after rank 0 logged ``pruned_at_epoch``); else nothing."""
    if (trial := _this_trial(info)) is None:
        return
    if why := trial.should_stop(stats, tracker.store_id(), num_epochs):  # the store's id once it has the run
        tracker.log_metrics({"pruned_at_epoch": stats.epoch}, step=stats.epoch)
        raise TrialPruned(trial.spec["study"], int(trial.spec["trial"]), stats.epoch, num_epochs, why)


def after_stop(info: DistInfo, where: str) -> None:
    """A trial's training stopped by a signal (SIGTERM, SIGUSR1, its launcher gone) after its step checkpoint: rank 0
    tells the study which attempt stopped, so that the driver runs it again under the same number, from that step."""
    if not info.is_main or trial_spec() is None:
        return
    try:
        trial = _this_trial(info)
        trial.trial.set_user_attr("stopped", {"attempt": trial.spec.get("attempt", 0), "at": where})
    except Exception as exc:  # the study's store is down: the driver sees a failed attempt instead
        warnings.warn(f"search trial: could not tell the study it stopped ({type(exc).__name__}: {exc})",
                      RuntimeWarning, stacklevel=2)
