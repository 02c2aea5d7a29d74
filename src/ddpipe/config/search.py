"""The schema's ``search`` section: what ``ddpipe search`` reads (no stage does). Its distributions, ``first``
trials and storage are parsed and checked by ``ddpipe.search.space`` before any trial starts."""

# No ``from __future__ import annotations``: OmegaConf.structured reads the field types at runtime (as in schema.py).
import re
from dataclasses import dataclass, field
from typing import Any, Optional

from ddpipe.config.param import param

STUDY_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,62}$")  # a git ref's word: the trials' DVC experiments


@dataclass
class SearchConfig:
    """A search over experiments (docs/search.md): ``ddpipe search run`` asks Optuna for trials and runs
    each as a DVC experiment. No stage reads it: changing it re-runs nothing; ``search.key=value`` after the command
    overrides it for that command."""

    study: str = param("search", "The study's name: its trials are the DVC experiments <study>-<number>, the MLflow "
                       "children of the parent run <study> (mlflow.sweep), its plots in search/<study>/.",
                       words="a word of letters, digits, _ and - (at most 63)")
    metric: str = param("val_accuracy", "The epoch metric a trial is judged by (reported after every validation; "
                        "a trial's value is that of the model it hands on: train.model_epoch's epoch, its exported "
                        "weights).", words="an epoch metric the training logs")
    direction: str = param("maximize", "Whether a larger metric is better; it must agree with the metric (a loss "
                           "minimizes, an accuracy maximizes).", choices=("maximize", "minimize"))
    trials: int = param(20, "Finished trials (completed or pruned) the study holds when `run` ends; running it "
                        "again continues the same study up to this number.", ge=1)
    jobs: int = param(1, "Trials at once on this host (each a `dvc exp run` of the train stage in a workspace of its "
                      "own), sharing its cores and GPUs as `dvc queue start -j` does.", ge=1)
    sampler: str = param("tpe", "Optuna's sampler, seeded from seed, the trials held and the driver (drivers side "
                         "by side draw apart): tpe (with constant_liar), random, or grid (every combination of choice "
                         "and int distributions).", choices=("tpe", "random", "grid"))
    pruner: str = param("median", "Optuna's pruner, asked after every epoch: median (below the median of earlier "
                        "trials at that epoch), hyperband, or none.", choices=("median", "hyperband", "none"))
    startup_trials: int = param(5, "median: trials that finish before any is pruned (Optuna's n_startup_trials).",
                                ge=0)
    storage: Optional[str] = param(
        None, "Where the study lives: null, a journal file in the repository (search/<study>/study.journal, "
        "git-ignored) that every local job shares; or a database URL (sqlite:///search.db, relative to the "
        "repository; postgresql://user@host/db, its password from PGPASSWORD or ~/.pgpass, never here).")
    first: Any = param(
        None, "Trials run before the sampler's own, each a mapping of space keys to values (Optuna's enqueue_trial; "
        "enqueued when the study is created). null: one trial at the params as they stand.",
        words="null, or a list of mappings of space keys to values")
    space: dict[str, Any] = field(default_factory=dict, metadata={
        "doc": "What the search varies: a parameter's dotted key to a distribution, e.g. {train.base_lr: "
               "loguniform(1e-4, 1e-1), train.label_smoothing: uniform(0.0, 0.2), train.grad_accum_steps: int(1, 4), "
               "model.name: choice(resnet_small, resnet_compact)}. Not seed or data.*: they decide the validation "
               "split, and trials judged on different images do not compare.",
        "trajectory": False, "words": "a mapping of dotted keys to loguniform(a, b), uniform(a, b), int(a, b) or "
                                      "choice(x, y, ...)"})
