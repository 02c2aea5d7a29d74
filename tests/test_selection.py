"""Best, not last: the exported weights are the best validation epoch's; early stopping; both survive
an interruption exactly."""

from __future__ import annotations

import csv
import json
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from ddpipe.config.schema import TrainConfig
from ddpipe.core.exits import EXIT_PREEMPTED
from ddpipe.engine.ema import WeightAverage
from ddpipe.engine.selection import ModelSelection
from tests.conftest import CLONE_ENV, ROOT, UNTRACKED, args_for, run, same_weights, subprocess_env, weights


def test_the_best_epoch_is_kept_and_ties_keep_the_earliest() -> None:
    sel, model = ModelSelection(TrainConfig(model_epoch="best", early_stopping_patience=2)), nn.Linear(2, 1)
    for epoch, acc in enumerate([0.5, 0.7, 0.7, 0.6], start=1):
        with torch.no_grad():
            model.weight.fill_(epoch)
        sel.update(epoch, acc, model)
        assert sel.should_stop(epoch) == (epoch == 4)  # 2 epochs after the best (epoch 2)
    exported, epoch, source = sel.exported(model, 4)
    assert epoch == 2 and source == "raw" and torch.equal(exported["weight"], torch.full((1, 2), 2.0))
    last, last_epoch, _ = ModelSelection(TrainConfig(model_epoch="last")).exported(model, 4)
    assert last_epoch == 4 and torch.equal(last["weight"], model.weight)


def test_the_weight_average_is_exported_only_when_it_validates_better() -> None:
    model = nn.Linear(2, 1)
    ema = WeightAverage(model, 0.5)
    with torch.no_grad():
        model.weight.fill_(3.0)  # the average stays behind the raw weights
    for export in ("best", "last"):
        sel = ModelSelection(TrainConfig(model_epoch=export))
        sel.update(1, 0.8, model, ema, 0.8)  # a tie keeps the raw weights
        assert sel.exported(model, 1, ema)[2] == "raw"
        sel.update(2, 0.8, model, ema, 0.85)
        weights, epoch, source = sel.exported(model, 2, ema)
        assert (epoch, source, sel.best_val_accuracy) == (2, "ema", 0.85)
        assert torch.equal(weights["weight"], ema.average["weight"]) and not torch.equal(weights["weight"],
                                                                                         model.weight)


@pytest.mark.parametrize(("metric", "model_epoch", "averaged", "expected"), [
    ("val_accuracy", "best", False, 0.80),      # epoch 2, the best validation accuracy
    ("val_loss", "best", False, 0.50),          # epoch 2's loss, not the lowest (epoch 3's 0.40)
    ("val_accuracy", "last", False, 0.70),      # epoch 3, not the best epoch's 0.80
    ("val_accuracy", "best", True, 0.85),       # the average exported: its figure
    ("ema_val_accuracy", "last", False, 0.75),  # an ema_ metric is the average's, whatever is exported
])
def test_a_trials_value_is_the_figure_of_the_model_it_exports(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              metric: str, model_epoch: str, averaged: bool,
                                                              expected: float) -> None:
    """Issue 61, item 4: a trial reports the value of the model it would hand on (the exported epoch, the exported
    weights), which the driver tells: never its best epoch's when they differ (val_loss, model_epoch last, ema)."""
    import optuna

    from ddpipe.core import trials
    from ddpipe.core.environment import TRIAL_ENV
    from ddpipe.core.history import EpochStats
    from ddpipe.core.ranks import DistInfo
    from ddpipe.engine import pruning

    history = [EpochStats(epoch=e, train_loss=1.0, train_accuracy=0.5, val_loss=loss, val_accuracy=acc, lr=0.1,
                          images_per_s=1.0, epoch_seconds=1.0, ema_val_loss=loss, ema_val_accuracy=acc + 0.05)
               for e, (loss, acc) in enumerate([(0.60, 0.60), (0.50, 0.80), (0.40, 0.70)], start=1)]
    storage = str(tmp_path / "study.journal")
    study = optuna.create_study(study_name="v", storage=trials.open_storage(storage))
    trial = study.ask()
    monkeypatch.setenv(TRIAL_ENV, json.dumps({"storage": storage, "study": "v", "trial": 0,
                                              "trial_id": trial._trial_id, "metric": metric, "pruner": "none",
                                              "startup_trials": 1}))
    pruning._TRIALS.clear()
    epoch = 2 if model_epoch == "best" else 3
    pruning.after_training(DistInfo(), history, epoch, "ema" if averaged else "raw")
    frozen = study.trials[0]
    assert trials.trial_value(frozen) == pytest.approx(expected)
    assert frozen.user_attrs["exported"]["epoch"] == epoch


