"""The training loop: epochs of optimizer steps, exact distributed validation, checkpoints and resume.

Launch: ``python -m ddpipe.launch [key=value ...]`` (what dvc.yaml runs: torchrun with this node's
processes), or ``python stages/train.py`` for one plain process (no process group, no DDP wrapper).
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import os
from collections.abc import Iterable, Iterator
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpipe import distributed as dd
from ddpipe import hostcomm
from ddpipe.batchnorm import CPUSyncBatchNorm, convert_sync_batchnorm
from ddpipe.checkpoint import Checkpointer, Position, run_fingerprint
from ddpipe.config import Config, trajectory
from ddpipe.data.loading import TrainingData, input_size, steps_per_epoch
from ddpipe.data.store import Prepared, load_meta
from ddpipe.devices import Compute, cpu_count, deterministic_kernels, device_kind, loader_workers, resolve_auto
from ddpipe.exact import clip_grad_norm_ as exact_clip_grad_norm_
from ddpipe.exact import make_exact
from ddpipe.finetune import FineTuning
from ddpipe.hostshare import HostShare
from ddpipe.metrics import EpochMeter, EpochStats, evaluate_split, final_metrics
from ddpipe.models.pretrained import Pretrained, apply_pretrained, load_pretrained
from ddpipe.models.registry import RENAMED, build_model
from ddpipe.optim import build_optimization
from ddpipe.preemption import Preempted, StopRequests
from ddpipe.selection import ModelSelection
from ddpipe.tracking import TrainingOutputs, make_progress, make_tracker


class Trainer:
    """Builds everything from the config, then ``fit()`` trains, validates and checkpoints."""

    def __init__(self, cfg: Config, info: dd.DistInfo, stops: StopRequests | None = None,
                 share: HostShare | None = None) -> None:
        meta = load_meta(cfg.paths.prepared)
        side = input_size(meta, cfg.data.image_size)[0]
        self.auto_model = cfg.model.name == "auto"
        cfg = resolve_auto(cfg, info.device, side)  # model and batch for this device and input: logged as params
        self.cfg, self.info, tc = cfg, info, cfg.train
        self.stops = stops or StopRequests(info, cfg.distributed.timeout_s)  # asked at every step
        self.share = share or HostShare(cfg.distributed.threads_per_process, info.processes_on_host, enabled=False)
        self.compute = Compute.resolve(tc, info.device)
        deterministic_kernels(info.device)
        self.device = info.device
        self.pretrained = load_pretrained(cfg.model.weights) if cfg.model.weights else None
        if self.pretrained and (norm := self.pretrained.normalisation(meta.num_channels)):
            meta = replace(meta, mean=norm[0], std=norm[1])  # the input the weights were trained on
        self.num_workers = loader_workers(cfg.data.num_workers, meta.encoding, info.device, self._cores_share())
        self.data = TrainingData.load(cfg.paths.prepared, meta, tc, cfg.data.image_size, cfg.seed, info.rank,
                                      info.world_size, self.device, self.compute.channels_last, self.num_workers,
                                      self.compute.pin_memory)
        # Identical initial weights on every rank. Nothing in training draws from the global RNG after
        # this (augmentation is a hash of seed, epoch and index; the samplers seed their own generators):
        # a layer that did (Dropout) would draw the same numbers on every rank.
        torch.manual_seed(cfg.seed)
        self.module = training_module(cfg, self.data.meta, info, self.compute, self.pretrained)
        if self.pretrained:  # copied into the module: keep only what the run records of them
            self.pretrained = replace(self.pretrained, state_dict={})
        self.finetune = FineTuning(tc, self.module, len(meta.classes))
        self.model = wrap(self.module, info, tc.compile)
        self.steps_per_epoch = steps_per_epoch(self.data.meta.sizes["train"], tc, info.world_size)
        self.effective_lr, self.optimizer, self.scheduler = build_optimization(
            tc, lambda lr: self.finetune.param_groups(self.module, lr), info.world_size, self.steps_per_epoch,
            cfg.num_epochs)
        self.scaler = self.compute.grad_scaler()
        self.tracker = make_tracker(cfg.mlflow, info)
        self.selection = ModelSelection(tc)
        self.checkpointer = Checkpointer(cfg.paths.checkpoints, self._fingerprint(), tc.keep_checkpoints, info)
        self.history: list[dict[str, float]] = []

    def _cores_share(self) -> int:
        """Cores this rank may use: its CPU threads' share of the host (ddpipe.hostshare), or on CUDA the
        host's cores over this job's processes on it."""
        if self.device.type == "cuda":
            return max(1, cpu_count() // self.info.processes_on_host)
        return self.share.threads()

    def _fingerprint(self) -> str:
        """What a checkpoint of this run must match to be resumed (checkpoint.run_fingerprint)."""
        keys = trajectory(self.cfg)
        if self.cfg.model.name in RENAMED:  # torchvision's network now, not the small-stem one of older checkpoints
            keys["model.torchvision_stem"] = True
        return run_fingerprint(keys, self.derived()["global_batch_size"], self.effective_lr, asdict(self.data.meta))

    def derived(self) -> dict[str, Any]:
        """Values computed from the config and the launch, recorded with the run."""
        tc = self.cfg.train
        return {
            "world_size": self.info.world_size,
            "effective_lr": self.effective_lr,
            "global_batch_size": tc.batch_size_per_rank * self.info.world_size * tc.grad_accum_steps,
            "steps_per_epoch": self.steps_per_epoch,
            "device_kind": device_kind(self.device),  # the row of devices.AUTO_CHOICES that `auto` took
            "host_sums": "shared memory" if hostcomm.active() else ("gloo" if self.info.distributed else "none"),
            "resolved_precision": self.compute.precision,
            "channels_last": self.compute.channels_last,
            "num_parameters": sum(p.numel() for p in self.module.parameters()),
            "threads_per_process_at_start": torch.get_num_threads(),
            "loader_workers": self.num_workers,  # data.num_workers resolved (devices.loader_workers)
            "input_size": "x".join(map(str, self.data.size)),  # what the network sees (data.image_size resolved)
            **({"weights_source": self.pretrained.source, "weights_sha256": self.pretrained.sha256}
               if self.pretrained else {}),
            # the GPUs this training was given (ddpipe.launch leases them: hostshare.GpuLease)
            "visible_gpus": os.environ.get("CUDA_VISIBLE_DEVICES", "all") if self.device.type == "cuda" else "none",
        }

    # -- the loop ------------------------------------------------------------------------------

    def fit(self) -> dict[str, float]:
        pos, run_id, progress = self._restore()
        self.tracker.start(self.cfg, self.derived(), run_id, Path(self.cfg.paths.checkpoints))
        dd.print0(self._describe(), info=self.info)
        self.tracker.log_metrics({"threads_per_process": torch.get_num_threads()},
                                 step=pos.epoch * self.steps_per_epoch + pos.step)
        for epoch in range(pos.epoch, self.cfg.num_epochs):
            resumed = epoch == pos.epoch
            if signum := self.stops.agreed():  # this position's checkpoint is on disk already
                raise Preempted(signum, epoch, pos.step if resumed else 0)
            if self.selection.should_stop(epoch):
                dd.print0(f"early stopping after epoch {epoch}: no better validation accuracy since epoch "
                          f"{self.selection.best_epoch} ({self.selection.best_val_accuracy:.4f})", info=self.info)
                break
            stats = self.run_epoch(epoch, pos.step if resumed else 0, progress if resumed else EpochMeter.fresh())
            self._end_epoch(stats)
        return self.finish()

    def run_epoch(self, epoch: int, start_step: int, resumed: torch.Tensor) -> EpochStats:
        """One epoch from ``start_step``; ``resumed``: what a checkpoint recorded of the steps before it."""
        accum = self.cfg.train.grad_accum_steps
        # set_epoch(epoch): a new shuffle and new shards every epoch; a resumed epoch starts at its step
        loader = self.data.train_batches(epoch, start_step * accum, self.steps_per_epoch * accum)
        meter = EpochMeter(self.device, resumed)
        if self.finetune.set_epoch(self.module, epoch):  # DDP hooks the parameters that need gradients: re-wrap
            del self.model
            self.model = wrap(self.module, self.info, self.cfg.train.compile)
            dd.print0(f"epoch {epoch + 1}: the body is {'frozen' if self.finetune.frozen else 'trained again'} "
                      f"(train.freeze_body_epochs = {self.cfg.train.freeze_body_epochs})", info=self.info)
        bar = make_progress(self.info, self.cfg.train.progress_bar, f"epoch {epoch + 1}/{self.cfg.num_epochs}",
                            self.steps_per_epoch, start_step)
        self.model.train()
        self.finetune.freeze_batchnorm(self.module)
        with contextlib.closing(bar):
            for step, micro_batches in enumerate(in_steps(loader, accum), start=start_step + 1):
                self.train_step(micro_batches, epoch, meter)
                if threads := self.share.rebalance():  # another training started or ended on this host
                    self._record_threads(threads, epoch, step)
                bar.step(step, meter.sums, meter.seconds())
                if step < self.steps_per_epoch:  # the epoch's end checkpoints (and stops) in fit()
                    self._between_steps(epoch, step, meter)
        sums, seconds = meter.total(self.info)
        val_loss, val_acc = self.validate()
        stats = EpochStats.from_sums(epoch, sums, seconds, val_loss, val_acc, self.optimizer.param_groups[0]["lr"])
        dd.print0(stats.summary(self.cfg.num_epochs), info=self.info)
        return stats

    def train_step(self, micro_batches: list[tuple], epoch: int, meter: EpochMeter) -> None:
        """One optimizer step over ``grad_accum_steps`` micro-batches; DDP all-reduces the gradients
        during the last one's backward only."""
        for i, batch in enumerate(micro_batches):
            self._forward_backward(batch, epoch, meter, sync=i == len(micro_batches) - 1)
        self._optimizer_step()

    def _forward_backward(self, batch: tuple, epoch: int, meter: EpochMeter, sync: bool) -> None:
        images, labels, idx = batch
        x = self.data.transform(images.to(self.device, non_blocking=True), idx, epoch)
        labels = labels.to(self.device, non_blocking=True)
        with contextlib.nullcontext() if sync or not self.info.distributed else self.model.no_sync():
            with self.compute.autocast():
                logits = self.model(x)
                loss = F.cross_entropy(logits, labels, label_smoothing=self.cfg.train.label_smoothing)
            self.scaler.scale(loss / self.cfg.train.grad_accum_steps).backward()
        meter.add(loss, logits, labels)

    def _optimizer_step(self) -> None:
        tc = self.cfg.train
        if tc.grad_clip_norm is not None:
            self.scaler.unscale_(self.optimizer)
            clip = exact_clip_grad_norm_ if self.cfg.distributed.exact else nn.utils.clip_grad_norm_
            clip(self.module.parameters(), tc.grad_clip_norm)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()

    def _record_threads(self, threads: int, epoch: int, step: int) -> None:
        global_step = epoch * self.steps_per_epoch + step
        dd.print0(f"threads per process now {threads} from epoch {epoch + 1}, step {step} (trainings sharing "
                  "this host's cores)", info=self.info)
        self.tracker.log_metrics({"threads_per_process": threads}, step=global_step)

    def _between_steps(self, epoch: int, step: int, meter: EpochMeter) -> None:
        """A mid-epoch checkpoint when one is due or every rank agreed to stop; then the stop itself."""
        signum = self.stops.agreed()
        every = self.cfg.train.checkpoint_every_steps
        if signum or (every and step % every == 0):
            self._save(Position(epoch, step), meter.so_far(self.info))
        if signum:
            raise Preempted(signum, epoch, step)

    def _end_epoch(self, stats: EpochStats) -> None:
        self.history.append(asdict(stats))
        self.selection.update(stats.epoch, stats.val_accuracy, self.module)
        # MLflow steps are epochs counted from 1, as in the history DVC plots
        self.tracker.log_metrics({**{k: v for k, v in asdict(stats).items() if k != "epoch"},
                                  "best_val_accuracy": self.selection.best_val_accuracy}, step=stats.epoch)
        self._save(Position(stats.epoch, 0))

    @torch.no_grad()
    def validate(self) -> tuple[float, float]:
        """Loss and accuracy over the whole validation split, each sample counted exactly once."""
        batches = self.data.eval_batches("val", self.cfg.train.eval_batch_size_per_rank)
        return evaluate_split(self.module, batches, self.data.meta.sizes["val"], self.data.transform, self.info,
                              self.compute, self.cfg.model.eval_flips)

    # -- checkpoints ---------------------------------------------------------------------------

    def _stateful(self) -> dict[str, Any]:
        return {"model": self.module, "optimizer": self.optimizer, "scheduler": self.scheduler,
                "scaler": self.scaler, "selection": self.selection}

    def _save(self, pos: Position, progress: torch.Tensor | None = None) -> None:
        """Checkpoint ``pos``; ``progress``: the epoch's sums and seconds so far, for a mid-epoch one."""
        self.checkpointer.save(pos, self._stateful(), history=self.history, run_id=self.tracker.run_id or "",
                               epoch_progress=EpochMeter.fresh() if progress is None else progress,
                               world_size=self.info.world_size)

    def _restore(self) -> tuple[Position, str | None, torch.Tensor]:
        """Where to start, the MLflow run to reopen, and the interrupted epoch's progress."""
        found = self.checkpointer.restore(self._stateful())
        if found is None:
            return Position(0, 0), None, EpochMeter.fresh()
        pos, state = found
        self.history = list(state["history"])
        done = pos.epoch >= self.cfg.num_epochs or self.selection.should_stop(pos.epoch)
        was, now = int(state.get("world_size", self.info.world_size)), self.info.world_size
        moved = f" (checkpointed at world size {was}, now {now}: the same global batch, so the same samples in " \
            "every step)" if was != now else ""
        dd.print0(f"{self.cfg.paths.checkpoints}: this run's {pos.epoch} epochs are already trained; writing its "
                  "outputs" if done else f"resuming from {self.cfg.paths.checkpoints} at epoch {pos.epoch + 1}, "
                  f"step {pos.step}{moved}", info=self.info)
        return pos, state.get("run_id") or None, state.get("epoch_progress", EpochMeter.fresh())

    # -- the start and the end -----------------------------------------------------------------

    def _describe(self) -> str:
        info, tc, derived = self.info, self.cfg.train, self.derived()
        sums = " + shared memory" if hostcomm.active() else ""
        return (f"world size {info.world_size} ({info.num_nodes} node(s), backend {info.backend or 'none'}{sums}, "
                f"{self.device.type}, {torch.get_num_threads()} thread(s)/process), precision "
                f"{self.compute.precision}, effective lr {self.effective_lr:.6g} ({tc.lr_scaling} scaling of "
                f"{tc.base_lr:g}), global batch {derived['global_batch_size']}, "
                f"{self.steps_per_epoch} steps/epoch; network {self.cfg.model.name} at {derived['input_size']}"
                f"{' (model.name auto: ' + derived['device_kind'] + ')' if self.auto_model else ''}")

    def finish(self) -> dict[str, float]:
        """Write the run's outputs (rank 0) and close its MLflow run."""
        weights, exported_epoch = self.selection.exported(self.module, len(self.history))
        metrics = final_metrics(self.history, self.selection.best_epoch, self.selection.best_val_accuracy,
                                exported_epoch, self.info.world_size, self.effective_lr)
        seen = replace(self.data.meta, image_size=self.data.size)  # the input the saved model takes
        self.tracker.save_outputs(self.cfg, TrainingOutputs(weights, exported_epoch, metrics, self.history, seen,
                                                            self.data.examples(4)))
        self.tracker.finish()
        dd.barrier(self.info)
        return metrics


