"""The training loop: epochs, steps, exact distributed validation, checkpoints and resume.

Launch (see stages/train.py): ``torchrun --standalone --nproc-per-node=N stages/train.py [key=value ...]``
or ``python stages/train.py`` for one plain process (no process group, no DDP wrapper).
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpipe import checkpoint as ckpt
from ddpipe import distributed as dd
from ddpipe.config import Config, ConfigError, TrainConfig, flatten
from ddpipe.data import BatchTransform, InMemoryDataset, TrainShards, eval_loader, load_meta, real_sample_mask
from ddpipe.exact import clip_grad_norm_ as exact_clip_grad_norm_
from ddpipe.exact import make_exact
from ddpipe.fsutil import atomic_write_json, atomic_write_text
from ddpipe.models import build_model, save_model
from ddpipe.preemption import Preempted, StopRequests
from ddpipe.selection import ModelSelection
from ddpipe.tracking import NullTracker, make_tracker

# Keys that do not change the training trajectory: a run may resume across changes to these.
_NOT_TRAJECTORY = ("distributed.max_restarts", "distributed.timeout_s", "distributed.nproc_per_node",
                   "distributed.nnodes", "distributed.rdzv_endpoint", "distributed.rdzv_id",
                   "train.progress_bar", "train.checkpoint_every_steps", "train.keep_checkpoints",
                   "train.eval_batch_size_per_rank", "train.export", "distributed.shutdown_timeout_s")


# ---------------------------------------------------------------------------------------------
# Decisions that depend on the device


def cpu_supports_bf16() -> bool:
    """AVX512-BF16 or AMX: bf16 autocast is then ~2x faster than fp32 on CPU (BENCHMARKS.md)."""
    probe = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
    amx = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool((probe and probe()) or (amx and amx()))


def resolve_precision(requested: str, device: torch.device) -> str:
    """fp32/bf16/fp16 for this device; ConfigError for a precision the device cannot run."""
    if requested == "fp16" and device.type != "cuda":
        raise ConfigError("train.precision = 'fp16' needs a CUDA GPU (GradScaler); on CPU use "
                          "auto, fp32 or bf16")
    if requested != "auto":
        return requested
    if device.type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    return "bf16" if cpu_supports_bf16() else "fp32"


def use_channels_last(setting: str, device: torch.device, precision: str) -> bool:
    if setting != "auto":
        return setting == "on"
    return device.type == "cpu" or precision in ("bf16", "fp16")


def lr_scale(rule: str, world_size: int) -> float:
    """The learning-rate multiplier for ``world_size`` processes. sqrt: the gradient noise of a
    W-times larger global batch shrinks by sqrt(W), so the lr may grow by as much (the seed's rule)."""
    return {"sqrt": math.sqrt(world_size), "linear": float(world_size), "none": 1.0}[rule]


def preflight(cfg: Config) -> None:
    """Checks that need the device or the prepared data; run before torchrun starts any worker."""
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    resolve_precision(cfg.train.precision, device)
    if cfg.distributed.backend == "nccl" and device.type != "cuda":
        raise ConfigError("distributed.backend = 'nccl' needs CUDA GPUs; accepted here: auto or gloo")
    if cfg.distributed.exact and device.type != "cpu":
        raise ConfigError("distributed.exact = True is not accepted on CUDA (cuDNN picks its algorithms by "
                          "batch size, so results depend on the split); accepted there: false")
    meta = load_meta(cfg.paths.prepared)
    if cfg.distributed.exact:
        try:
            make_exact(build_model(cfg.model, meta["num_channels"], len(meta["classes"])))
        except ValueError as exc:
            raise ConfigError(f"{exc} (model.name = {cfg.model.name!r})") from None
    if meta["sizes"]["train"] < cfg.train.batch_size_per_rank:
        raise ConfigError(
            f"train.batch_size_per_rank = {cfg.train.batch_size_per_rank} is larger than the training "
            f"split ({meta['sizes']['train']} samples); accepted: at most the split size per process"
        )


def lr_lambda(cfg: TrainConfig, steps_per_epoch: int, num_epochs: int):
    """Per-step multiplier of the peak lr: linear warm-up, then cosine decay (or constant)."""
    total = max(1, steps_per_epoch * num_epochs)
    warmup = min(total, round(cfg.warmup_epochs * steps_per_epoch))

    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if cfg.lr_schedule == "constant":
            return 1.0
        progress = (step - warmup) / max(1, total - warmup)
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return f


# ---------------------------------------------------------------------------------------------
# The trainer


@dataclass
class EpochStats:
    epoch: int
    train_loss: float
    train_accuracy: float
    val_loss: float
    val_accuracy: float
    lr: float
    images_per_s: float
    epoch_seconds: float


class Trainer:
    """Builds everything from the config, then ``fit()`` trains, validates and checkpoints."""

    def __init__(self, cfg: Config, info: dd.DistInfo, stops: StopRequests | None = None) -> None:
        self.cfg, self.info, tc = cfg, info, cfg.train
        # stop signals seen by any rank, asked at every step (train() installs the handlers)
        self.stops = stops or StopRequests(info, cfg.distributed.timeout_s)
        self.device = info.device
        self.precision = resolve_precision(tc.precision, self.device)
        self.channels_last = use_channels_last(tc.channels_last, self.device, self.precision)
        if self.device.type == "cuda":  # determinism for a given seed and world size
            torch.backends.cudnn.benchmark = False
            torch.backends.cudnn.deterministic = True

        self.meta = load_meta(cfg.paths.prepared)
        self.train_set = InMemoryDataset.load(cfg.paths.prepared, "train")
        self.val_set = InMemoryDataset.load(cfg.paths.prepared, "val")
        self.transform = BatchTransform(self.meta["mean"], self.meta["std"], tc.random_crop_padding,
                                        tc.hflip, cfg.seed, self.device, self.channels_last)

        torch.manual_seed(cfg.seed)  # identical initial weights on every rank
        self.module = self._build_module()
        self.model: nn.Module = self.module
        if info.distributed:
            self.model = DDP(self.module, device_ids=[self.device.index] if self.device.type == "cuda" else None)
        if tc.compile:
            self.model = torch.compile(self.model)
        torch.manual_seed(cfg.seed + info.rank)  # rank-offset seed for any per-rank randomness

        self.shards = TrainShards(self.train_set, tc.batch_size_per_rank, info.rank, info.world_size, cfg.seed,
                                  self._pin)
        self.steps_per_epoch = len(self.shards) // tc.grad_accum_steps
        if self.steps_per_epoch < 1:
            raise ConfigError(
                f"train.grad_accum_steps = {tc.grad_accum_steps} x train.batch_size_per_rank = "
                f"{tc.batch_size_per_rank} x {info.world_size} processes exceeds the training split "
                f"({len(self.train_set)} samples); accepted: a global batch no larger than the split")
        self.effective_lr = tc.base_lr * lr_scale(tc.lr_scaling, info.world_size)
        self.optimizer = self._build_optimizer()
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(tc, self.steps_per_epoch, cfg.num_epochs))
        self.scaler = torch.amp.GradScaler("cuda", enabled=self.precision == "fp16")
        self.tracker: NullTracker = make_tracker(cfg.mlflow, info)
        self.selection = ModelSelection(tc)
        self.fingerprint = ckpt.fingerprint(self._trajectory())
        self.history: list[dict[str, float]] = []

    @property
    def _pin(self) -> bool:
        return self.device.type == "cuda"

    def _build_module(self) -> nn.Module:
        m = build_model(self.cfg.model, self.meta["num_channels"], len(self.meta["classes"]))
        if self.cfg.distributed.exact:
            m = make_exact(m)  # its BatchNorm is synchronised too
        elif self.info.distributed and self.info.world_size > 1 and self.cfg.distributed.sync_batchnorm:
            m = dd.convert_sync_batchnorm(m, self.device)  # before the DDP wrap
        m = m.to(self.device)
        return m.to(memory_format=torch.channels_last) if self.channels_last else m

    def _build_optimizer(self) -> torch.optim.Optimizer:
        tc = self.cfg.train
        if tc.optimizer == "sgd":
            return torch.optim.SGD(self.module.parameters(), lr=self.effective_lr, momentum=tc.momentum,
                                   nesterov=tc.nesterov and tc.momentum > 0, weight_decay=tc.weight_decay)
        return torch.optim.AdamW(self.module.parameters(), lr=self.effective_lr,
                                 betas=(tc.momentum, 0.999), weight_decay=tc.weight_decay)

    def _trajectory(self) -> dict[str, Any]:
        flat = {k: v for k, v in flatten(self.cfg).items()
                if not k.startswith(("paths.", "mlflow.")) and k not in _NOT_TRAJECTORY}
        return {**flat, "world_size": self.info.world_size, "data": self.meta}

    def derived(self) -> dict[str, Any]:
        """Values computed from the config and the launch, recorded with the run."""
        return {
            "world_size": self.info.world_size,
            "effective_lr": self.effective_lr,
            "global_batch_size": self.cfg.train.batch_size_per_rank * self.info.world_size
            * self.cfg.train.grad_accum_steps,
            "steps_per_epoch": self.steps_per_epoch,
            "resolved_precision": self.precision,
            "channels_last": self.channels_last,
            "num_parameters": sum(p.numel() for p in self.module.parameters()),
        }

    # -- resume --------------------------------------------------------------------------------

    def _resume(self) -> tuple[ckpt.Position, str | None, torch.Tensor]:
        """Load the newest valid checkpoint of this run on rank 0 and share it with every rank."""
        found = None
        if self.info.is_main:
            found = ckpt.load_latest(Path(self.cfg.paths.checkpoints), self.fingerprint)
            if found is None:
                others = ckpt.other_runs(Path(self.cfg.paths.checkpoints), self.fingerprint)
                why = (f"{len(others)} checkpoint(s) there belong to other configurations"
                       if others else "no checkpoint yet")
                dd.print0(f"starting fresh ({self.cfg.paths.checkpoints}: {why})")
        found = dd.broadcast_object(found, self.info)
        if found is None:
            return ckpt.Position(0, 0), None, _no_progress()
        pos, state = found
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])
        ckpt.set_rng_state(state["rng"])
        self.history = list(state["history"])
        self.selection.load_state_dict(state["selection"])
        if pos.epoch >= self.cfg.num_epochs or self.selection.should_stop(pos.epoch):
            dd.print0(f"{self.cfg.paths.checkpoints}: this run's {pos.epoch} epochs are already trained; "
                      "writing its outputs", info=self.info)
        else:
            dd.print0(f"resuming from {self.cfg.paths.checkpoints} at epoch {pos.epoch + 1}, step {pos.step}",
                      info=self.info)
        # the interrupted epoch's loss and accuracy sums and seconds so far (mid-epoch checkpoints)
        return pos, state.get("run_id") or None, state.get("epoch_progress", _no_progress())

    def _save(self, pos: ckpt.Position, progress: torch.Tensor | None = None) -> None:
        """Rank 0 writes the checkpoint of ``pos`` while the others wait. ``progress``: the epoch's sums
        over every rank and its seconds so far, for a checkpoint taken mid-epoch."""
        if self.info.is_main:
            state = {
                "model": self.module.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict(),
                "rng": ckpt.rng_state(), "history": self.history, "run_id": self.tracker.run_id or "",
                "selection": self.selection.state_dict(),
                "epoch_progress": _no_progress() if progress is None else progress,
            }
            ckpt.save_checkpoint(Path(self.cfg.paths.checkpoints), self.fingerprint, pos, state,
                                 self.cfg.train.keep_checkpoints)
        dd.barrier(self.info)

    # -- the loop ------------------------------------------------------------------------------

    def fit(self) -> dict[str, float]:
        pos, run_id, progress = self._resume()
        self.tracker.start(self.cfg, self.derived(), run_id, Path(self.cfg.paths.checkpoints))
        dd.print0(
            f"world size {self.info.world_size} ({self.info.num_nodes} node(s), backend "
            f"{self.info.backend or 'none'}, {self.device.type}, {torch.get_num_threads()} thread(s)/process), "
            f"precision {self.precision}, effective lr {self.effective_lr:.6g} "
            f"({self.cfg.train.lr_scaling} scaling of {self.cfg.train.base_lr:g}), global batch "
            f"{self.derived()['global_batch_size']}, {self.steps_per_epoch} steps/epoch", info=self.info)
        for epoch in range(pos.epoch, self.cfg.num_epochs):
            if signum := self.stops.agreed():  # this position's checkpoint is on disk already
                raise Preempted(signum, epoch, pos.step if epoch == pos.epoch else 0)
            if self.selection.should_stop(epoch):
                dd.print0(f"early stopping after epoch {epoch}: no better validation accuracy since epoch "
                          f"{self.selection.best_epoch} ({self.selection.best_val_accuracy:.4f})", info=self.info)
                break
            resumed = epoch == pos.epoch
            stats = self.run_epoch(epoch, pos.step if resumed else 0, progress if resumed else _no_progress())
            self.history.append(asdict(stats))
            self.selection.update(stats.epoch, stats.val_accuracy, self.module)
            # MLflow steps are epochs counted from 1, as in the history DVC plots
            self.tracker.log_metrics({**{k: v for k, v in asdict(stats).items() if k != "epoch"},
                                      "best_val_accuracy": self.selection.best_val_accuracy}, step=stats.epoch)
            self._save(ckpt.Position(epoch + 1, 0))
        return self.finish()

    def run_epoch(self, epoch: int, start_step: int, progress: torch.Tensor) -> EpochStats:
        """One epoch from ``start_step``; ``progress``: what a checkpoint recorded of the steps before it."""
        tc, info = self.cfg.train, self.info
        accum = tc.grad_accum_steps
        # set_epoch(epoch): a new shuffle and new shards every epoch; a resumed epoch starts at its step
        loader = self.shards.loader(epoch, start_step * accum, self.steps_per_epoch * accum)
        self.model.train()
        sums = torch.zeros(3, dtype=torch.float64, device=self.device)  # loss sum, correct, count
        bar = self._progress(epoch, len(loader) // accum, start_step)
        step, t0 = start_step, time.perf_counter() - progress[3].item()
        for i, (images, labels, idx) in enumerate(loader):
            images = images.to(self.device, non_blocking=True)
            labels = labels.to(self.device, non_blocking=True)
            x = self.transform(images, idx, epoch)
            last_micro = (i + 1) % accum == 0
            sync = contextlib.nullcontext() if last_micro or not info.distributed else self.model.no_sync()
            with sync:
                with self._autocast():
                    logits = self.model(x)
                    loss = F.cross_entropy(logits, labels, label_smoothing=tc.label_smoothing)
                self.scaler.scale(loss / accum).backward()
            with torch.no_grad():
                sums += torch.stack([loss.detach().double() * len(labels),
                                     (logits.argmax(1) == labels).sum().double(),
                                     torch.tensor(float(len(labels)), dtype=torch.float64, device=self.device)])
            if not last_micro:
                continue
            self._optimizer_step()
            step += 1
            if bar is not None:
                bar.update(1)
                if step % 10 == 0:
                    rate = sums[2].item() * info.world_size / (time.perf_counter() - t0)
                    bar.set_postfix(loss=f"{sums[0].item() / sums[2].item():.4f}", img_s=f"{rate:.0f}")
            if step == self.steps_per_epoch:  # the epoch's end checkpoints (and stops) in fit()
                continue
            signum = self.stops.agreed()
            if signum or (tc.checkpoint_every_steps and step % tc.checkpoint_every_steps == 0):
                sofar = dd.all_reduce_sum(sums.clone(), info) + progress[:3].to(self.device)
                self._save(ckpt.Position(epoch, step), torch.cat([sofar.cpu(), torch.tensor(
                    [time.perf_counter() - t0], dtype=torch.float64)]))
            if signum:
                if bar is not None:
                    bar.close()
                raise Preempted(signum, epoch, step)
        if bar is not None:
            bar.close()
        dd.all_reduce_sum(sums, info)
        sums += progress[:3].to(self.device)
        seconds = time.perf_counter() - t0
        val_loss, val_acc = self.validate()
        stats = EpochStats(
            epoch=epoch + 1,
            train_loss=(sums[0] / sums[2].clamp_min(1)).item(),
            train_accuracy=(sums[1] / sums[2].clamp_min(1)).item(),
            val_loss=val_loss, val_accuracy=val_acc,
            lr=self.optimizer.param_groups[0]["lr"],
            images_per_s=sums[2].item() / seconds if seconds > 0 else 0.0,
            epoch_seconds=seconds,
        )
        dd.print0(f"epoch {stats.epoch}/{self.cfg.num_epochs}: train loss {stats.train_loss:.4f} "
                  f"acc {stats.train_accuracy:.4f} | val loss {val_loss:.4f} acc {val_acc:.4f} | "
                  f"{stats.images_per_s:.0f} images/s, {seconds:.1f} s", info=info)
        return stats

    def _optimizer_step(self) -> None:
        tc = self.cfg.train
        if tc.grad_clip_norm is not None:
            self.scaler.unscale_(self.optimizer)
            if self.cfg.distributed.exact:
                exact_clip_grad_norm_(self.module.parameters(), tc.grad_clip_norm)
            else:
                torch.nn.utils.clip_grad_norm_(self.module.parameters(), tc.grad_clip_norm)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.precision == "fp32":
            return contextlib.nullcontext()
        dtype = torch.bfloat16 if self.precision == "bf16" else torch.float16
        return torch.autocast(self.device.type, dtype=dtype)

    def _progress(self, epoch: int, total: int, initial: int):
        if not (self.info.is_main and self.cfg.train.progress_bar):
            return None
        import sys

        from tqdm import tqdm

        # In a log file (DVC, CI, a cluster) every refresh is a line: refresh rarely there.
        interval = 2.0 if sys.stderr.isatty() else 30.0
        return tqdm(total=total + initial, initial=initial, desc=f"epoch {epoch + 1}/{self.cfg.num_epochs}",
                    unit="step", mininterval=interval, leave=False, dynamic_ncols=True)

    @torch.no_grad()
    def validate(self) -> tuple[float, float]:
        """Loss and accuracy over the whole validation split, each sample counted exactly once."""
        return evaluate_split(self.module, self.val_set, self.transform, self.info,
                              self.cfg.train.eval_batch_size_per_rank, self._autocast, self._pin)

    # -- the end -------------------------------------------------------------------------------

    def finish(self) -> dict[str, float]:
        paths, last = self.cfg.paths, self.history[-1]
        weights, exported_epoch = self.selection.exported(self.module, len(self.history))
        metrics = {
            "best_val_accuracy": self.selection.best_val_accuracy, "best_epoch": self.selection.best_epoch,
            "exported_epoch": exported_epoch, "epochs": len(self.history),
            "val_accuracy": last["val_accuracy"], "val_loss": last["val_loss"],
            "train_loss": last["train_loss"], "train_accuracy": last["train_accuracy"],
            "train_seconds": sum(h["epoch_seconds"] for h in self.history),
            "world_size": self.info.world_size, "effective_lr": self.effective_lr,
        }
        if self.info.is_main:
            save_model(weights, self.cfg.model, self.meta, paths.model, extra={"exported_epoch": exported_epoch})
            atomic_write_json(paths.train_metrics, {"train": metrics})
            atomic_write_text(paths.history, history_csv(self.history))
            atomic_write_json(paths.run_info, {"run_id": self.tracker.run_id or "",
                                               "tracking_uri": getattr(self.tracker, "uri", "")})
            self.tracker.log_metrics({"best_epoch": self.selection.best_epoch, "exported_epoch": exported_epoch})
            if self.cfg.mlflow.log_model:
                example = self.val_set.images[:4].numpy()  # as a client has them: uint8, N x H x W for grey
                self.tracker.log_model(Path(paths.model), example[:, 0] if example.shape[1] == 1 else example,
                                       self.cfg)
            self.tracker.print_link()
        self.tracker.finish()
        dd.barrier(self.info)
        return metrics


def _no_progress() -> torch.Tensor:
    """Epoch progress at an epoch's start: loss sum, correct, count, seconds."""
    return torch.zeros(4, dtype=torch.float64)


def history_csv(history: list[dict[str, float]]) -> str:
    keys = list(history[0])
    lines = [",".join(keys)] + [",".join(f"{h[k]:.6g}" for k in keys) for h in history]
    return "\n".join(lines) + "\n"


@torch.no_grad()
def evaluate_split(model: nn.Module, dataset: InMemoryDataset, transform: BatchTransform,
                   info: dd.DistInfo, batch_size: int, autocast, pin: bool) -> tuple[float, float]:
    """(mean loss, accuracy) over ``dataset``, spread over the ranks; DistributedSampler's padding
    repeats are excluded from every count."""
    was_training = model.training
    model.eval()
    sums = torch.zeros(3, dtype=torch.float64, device=info.device)
    seen = 0
    for images, labels, idx in eval_loader(dataset, batch_size, info.rank, info.world_size, pin):
        x = transform(images.to(info.device, non_blocking=True), idx, None)
        labels = labels.to(info.device, non_blocking=True)
        with autocast():
            logits = model(x).float()
        real = real_sample_mask(seen, len(labels), info.rank, info.world_size, len(dataset)).to(info.device)
        seen += len(labels)
        loss = F.cross_entropy(logits, labels, reduction="none")
        sums += torch.stack([(loss * real).sum().double(),
                             ((logits.argmax(1) == labels) & real).sum().double(), real.sum().double()])
    dd.all_reduce_sum(sums, info)
    model.train(was_training)
    return (sums[0] / sums[2]).item(), (sums[1] / sums[2]).item()


def train(cfg: Config) -> dict[str, float]:
    """Set up this process, train, and always tear the process group down. A training that raises,
    is interrupted (SIGINT) or preempted (SIGTERM, SIGUSR1: it stops at a step after a checkpoint,
    see ddpipe.preemption) closes its MLflow run as FAILED or KILLED, saying why."""
    info = dd.init_distributed(cfg.distributed)
    trainer = None
    try:
        with StopRequests(info, cfg.distributed.timeout_s) as stops:
            trainer = Trainer(cfg, info, stops)
            return trainer.fit()
    except BaseException as exc:
        if trainer is not None:
            trainer.tracker.end_after(exc)
        if isinstance(exc, RuntimeError) and info.distributed and dd.is_timeout(exc):
            # DistBackendError is a RuntimeError: fail within the bound, naming the silent ranks
            raise dd.explain_timeout(exc, info, cfg.distributed.timeout_s) from exc
        raise
    finally:
        dd.cleanup()
