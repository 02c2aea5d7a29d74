"""A search's trial as its study holds it: the study's storage and pruner, opened here, the one place both the
search's driver and the training (``ddpipe.engine.pruning``) build them, and what a trial's record says back (its
value, where it was pruned). No torch: ``ddpipe search`` and its driver import this, not the training.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

# A study's database that hangs (a firewall dropping packets, a server stuck): the driver says so naming
# search.storage, and a training's rank 0 fails with the error instead of every rank waiting out the collective
# timeout (issue 47)
CONNECT_TIMEOUT_S = 10
EXPORTED = "exported"  # a trial's user attr: the epoch, weights (raw or ema) and value of the model it hands on


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
    """Optuna's pruner by the name ``search.pruner`` gives it; its steps are validations, counted from 1
    (``ddpipe.engine.pruning.validation_number``)."""
    import optuna

    if name == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=startup_trials, n_warmup_steps=0)
    if name == "hyperband":
        return optuna.pruners.HyperbandPruner(min_resource=1, max_resource="auto")
    return optuna.pruners.NopPruner()


def trial_value(frozen: Any) -> float | None:
    """A trial's value: the metric of the model it would hand on (``ddpipe.engine.pruning.after_training`` recorded
    it: the exported epoch's, of the exported weights), not its best epoch's; None when its training did not
    finish."""
    exported = frozen.user_attrs.get(EXPORTED)
    return None if exported is None or exported.get("value") is None else float(exported["value"])


def pruned_at(attrs: dict[str, Any]) -> str:
    """Where a pruned trial stopped, from its user attrs: "epoch 2" (after it), or "step 40 of epoch 1"."""
    epoch, step = attrs["pruned_epoch"], attrs.get("pruned_step")
    return f"step {step} of epoch {epoch}" if step else f"epoch {epoch}"