def in_steps(loader: Iterable[tuple], accum: int) -> Iterator[list[tuple]]:
    """The loader's micro-batches, ``accum`` at a time: one list per optimizer step."""
    batches = iter(loader)
    while step := list(itertools.islice(batches, accum)):
        yield step


def training_module(cfg: Config, meta: Prepared, info: dd.DistInfo, compute: Compute,
                    pretrained: Pretrained | None = None) -> nn.Module:
    """The network to train, from ``pretrained`` weights when given: world-size exact, or with synchronised
    BatchNorm under several processes."""
    module = build_model(cfg.model, meta.num_channels, len(meta.classes))
    if pretrained is not None:
        for line in apply_pretrained(module, pretrained, len(meta.classes)):
            dd.print0(line, info=info)
    if cfg.distributed.exact:
        module = make_exact(module)  # its BatchNorm is synchronised too
    elif info.distributed and info.world_size > 1 and cfg.distributed.sync_batchnorm:
        module = convert_sync_batchnorm(module, info.device)  # before the DDP wrap
    return compute.place(module)


def wrap(module: nn.Module, info: dd.DistInfo, compile_model: bool) -> nn.Module:
    """DDP under a process group (its gradient sums through shared memory where ``hostcomm`` is on),
    then torch.compile if asked."""
    model = module
    if info.distributed:
        # CPUSyncBatchNorm (ExactBatchNorm too) updates its running statistics from sums every rank gets
        # bit for bit, so they never differ between ranks: DDP's broadcast of them from rank 0 before
        # every forward (a blocking gloo collective per step) would copy equal bits.
        own_buffers = [m for m in module.modules() if list(m.buffers(recurse=False))]
        equal_buffers = all(isinstance(m, CPUSyncBatchNorm) for m in own_buffers)
        # torch 2.14 names it forward_sync_buffers (and deprecates broadcast_buffers); older torch has only the latter
        flag = "forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(DDP).parameters \
            else "broadcast_buffers"
        model = DDP(module, device_ids=[info.device.index] if info.device.type == "cuda" else None,
                    **{flag: not equal_buffers})
        if hostcomm.active() is not None:
            model.register_comm_hook(None, hostcomm.ddp_comm_hook)
    return torch.compile(model) if compile_model else model