def test_the_selection_travels_in_a_weights_only_checkpoint(tmp_path: Path) -> None:
    sel, model = ModelSelection(TrainConfig()), nn.Linear(2, 1)
    sel.update(3, 0.9, model)
    torch.save({"selection": sel.state_dict()}, tmp_path / "c.pt")
    again = ModelSelection(TrainConfig())
    again.load_state_dict(torch.load(tmp_path / "c.pt", weights_only=True)["selection"])
    assert (again.best_epoch, again.best_val_accuracy) == (3, 0.9)
    assert torch.equal(again.best_weights["weight"], model.weight)
    assert not ModelSelection(TrainConfig()).should_stop(10)  # patience off by default


def test_a_selection_checkpointed_before_weight_averaging_exports_the_raw_weights() -> None:
    """A checkpoint of format 0 (written before format versions) from before weight averaging holds no sources:
    its best weights were the raw ones, and they are exported as such."""
    from ddpipe.engine.checkpoint import upgraded

    sel, model = ModelSelection(TrainConfig(model_epoch="best")), nn.Linear(2, 1)
    sel.update(3, 0.9, model)
    old = {k: v for k, v in sel.state_dict().items() if k not in ("best_source", "last_source")}
    again = ModelSelection(TrainConfig(model_epoch="best"))
    again.load_state_dict(upgraded({"selection": old}, 0)["selection"])
    assert (again.best_epoch, again.best_source, again.last_source) == (3, "raw", "raw")
    weights, epoch, source = again.exported(model, 5)
    assert (epoch, source) == (3, "raw") and torch.equal(weights["weight"], model.weight)


def _history(tmp: Path) -> list[dict[str, float]]:
    with open(tmp / "history.csv") as f:
        return [{k: float(v) for k, v in row.items()} for row in csv.DictReader(f)]


@pytest.mark.slow
def test_early_stopping_and_best_export_resume_exactly(tmp_path: Path, prepared: Path) -> None:
    """Uninterrupted vs stopped by SIGTERM after its first checkpoint and resumed: the same epochs, the
    same best epoch, bit-identical exported weights. Then model_epoch=last rewrites the outputs from the
    same checkpoints (model_epoch does not change the trajectory) with the last epoch's weights."""
    extra = ("num_epochs=6", "train.early_stopping_patience=1", "train.base_lr=0.02", "train.model_epoch=best",
             UNTRACKED)
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    run(["python", "stages/train_worker.py", *args_for(whole, prepared, *extra)], env=CLONE_ENV)
    history = _history(whole)
    accs = [h["val_accuracy"] for h in history]
    best = 1 + accs.index(max(accs))
    assert len(history) == min(6, best + 1)  # stopped one epoch after the best, or ran out of epochs
    train_metrics = json.loads((whole / "train.json").read_text())["train"]
    assert train_metrics["best_epoch"] == train_metrics["exported_epoch"] == best

    proc = subprocess.Popen(["python", "stages/train_worker.py", *args_for(parts, prepared, *extra)], cwd=ROOT,
                            env=subprocess_env(CLONE_ENV), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while not list((parts / "ckpt").glob("ckpt-*.pt")) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_PREEMPTED, err[-2000:]
    run(["python", "stages/train_worker.py", *args_for(parts, prepared, *extra)], env=CLONE_ENV)
    assert _history(parts) == [{**h, "images_per_s": p["images_per_s"], "epoch_seconds": p["epoch_seconds"]}
                               for h, p in zip(history, _history(parts))]
    assert json.loads((parts / "train.json").read_text())["train"]["exported_epoch"] == best
    assert same_weights(weights(whole / "model.pt"), weights(parts / "model.pt"))

    last = run(["python", "stages/train_worker.py", *args_for(whole, prepared, *extra, "train.model_epoch=last")],
               env=CLONE_ENV)
    assert "already trained" in last.stderr
    assert json.loads((whole / "train.json").read_text())["train"]["exported_epoch"] == len(history)
    payload = torch.load(whole / "model.pt", weights_only=True)
    assert payload["exported_epoch"] == len(history)
