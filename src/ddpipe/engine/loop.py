"""The training loop: epochs of optimizer steps, exact distributed validation, checkpoints and resume.

Launch: ``python -m ddpipe.launch [key=value ...]`` (what dvc.yaml runs: torchrun with this node's
processes), or ``python stages/train_worker.py`` for one plain process (no process group, no DDP wrapper).

After every validation (an epoch's end, or inside one: ``train.val_every_n_steps``) the checkpoint comes first, then
its MLflow metrics and the live files: a kill before the checkpoint logs nothing of it; a resume logs the checkpoint's
last validation again, and the delivery drops what the run holds already (``ddpipe.tracking.delivery``).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
from collections.abc import Iterable, Iterator
from dataclasses import asdict, replace
from typing import Any

import torch

from ddpipe.core.devices import PrecisionPolicy
from ddpipe.core.exits import Preempted, StoreAway
from ddpipe.core.ranks import DistInfo
from ddpipe.distributed import group as dd
from ddpipe.distributed.host_leases import HostShare
from ddpipe.distributed.preemption import StopRequests, follow_launcher
from ddpipe.engine import autotune
from ddpipe.engine.checkpoint import Position
from ddpipe.engine.ema import WeightAverage
from ddpipe.engine.meters import EpochMeter, EpochProgress, EpochStats, final_metrics, measure_split
from ddpipe.engine.optimizer import Diverged
from ddpipe.engine.parts import TrainingParts, build_parts, in_ddp, wrap
from ddpipe.engine.progress import make_progress
from ddpipe.engine.pruning import after_divergence as search_trial_after_divergence
from ddpipe.engine.pruning import after_stop as search_trial_after_stop
from ddpipe.engine.pruning import after_training as search_trial_after_training
from ddpipe.engine.pruning import after_validation as search_trial_after_validation
from ddpipe.engine.pruning import validation_number
from ddpipe.engine.resolved import Resolved, resolve
from ddpipe.engine.stage_outputs import TrainingOutputs, hold_training, run_markers, save_outputs, write_progress
from ddpipe.tracking.system_metrics import NoSystemMetrics, monitor_node

logger = logging.getLogger(__name__)
# a validation's figures, by the epoch metrics' names (the ema_ ones with a weight average)
VALIDATION_KEYS = ("val_loss", "val_accuracy", "ema_val_loss", "ema_val_accuracy")


class Trainer:
    """Trains the parts it is handed (:func:`ddpipe.engine.parts.build_parts`): ``fit()`` trains, validates and
    checkpoints."""

    def __init__(self, parts: TrainingParts) -> None:
        p = parts
        self.run, self.cfg, self.info, self.device = p.run, p.run.cfg, p.info, p.info.device
        self.stops, self.share, self.compute, self.num_workers = p.stops, p.share, p.compute, p.num_workers
        self.module, self.model, self.data, self.objective, self.ema = p.module, p.model, p.data, p.objective, p.ema
        self.finetune, self.pretrained = p.network.finetune, p.network.weights
        self.steps_per_epoch, self.step_log, self.optim = p.steps_per_epoch, p.step_log, p.optim
        self.tracker, self.system, self.selection = p.tracker, NoSystemMetrics(), p.selection
        self.checkpointer = p.checkpointer
        self.parts = {"model": self.module, **self.optim.parts(), "selection": self.selection,  # checkpointed
                      **({"ema": self.ema} if self.ema else {})}
        self.history: list[EpochStats] = []
        # the latest validation, checkpointed (validation_figures)
        self.last_validation: dict[str, float] = {}
        self.loader_served_validation = False  # a validation inside the epoch (epoch_steps starts the loader again)

    def fit(self) -> dict[str, float]:
        pos, run_id, progress = self._restore()
        self._open_run(run_id)
        if self.history or self.last_validation:
            self._publish_restored()
        self.tracker.log_metrics({"threads_per_process": torch.get_num_threads()},
                                 step=pos.epoch * self.steps_per_epoch + pos.step)
        for epoch in range(pos.epoch, self.cfg.num_epochs):
            resumed = epoch == pos.epoch
            if signum := self.stops.agreed():  # this position's checkpoint is on disk already
                raise Preempted(signum, epoch, pos.step if resumed else 0)
            if self.selection.should_stop(epoch):
                logger.info(f"early stopping after epoch {epoch}: no better validation accuracy since epoch "
                            f"{self.selection.best_epoch} ({self.selection.best_val_accuracy:.4f})")
                break
            stats = self.train_epoch(epoch, pos.step if resumed else 0, progress if resumed else EpochProgress())
            self._end_epoch(stats)
        return self.finish()

    def train_epoch(self, epoch: int, start_step: int, resumed: EpochProgress) -> EpochStats:
        """One epoch from ``start_step``; ``resumed``: what a checkpoint recorded of the steps before it."""
        meter = EpochMeter(self.device, resumed)
        if self.finetune.set_epoch(self.module, epoch):  # DDP hooks the parameters that need gradients: re-wrap
            del self.model
            self.model = wrap(self.module, self.info, self.cfg.train.compile)
            logger.info(f"epoch {epoch + 1}: the body is {'frozen' if self.finetune.frozen else 'trained again'} "
                        f"(train.freeze_body_epochs = {self.cfg.train.freeze_body_epochs})")
        bar = make_progress(self.info, self.cfg.train.progress_bar, f"epoch {epoch + 1}/{self.cfg.num_epochs}",
                            self.steps_per_epoch, start_step)
        self.model.train()
        self.finetune.freeze_batchnorm(self.module)
        with contextlib.closing(bar):
            for step, micro_batches in epoch_steps(self, epoch, start_step):
                self.train_step(micro_batches, epoch, step, meter)
                rebalance(self, epoch, step)  # another training started or ended on this host
                bar.step(step, meter)
                if step < self.steps_per_epoch:  # the epoch's end validates, checkpoints (and stops) in fit()
                    between_steps(self, epoch, step, meter)
        done = meter.total(self.info)
        stats = EpochStats.from_progress(epoch, done, self.optim.lr, self.validate(),
                                         self.validate(self.ema) if self.ema else None)
        logger.info(stats.summary(self.cfg.num_epochs))
        return stats

    def train_step(self, micro_batches: list[tuple], epoch: int, step: int, meter: EpochMeter) -> None:
        """Optimizer step ``step`` (from 1) of ``epoch`` (from 0) over ``grad_accum_steps`` micro-batches; DDP
        all-reduces the gradients during the last one's backward only (non-finite ones stop every rank here)."""
        for i, batch in enumerate(micro_batches):
            self._forward_backward(batch, epoch, meter, sync=i == len(micro_batches) - 1)
        norm = self.optim.step(self.module.parameters(), (epoch + 1, step))
        self.step_log.after(epoch, step, meter, self.optim.stepped_lr, norm, self.tracker)
        if self.ema is not None:
            self.ema.update(self.module)

    def _forward_backward(self, batch: tuple, epoch: int, meter: EpochMeter, sync: bool) -> None:
        x, labels, targets = self.objective.inputs(batch, epoch)
        with contextlib.nullcontext() if sync or not in_ddp(self.info) else self.model.no_sync():
            with self.compute.autocast():
                logits = self.model(x)
                loss = self.objective.loss(logits, labels, targets)
            self.optim.backward(loss)
        meter.add(loss, logits, labels)

    def _end_epoch(self, stats: EpochStats) -> None:
        """After epoch ``stats.epoch``'s validation: the selection (checkpointed state) and the checkpoint, then the
        epoch's metrics and the live files (a kill before the checkpoint logs nothing of it), then a search's report."""
        self.history.append(stats)
        self.selection.update(stats.epoch, stats.val_accuracy, self.module, self.ema, stats.ema_val_accuracy)
        self.last_validation = validation_figures(stats.epoch, self.steps_per_epoch, stats.logged())
        self._save(Position(stats.epoch, 0))
        self._log_epoch(stats)
        write_live(self)
        at = validation_number(stats.epoch, 0, self.steps_per_epoch, self.cfg.train.val_every_n_steps,
                               self.cfg.num_epochs)
        search_trial_after_validation(stats.logged(), at, self.tracker, self.info)  # a search's: report, maybe prune

    def _log_epoch(self, stats: EpochStats) -> None:
        # MLflow steps are epochs counted from 1, as in the history DVC plots
        self.tracker.log_metrics({**stats.logged(), "best_val_accuracy": self.selection.best_val_accuracy},
                                 step=stats.epoch)

    def _publish_restored(self) -> None:
        """A resume's checkpointed last epoch and validation inside an epoch logged again (what the run holds already
        is dropped at delivery) and the live files rewritten: a kill after the checkpoint loses nothing."""
        if self.history:
            self._log_epoch(self.history[-1])
        if self.last_validation and self.last_validation["val_step"] < self.steps_per_epoch:
            log_inside(self, self.last_validation)
        write_live(self)

    @torch.no_grad()
    def validate(self, average: WeightAverage | None = None) -> tuple[float, float]:
        """Loss and accuracy over the whole validation split, each sample counted exactly once; of the weights'
        moving ``average`` when given."""
        batches = self.data.eval_batches("val", self.run.eval_batch_size_per_rank)
        with average.applied(self.module) if average else contextlib.nullcontext(self.module) as module:
            return measure_split(module, batches, self.data.meta.sizes["val"], self.data.transform, self.info,
                                  self.compute, self.cfg.model.eval_flips)

    def _save(self, pos: Position, progress: EpochProgress | None = None) -> None:
        """Checkpoint ``pos``; ``progress``: the epoch's sums and seconds so far, for a mid-epoch one."""
        self.checkpointer.save(pos, self.parts, history=[asdict(h) for h in self.history],
                               run_id=self.tracker.run_id or "",
                               epoch_progress=(progress or EpochProgress()).as_state(),
                               world_size=self.info.world_size, last_validation=self.last_validation)

    def _restore(self) -> tuple[Position, str | None, EpochProgress]:
        """Where to start, the MLflow run to reopen, and the interrupted epoch's progress."""
        found = self.checkpointer.restore(self.parts)
        if found is None:
            return Position(0, 0), None, EpochProgress()
        pos, state = found
        self.history = [EpochStats(**h) for h in state["history"]]
        self.last_validation = dict(state.get("last_validation") or {})  # none in a checkpoint from before it was kept
        done = pos.epoch >= self.cfg.num_epochs or self.selection.should_stop(pos.epoch)
        was = int(state["world_size"] or self.info.world_size)  # None: not recorded (checkpoint format 0)
        logger.info(resume_note(self.cfg.paths.checkpoints, pos, done, was, self.info.world_size))
        progress = EpochProgress.from_state(state["epoch_progress"])
        return pos, state.get("run_id") or None, progress

    def _open_run(self, resume_run_id: str | None) -> None:
        """Start (or reopen) the MLflow run on rank 0, every rank learning its id (this node's system metrics go
        into it), and print the training's one-line description."""
        derived = derived_params(self)
        run_id = self.tracker.start(self.cfg, {**self.run.params(), **derived}, resume_run_id,
                                    run_markers(self.cfg), self.run.model_name)
        run_id = dd.broadcast_object(run_id, self.info)
        self.system = monitor_node(self.cfg.mlflow, self.info, run_id, resume_run_id is not None)
        logger.info(describe(self.run, self.info, self.compute, self.optim.effective_lr, derived))

    def finish(self) -> dict[str, float]:
        """Write the run's outputs (rank 0) and close its MLflow run."""
        self.checkpointer.flush()  # the last checkpoint first: a store away then is waited for (engine.store_pause)
        weights, exported_epoch, source = self.selection.exported(self.module, len(self.history), self.ema)
        metrics = stage_metrics(self, exported_epoch, source)
        seen = replace(self.data.meta, image_size=self.data.eval_size)  # the input the saved model takes
        save_outputs(self.run, TrainingOutputs(weights, exported_epoch, source, metrics, self.history, seen,
                                               self.data.examples(4)), self.tracker, self.info)
        search_trial_after_training(self.info, self.history, exported_epoch, source)  # a search's: its value
        self.system.stop()
        self.tracker.finish()
        dd.barrier(self.info)
        return metrics


