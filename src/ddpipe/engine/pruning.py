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
import json
import os
import warnings
from pathlib import Path
from typing import Any

from ddpipe.core.exits import TrialPruned
from ddpipe.core.ranks import DistInfo
from ddpipe.distributed import group as dd
from ddpipe.engine.meters import EpochStats

TRIAL_ENV = "DDPIPE_SEARCH_TRIAL"  # JSON: storage, study, trial (number), trial_id, metric, pruner, startup_trials
# The metrics a trial may be judged by: the epoch's own, as EpochStats logs them (the ema_ ones need train.ema_decay)
EPOCH_METRICS = tuple(f.name for f in dataclasses.fields(EpochStats) if f.name != "epoch")


def open_storage(where: str, **rdb_options: Any) -> Any:
    """The study's Optuna storage: a database URL (``RDBStorage``, with ``rdb_options`` such as heartbeats) or the
    path of a journal file (``JournalStorage``, which several processes on this host share through a lock file)."""
    import optuna

    if "://" in where:
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


_TRIALS: dict[int, SearchTrial] = {}  # per process: the trial is opened once, at its first epoch


def after_epoch(stats: EpochStats, tracker: Any, info: DistInfo, num_epochs: int) -> None:
    """Called on every rank after each epoch's validation and checkpoint: in a search's trial, report and maybe
    stop (raise :class:`TrialPruned` on every rank, after rank 0 logged ``pruned_at_epoch``); else nothing."""
    raw = os.environ.get(TRIAL_ENV)
    if not raw:
        return
    if os.getpid() not in _TRIALS:
        _TRIALS[os.getpid()] = SearchTrial(json.loads(raw), info)
    trial = _TRIALS[os.getpid()]
    if why := trial.should_stop(stats, getattr(tracker, "run_id", None), num_epochs):
        tracker.log_metrics({"pruned_at_epoch": stats.epoch}, step=stats.epoch)
        raise TrialPruned(trial.spec["study"], int(trial.spec["trial"]), stats.epoch, num_epochs, why)
