"""What a finished training leaves, the train stage's DVC outputs: the model file (``paths.model``), its
metrics (``paths.train_metrics``), the per-epoch history DVC plots (``paths.history``) and the MLflow run the
evaluate stage logs to (``paths.run_info``); then the exported model goes into that run. Written by global
rank 0 only, each file atomically. The metrics and the history are also rewritten after every validation
(:func:`write_progress`), for a running training to be watched.

Those outputs' directories and the checkpoints' are claimed by one training at a time (:func:`claim_training`,
:func:`hold_training`; ddpipe.core.claims): a second training that would write them is refused while the first
lives. A queued experiment's checkpoints are kept in the user's repository, not in DVC's copy of it
(:func:`anchored_checkpoints`)."""

from __future__ import annotations

import logging
import os
from dataclasses import MISSING, asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from ddpipe.config.keys import flatten
from ddpipe.config.schema import Config
from ddpipe.core.claims import Claim
from ddpipe.core.environment import CLAIM_ENV
from ddpipe.core.files import atomic_write_json, atomic_write_text
from ddpipe.core.history import EpochStats
from ddpipe.core.metric_names import MODEL_VAL_ACCURACY
from ddpipe.core.objectstore import StoreFolder, is_store_url
from ddpipe.core.ranks import DistInfo
from ddpipe.core.store_lease import StoreLease
from ddpipe.data.store import Prepared
from ddpipe.engine.checkpoint import checkpoint_folder, fingerprint
from ddpipe.engine.resolved import Resolved
from ddpipe.models.saved import save_model
from ddpipe.tracking.outbox import outbox_root, write_run_info
from ddpipe.tracking.tracker import Tracker

logger = logging.getLogger(__name__)

# The train stage's outputs, by their paths.* key (dvc.yaml's outs of the train stage)
OUTPUT_KEYS = ("model", "run_info", "train_metrics", "history")


# Where a queued experiment's checkpoints go, under paths.checkpoints of the user's repository
QUEUED_CHECKPOINTS = "queued"


def anchored_checkpoints(cfg: Config) -> Config:
    """``cfg`` with its checkpoints where they outlive DVC's copy of the repository. ``dvc exp run --queue`` (and
    ``--temp``) runs an experiment in a temporary copy, which DVC removes when the experiment ends, is killed
    (``dvc queue kill``) or its worker dies, with ``$DVC_ROOT`` naming the user's repository: a relative
    ``paths.checkpoints`` there would be lost with the copy, and the same experiment queued again would start from
    epoch 1. Such a run's checkpoints go to ``<the repository>/<paths.checkpoints>/queued/<12 hex digits of all its
    parameters>`` (:func:`ddpipe.config.keys.flatten`): the same experiment queued again resumes there from its step,
    and two experiments that differ in any parameter, a trajectory key or not (``mlflow.sweep``,
    ``train.model_epoch``), never share a directory, nor the MLflow run a resumed checkpoint reopens. A store's
    ``paths.checkpoints`` (``s3://...``) outlives the copy already: such a run's go to ``<it>/queued/<the same 12 hex
    digits>``, for the same reason. A training in the repository itself, or an absolute ``paths.checkpoints``: ``cfg``
    as it is."""
    root, where = os.environ.get("DVC_ROOT"), cfg.paths.checkpoints
    if not root or Path.cwd().resolve() == Path(root).resolve():
        return cfg
    if is_store_url(where):
        kept = f"{where.rstrip('/')}/{QUEUED_CHECKPOINTS}/{fingerprint(flatten(cfg))}"
    elif Path(where).is_absolute():
        return cfg
    else:
        kept = str(Path(root).resolve() / where / QUEUED_CHECKPOINTS / fingerprint(flatten(cfg)))
    return replace(cfg, paths=replace(cfg.paths, checkpoints=kept))


def run_markers(cfg: Config) -> Path:
    """Where a training leaves the marker of its live MLflow run (ddpipe.tracking.tracker): its checkpoints' directory,
    or, when they are in a store, this host's ``<mlflow.outbox>/live-runs`` (a marker names a process of this host)."""
    if is_store_url(cfg.paths.checkpoints):
        return outbox_root(cfg.mlflow.outbox) / "live-runs"
    return Path(cfg.paths.checkpoints)


def training_places(cfg: Config) -> dict[str, Path]:
    """The directories of this host a training writes, by the keys that name them: its checkpoints (unless they are in
    a store) and its outputs'."""
    paths = cfg.paths
    checkpoints = {} if is_store_url(paths.checkpoints) else {"paths.checkpoints": Path(paths.checkpoints)}
    return {**checkpoints, **{f"paths.{key}": Path(getattr(paths, key)).parent for key in OUTPUT_KEYS}}


def claim_training(cfg: Config, role: str) -> Claim:
    """A new claim on the training's directories (the launcher's, before torchrun starts), or InUse naming the
    training that holds them."""
    return Claim.take(training_places(cfg), role)


class Hold:
    """A worker's hold on what its training writes: its claim on this host's directories, and with checkpoints in a
    store, global rank 0's lease there (ddpipe.core.store_lease)."""

    def __init__(self, claim: Claim | None, lease: StoreLease | None = None) -> None:
        self.claim, self.lease = claim, lease

    def release(self) -> None:
        if self.lease is not None:
            self.lease.release()
        if self.claim is not None:
            self.claim.release()