def epoch_steps(t: Trainer, epoch: int, start_step: int) -> Iterator[tuple[int, list[tuple]]]:
    """The optimizer steps of ``epoch`` from ``start_step`` on this rank: each one's number (from 1) and its
    ``grad_accum_steps`` micro-batches (a new shuffle and new shards every epoch; a resumed epoch starts at its step).
    After a validation inside the epoch the loader starts again at the next step, as a resumed epoch does: its workers
    served the validation's batches meanwhile, which ends the training's pass over them (one DataLoader serves both)."""
    accum, step = t.cfg.train.grad_accum_steps, start_step
    while step < t.steps_per_epoch:
        first, t.loader_served_validation = step, False
        for micro_batches in in_steps(t.data.train_batches(epoch, step * accum, t.steps_per_epoch * accum), accum):
            step += 1
            yield step, micro_batches
            if t.loader_served_validation:
                break
        if step == first:  # the loader had nothing left (never, with a whole epoch's batches planned)
            return


def between_steps(t: Trainer, epoch: int, step: int, meter: EpochMeter) -> None:
    """After step ``step`` (from 1) of ``epoch`` (from 0), not the epoch's last: a validation when one is due
    (``train.val_every_n_steps``; skipped when the ranks agreed to stop, to stop sooner), then a step checkpoint when
    one is due, after such a validation, or when every rank agreed to stop; then the stop itself, or the validation's
    metrics and the live files (after its checkpoint: a kill before it logs nothing of it) and a search's pruner asked
    about it."""
    tc, signum = t.cfg.train, t.stops.agreed()
    values = validate_inside(t, epoch, step) if not signum and tc.val_every_n_steps and \
        step % tc.val_every_n_steps == 0 else None
    if signum or values or (tc.checkpoint_every_steps and step % tc.checkpoint_every_steps == 0):
        t._save(Position(epoch, step), meter.so_far(t.info))
    if signum:
        raise Preempted(signum, epoch, step)
    if values:
        log_inside(t, t.last_validation)
        write_live(t)
        at = validation_number(epoch + 1, step, t.steps_per_epoch, tc.val_every_n_steps, t.cfg.num_epochs)
        search_trial_after_validation(values, at, t.tracker, t.info)