def train(cfg: Config) -> dict[str, float]:
    """Set up this process, train, and always tear the process group down. A training that raises,
    is interrupted (SIGINT) or preempted (SIGTERM, SIGUSR1: it stops at a step after a checkpoint,
    see ddpipe.preemption) closes its MLflow run as FAILED or KILLED, saying why."""
    info = dd.init_distributed(cfg.distributed)
    trainer = None
    try:
        share = HostShare(cfg.distributed.threads_per_process, info.processes_on_host, info.device.type == "cpu")
        d = cfg.distributed
        if d.shared_memory and not d.exact and hostcomm.usable(info.world_size, info.processes_on_host,
                                                               info.device, info.backend):
            hostcomm.enable(info.rank, info.world_size, d.timeout_s)
        with StopRequests(info, cfg.distributed.timeout_s) as stops, share:
            trainer = Trainer(cfg, info, stops, share)
            return trainer.fit()
    except BaseException as exc:
        if trainer is not None:
            trainer.tracker.end_after(exc)
        if isinstance(exc, RuntimeError) and info.distributed and dd.is_timeout(exc):
            # DistBackendError is a RuntimeError: fail within the bound, naming the silent ranks
            raise dd.explain_timeout(exc, info, cfg.distributed.timeout_s) from exc
        raise
    finally:
        if trainer is not None:
            trainer.data.loader.close()
        hostcomm.disable()
        dd.cleanup()