def hold_training(cfg: Config, info: DistInfo) -> Hold:
    """This worker's hold on its training's directories: it joins the claim its launcher took (:data:`CLAIM_ENV`);
    started otherwise, global rank 0 takes one (a plain process, a torchrun by hand, a node of a several-node job:
    their launchers cannot tell which node writes) and the other ranks, which write nothing there, hold none. With
    ``paths.checkpoints`` in a store, global rank 0 also takes the lease there, whichever node it runs on, and
    renews it before each checkpoint it writes (ddpipe.engine.checkpoint.save_checkpoint): a training whose lease
    was taken over stops there (LeaseLost) without writing it."""
    if token := os.environ.get(CLAIM_ENV):
        claim = Claim.join(training_places(cfg), token, f"rank {info.rank}")
    else:
        claim = Claim.take(training_places(cfg), "rank 0") if info.is_main else None
    if not (info.is_main and is_store_url(cfg.paths.checkpoints)):
        return Hold(claim)
    try:
        place = checkpoint_folder(cfg.paths.checkpoints)
        assert isinstance(place, StoreFolder)
        return Hold(claim, StoreLease.take(place, "paths.checkpoints", "rank 0"))
    except BaseException:
        if claim is not None:
            claim.release()
        raise


@dataclass
class TrainingOutputs:
    """What a finished training leaves: the exported weights and the run's metrics and history."""

    weights: dict[str, Any]
    exported_epoch: int
    exported_weights: str  # raw, or ema (the moving average: ddpipe.engine.ema)
    metrics: dict[str, float]
    history: list[EpochStats]
    data: Prepared  # the input the saved model takes
    example_images: Any  # a few validation images (uint8, N x C x H x W): the logged model's input example


def save_outputs(run: Resolved, outputs: TrainingOutputs, tracker: Tracker, info: DistInfo) -> None:
    """On global rank 0: write ``paths.model``, the DVC metrics and plots files and ``paths.run_info`` (the run of
    ``tracker``), then log the model into that run (``mlflow.log_model``). Every other rank: nothing."""
    if not info.is_main:
        return
    cfg, paths = run.cfg, run.cfg.paths
    save_model(outputs.weights, run.model, asdict(outputs.data), paths.model,
               extra={"exported_epoch": outputs.exported_epoch, "exported_weights": outputs.exported_weights,
                      "eval_crop_ratio": run.eval_crop_ratio})
    atomic_write_json(paths.train_metrics, {"train": outputs.metrics})
    atomic_write_text(paths.history, history_csv(outputs.history))
    write_run_info(paths.run_info, tracker.store_id() or "", tracker.uri)
    tracker.log_metrics({key: outputs.metrics[key] for key in ("best_epoch", "exported_epoch")})
    if cfg.mlflow.log_model:
        example = outputs.example_images.numpy()  # as a client has them: uint8, N x H x W for grey
        tracker.log_model(Path(paths.model), example[:, 0] if example.shape[1] == 1 else example, run.model_name)
    # after the model: its validation figures are linked to it as well (MLflow's Models tab)
    tracker.log_model_metrics({key: outputs.metrics[key] for key in (MODEL_VAL_ACCURACY, "model_val_loss")},
                              outputs.exported_epoch)
    tracker.print_link()


def write_progress(cfg: Config, metrics: dict[str, float], history: list[EpochStats], info: DistInfo) -> None:
    """After each validation (an epoch's end, or inside one: ``train.val_every_n_steps``), once its checkpoint is
    written, on global rank 0: ``paths.train_metrics`` and ``paths.history`` (a row per epoch) with what is known so
    far, each atomically, so that ``dvc metrics show``, ``dvc plots show`` and the VS Code extension show a running
    training. The metrics (flat numbers, the latest validation's among them: ``ddpipe.engine.loop.write_live``) say
    ``running: true`` (a stopped training leaves them so); :func:`save_outputs` writes the finished training's, without
    it. A view, not an output: where they cannot be written (DVC's copy of the repository removed under a training it
    stops, after `dvc queue kill --force`; a full disk) the training says so and goes on, to its stop and its
    checkpoint."""
    if not info.is_main:
        return
    try:
        atomic_write_json(cfg.paths.train_metrics, {"train": {**metrics, "running": True}})
        atomic_write_text(cfg.paths.history, history_csv(history))
    except OSError as exc:
        logger.warning(f"warning: the running training's {cfg.paths.train_metrics} and {cfg.paths.history} were not "
                       f"written ({type(exc).__name__}: {exc}); the training goes on")


def history_csv(history: list[EpochStats]) -> str:
    """The per-epoch history as CSV (``paths.history``, DVC's plots)."""
    keys = [f.name for f in fields(EpochStats)  # the weight average's columns only when it was kept
            if f.default is MISSING or any(getattr(h, f.name) is not None for h in history)]
    lines = [",".join(keys)] + [",".join(f"{getattr(h, k):.6g}" for k in keys) for h in history]
    return "\n".join(lines) + "\n"