def validate_inside(t: Trainer, epoch: int, step: int) -> dict[str, float]:
    """A validation after step ``step`` of ``epoch`` (from 0), inside it: exact over the ranks as an epoch's is (and of
    the moving average too, with one), said on rank 0 and kept as the trainer's last validation (logged by
    :func:`log_inside` once checkpointed); the training mode put back (a frozen body's BatchNorm stays frozen). Its
    figures by the epoch metrics' names. Its time counts in the epoch's seconds."""
    loss, accuracy = t.validate()
    t.loader_served_validation = True  # the training's batches start again at the next step (epoch_steps)
    values = {"val_loss": loss, "val_accuracy": accuracy}
    if t.ema is not None:
        values["ema_val_loss"], values["ema_val_accuracy"] = t.validate(t.ema)
    t.model.train()
    t.finetune.freeze_batchnorm(t.module)
    t.last_validation = validation_figures(epoch + 1, step, values)
    logger.info(f"epoch {epoch + 1}, step {step}/{t.steps_per_epoch}: val loss {loss:.4f} acc {accuracy:.4f}")
    return values


def validation_figures(epoch: int, step: int, metrics: dict[str, float]) -> dict[str, float]:
    """The trainer's last validation: after step ``step`` of epoch ``epoch`` (both from 1; the epoch's end: its steps),
    its figures of ``metrics``."""
    return {"val_epoch": epoch, "val_step": step, **{k: v for k, v in metrics.items() if k in VALIDATION_KEYS}}


