"""A search's trial inside the training: after each validation, global rank 0 reports the metric to the trial and
asks its pruner once; the answer reaches every rank through the process group, so all ranks stop at the same
validation (``ddpipe.core.exits.TrialPruned``), on every node, with no rank left waiting in a collective. The
pruner's steps are validations counted from 1 over the run (:func:`validation_number`): epochs, unless
``train.val_every_n_steps`` validates inside them too, so that a hopeless trial stops inside its first epoch.

The training learns its trial from :data:`TRIAL_ENV`, which ``ddpipe search run`` sets for the
``dvc exp run`` of each trial (DVC passes its environment to the stage's command, torchrun to every worker). Without
it a training is no trial and this module does nothing: the experiment is the same as any other. The study's storage
and pruner come from ``ddpipe.core.trials``, which the search's driver shares.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from typing import Any

from ddpipe.core.environment import trial_spec
from ddpipe.core.exits import TrialPruned
from ddpipe.core.history import EpochStats
from ddpipe.core.ranks import DistInfo
from ddpipe.core.trials import EXPORTED, make_pruner, open_storage
from ddpipe.distributed import group as dd


def trial_config(cfg: Any) -> Any:
    """``cfg`` as a search's trial trains it: no registered model version (``mlflow.registered_model_name`` None:
    only the chosen trial, evaluated once after the search, registers one; issue 47); its MLflow run a child of the
    study's parent run (``mlflow.sweep`` = the study, set here and not in params.yaml, so that a trial's DVC experiment
    holds a normal training's params and ``search best --apply`` leaves no sweep of the study behind); and
    ``paths.checkpoints`` at the trial's own directory (search/<study>/trial-<n>/checkpoints), which outlives each
    attempt's workspace: a trial stopped by a signal or with its driver resumes there from its step under the same
    number. Outside a search, ``cfg`` as it is."""
    spec = trial_spec()
    if not spec:
        return cfg
    cfg = dataclasses.replace(cfg, mlflow=dataclasses.replace(cfg.mlflow, registered_model_name=None,
                                                              sweep=spec.get("study") or cfg.mlflow.sweep))
    if not spec.get("checkpoints"):
        return cfg
    return dataclasses.replace(cfg, paths=dataclasses.replace(cfg.paths, checkpoints=spec["checkpoints"]))


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

    def should_stop(self, values: dict[str, Any], at: Validation, run_id: str | None) -> str:
        """Report the metric of validation ``at`` (``values``: its figures by metric name) and ask the pruner once
        (rank 0; not after the run's last validation, which leaves nothing to save); every rank gets rank 0's
        answer: why to stop, or "" to go on. A study that cannot be reached warns and lets the training go on."""
        why = ""
        if self.trial is not None:
            metric = self.spec["metric"]
            value = values.get(metric)
            try:
                self.trial.set_user_attr("validations_per_epoch", at.per_epoch)  # which reports end an epoch
                if not at.step:
                    self.trial.set_user_attr("epochs", at.epoch)
                if run_id:
                    self.trial.set_user_attr("mlflow_run", run_id)
                if value is not None:
                    self.trial.report(float(value), at.number)
                    if at.number < at.last and self.trial.should_prune():
                        self.trial.set_user_attr("pruned_epoch", at.epoch)
                        if at.step:
                            self.trial.set_user_attr("pruned_step", at.step)
                        why = f": {metric} {value:.4f} ({self.spec['pruner']} pruner)"
            except Exception as exc:  # the study's store is down: the training is worth more than the search
                warnings.warn(f"search trial {self.spec['trial']}: could not report {at} to the study "
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


@dataclasses.dataclass(frozen=True)
class Validation:
    """Where a validation stands: after step ``step`` (0: the end) of epoch ``epoch`` (counted from 1); ``number``,
    its count from 1 over the run, the pruner's step; ``last``, the run's last validation's number; ``per_epoch``,
    an epoch's validations (an epoch's end is a multiple of it)."""

    epoch: int
    step: int
    number: int
    last: int
    num_epochs: int
    per_epoch: int

    def __str__(self) -> str:
        return f"epoch {self.epoch}" + (f", step {self.step}" if self.step else "")


def validation_number(epoch: int, step: int, steps_per_epoch: int, every: int, num_epochs: int) -> Validation:
    """The validation after step ``step`` (0: the epoch's end) of epoch ``epoch`` (from 1): an epoch holds one every
    ``every`` steps inside it (``train.val_every_n_steps``; 0: none) and its own at its end, so validations are
    counted in epochs by default and the pruner's steps mean the same in every trial of a study (the key is one of
    its fixed params)."""
    inside = (steps_per_epoch - 1) // every if every else 0
    per_epoch = inside + 1
    number = (epoch - 1) * per_epoch + (step // every if step else per_epoch)
    return Validation(epoch, step, number, num_epochs * per_epoch, num_epochs, per_epoch)


def after_validation(values: dict[str, Any], at: Validation, tracker: Any, info: DistInfo) -> None:
    """Called on every rank after each validation and the checkpoint that follows it: in a search's trial, report
    and maybe stop (raise :class:`TrialPruned` on every rank, after rank 0 logged ``pruned_at_epoch``); else
    nothing."""
    if (trial := _this_trial(info)) is None:
        return
    if why := trial.should_stop(values, at, tracker.store_id()):  # the store's id once it has the run
        tracker.log_metrics({"pruned_at_epoch": at.epoch}, step=at.epoch)
        raise TrialPruned(trial.spec["study"], int(trial.spec["trial"]), at.epoch, at.num_epochs, why, at.step)


def after_training(info: DistInfo, history: list[EpochStats], epoch: int, source: str) -> None:
    """A finished trial's training, on rank 0: tell the study the value of the model it hands on (epoch ``epoch``'s
    weights, raw or ``ema``: ``EpochStats.of_weights``), which the driver tells as the trial's value, so that the
    trial chosen is scored by the model ``search best --apply`` would evaluate and export. The study's store down:
    warned; the driver then fails the trial, naming why."""
    if not info.is_main or trial_spec() is None or not 1 <= epoch <= len(history):
        return
    try:
        trial = _this_trial(info)
        value = history[epoch - 1].of_weights(trial.spec["metric"], source == "ema")
        trial.trial.set_user_attr(EXPORTED, {"epoch": epoch, "weights": source, "value": value})
    except Exception as exc:
        warnings.warn(f"search trial: could not tell the study its model's value ({type(exc).__name__}: {exc})",
                      RuntimeWarning, stacklevel=2)


def after_divergence(info: DistInfo, epoch: int, step: int, why: str) -> None:
    """A trial's training that diverged (a loss gone to inf or NaN at ``step`` of ``epoch``, from 1): rank 0 tells the
    study it stopped there, as a pruner stops a trial (``pruned_epoch``, ``pruned_step``) and why (``diverged``), so
    the driver tells Optuna PRUNED. Optuna's TPE learns from PRUNED trials and ranks each below every completed one
    (the earlier it stopped, the worse): the diverging learning rates fall among those it proposes less. A FAIL it
    ignores, and three in a row would end the search where it should learn where the cliff is."""
    if not info.is_main or trial_spec() is None:
        return
    try:
        trial = _this_trial(info)
        for key, value in (("pruned_epoch", epoch), ("pruned_step", step), ("diverged", why[:500])):
            trial.trial.set_user_attr(key, value)
    except Exception as exc:  # the study's store is down: the driver sees a failed attempt instead
        warnings.warn(f"search trial: could not tell the study it diverged ({type(exc).__name__}: {exc})",
                      RuntimeWarning, stacklevel=2)


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