def log_inside(t: Trainer, last: dict[str, float]) -> None:
    """A validation inside an epoch (``last``: :func:`validation_figures`) to MLflow at its global step, as
    ``val_loss_step``, ``val_accuracy_step`` (and the ``ema_`` ones)."""
    t.tracker.log_metrics({f"{key}_step": last[key] for key in VALIDATION_KEYS if key in last},
                          step=int(last["val_epoch"] - 1) * t.steps_per_epoch + int(last["val_step"]))


def write_live(t: Trainer) -> None:
    """The live files (``write_progress``): the stage's metrics of the epochs so far (none before the first ends) and
    the last validation's: ``last_val_epoch``, ``last_val_step`` (in that epoch), ``last_val_loss`` and the others."""
    so_far = stage_metrics(t, *t.selection.exported_epoch(len(t.history), t.ema is not None)) if t.history else {}
    write_progress(t.cfg, {**so_far, **{f"last_{k}": v for k, v in t.last_validation.items()}}, t.history, t.info)


def rebalance(t: Trainer, epoch: int, step: int) -> None:
    """After step ``step`` of ``epoch`` (from 0): the threads of this host's trainings shared anew when one started or
    ended beside this one (ddpipe.distributed.host_leases), said and logged."""
    if threads := t.share.rebalance():
        logger.info(f"threads per process now {threads} from epoch {epoch + 1}, step {step} (trainings sharing "
                    "this host's cores)")
        t.tracker.log_metrics({"threads_per_process": threads}, step=epoch * t.steps_per_epoch + step)


def stage_metrics(t: Trainer, exported_epoch: int, source: str) -> dict[str, float]:
    """The train stage's metrics of the epochs so far, the weights of ``exported_epoch`` (raw or ema) exported."""
    return final_metrics(t.history, t.selection.best_epoch, t.selection.best_val_accuracy, exported_epoch,
                         t.info.world_size, t.optim.effective_lr, source == "ema")


def derived_params(t: Trainer) -> dict[str, Any]:
    """Values computed from the config and the launch, recorded with the run (MLflow params)."""
    return {
        "world_size": t.info.world_size, "effective_lr": t.optim.effective_lr,
        "global_batch_size": t.run.global_batch_size(t.info.world_size),
        "steps_per_epoch": t.steps_per_epoch,
        "device_kind": t.run.device_kind,  # the row of engine.resolved.AUTO_CHOICES that `auto` took
        "host_sums": t.info.sums if t.info.distributed else "none",
        "resolved_precision": t.compute.precision, "channels_last": t.compute.channels_last,
        "deterministic_kernels": t.run.deterministic_kernels(t.device),
        "num_parameters": sum(p.numel() for p in t.module.parameters()),
        "threads_per_process_at_start": torch.get_num_threads(),
        "loader_workers": t.num_workers,  # data.num_workers resolved (engine.resolved.loader_workers)
        "input_size": "x".join(map(str, t.data.size)),  # what the network sees (data.image_size resolved)
        **({"weights_source": t.pretrained.source, "weights_sha256": t.pretrained.sha256}
           if t.pretrained else {}),
        # the GPUs this training was given (ddpipe.launch leases them: distributed.host_leases.GpuLease)
        "visible_gpus": os.environ.get("CUDA_VISIBLE_DEVICES", "all") if t.device.type == "cuda" else "none",
    }


def resume_note(directory: str, pos: Position, done: bool, was: int, now: int) -> str:
    """What a training that found its checkpoint at ``pos`` (written at world size ``was``) says it does."""
    if done:
        return f"{directory}: this run's {pos.epoch} epochs are already trained; writing its outputs"
    moved = f" (checkpointed at world size {was}, now {now}: the same global batch, so the same samples in every " \
        "step)" if was != now else ""
    return f"resuming from {directory} at epoch {pos.epoch + 1}, step {pos.step}{moved}"


def describe(run: Resolved, info: DistInfo, compute: PrecisionPolicy, effective_lr: float,
             derived: dict[str, Any]) -> str:
    """The training's line at its start: the job, the arithmetic, the batch and the network."""
    tc, sums = run.cfg.train, " + shared memory" if info.sums == "shared memory" else ""
    return (f"world size {info.world_size} ({info.num_nodes} node(s), backend {info.backend or 'none'}{sums}, "
            f"{info.device.type}, {torch.get_num_threads()} thread(s)/process), precision {compute.precision}, "
            f"effective lr {effective_lr:.6g} ({tc.lr_scaling} scaling of {tc.base_lr:g}), global batch "
            f"{derived['global_batch_size']}, {derived['steps_per_epoch']} steps/epoch; network {run.model_name} "
            f"at {derived['input_size']}{' (model.name auto: ' + run.device_kind + ')' if run.model_was_auto else ''}")


def agreed_auto(run: Resolved, info: DistInfo) -> Resolved:
    """``run`` with global rank 0's measured ``auto`` (ddpipe.engine.autotune) on every rank, said where it differs."""
    if run.auto is None or not info.distributed or (mine := run.auto.to_json()) == (
            chosen := dd.broadcast_object(mine, info)):
        return run
    logger.warning(f"rank {info.rank}: auto as global rank 0 measured it, not as this node did")
    return resolve(run.cfg, run.device, run.meta, autotune.Choice.from_json(chosen))


def in_steps(loader: Iterable[tuple], accum: int) -> Iterator[list[tuple]]:
    """The loader's micro-batches, ``accum`` at a time: one list per optimizer step."""
    batches = iter(loader)
    while step := list(itertools.islice(batches, accum)):
        yield step


def train(run: Resolved) -> dict[str, float]:
    """Set up this process, train ``run``, and always tear the process group down. ``run``: the config resolved
    for this process (the train stage's worker resolves and checks it first:
    ``ddpipe.launch.torchrun.worker_config``). A training that raises, is interrupted (SIGINT) or preempted
    (SIGTERM, SIGUSR1: it stops at a step after a checkpoint, see ddpipe.distributed.preemption) closes its MLflow run
    as FAILED or KILLED, saying why."""
    cfg = run.cfg
    follow_launcher(f"rank {os.environ.get('RANK', '0')}")  # a worker whose launcher dies stops as if preempted
    info = dd.init_distributed(cfg.distributed, run.backend)
    run = agreed_auto(run, info)
    trainer = hold = None
    try:
        hold = hold_training(cfg, info)  # before anything is written: InUse if another training writes here
        info = dd.open_host_sums(cfg.distributed, info)  # shared memory where distributed.shared_memory allows
        run.check_world_size(info.world_size)  # the job formed: an epoch has an optimizer step at its size
        share = HostShare(run.threads_per_process, info.processes_on_host, info.device.type == "cpu")
        with StopRequests(info, cfg.distributed.timeout_s) as stops, share:
            trainer = Trainer(build_parts(run, info, stops, share))
            return trainer.fit()
    except BaseException as exc:
        if isinstance(exc, Diverged) and info.is_main:  # its one line first, before what a stop could cut short
            logger.error(str(exc))
        if trainer is not None:  # this node's system metrics stop, and the run ends saying why
            trainer.system.stop()
            trainer.tracker.end_after(exc)
        if isinstance(exc, Diverged):  # every rank stopped at this step: none leaves before rank 0 closed the run
            search_trial_after_divergence(info, exc.epoch, exc.step, str(exc))  # a search learns from it
            dd.barrier(info)  # (torchrun stops the group once one rank has left)
        if isinstance(exc, (Preempted, StoreAway)):  # a search's trial runs again under its number, from its checkpoint
            search_trial_after_stop(info, str(exc))
        if isinstance(exc, RuntimeError) and info.distributed and dd.is_timeout(exc):
            # DistBackendError is a RuntimeError: fail within the bound, naming the silent ranks
            raise dd.explain_timeout(exc, info, cfg.distributed.timeout_s) from exc
        raise
    finally:
        if trainer is not None:
            trainer.data.loader.close()
        if hold is not None:
            hold.release()
        dd.cleanup()
