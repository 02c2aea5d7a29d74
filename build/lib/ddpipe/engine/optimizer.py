"""The optimizer and its learning rate: scaling with the world size, warm-up, cosine decay."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch

from ddpipe.config.schema import TrainConfig


def lr_scale(rule: str, world_size: int) -> float:
    """The learning-rate multiplier for ``world_size`` processes. sqrt: the gradient noise of a
    W-times larger global batch shrinks by sqrt(W), so the lr may grow by as much."""
    return {"sqrt": math.sqrt(world_size), "linear": float(world_size), "none": 1.0}[rule]


def lr_lambda(cfg: TrainConfig, steps_per_epoch: int, num_epochs: int) -> Callable[[int], float]:
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


def build_optimizer(cfg: TrainConfig, params: Iterable[torch.nn.Parameter] | list[dict], lr: float
                    ) -> torch.optim.Optimizer:
    """AdamW (``momentum`` is its beta1) or SGD with momentum, at peak learning rate ``lr`` (parameter groups
    may set their own: ``ddpipe.models.finetune``'s body)."""
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=cfg.momentum, nesterov=cfg.nesterov and cfg.momentum > 0,
                               weight_decay=cfg.weight_decay)
    return torch.optim.AdamW(params, lr=lr, betas=(cfg.momentum, 0.999), weight_decay=cfg.weight_decay)


def without_norm_bias_decay(groups: list[dict]) -> list[dict]:
    """Each group split in two: its weights of two or more dimensions (convolutions, linear layers, embeddings)
    keep the weight decay; its one-dimensional ones (normalisation weights, biases) get none, as torchvision's
    recipe (``norm_weight_decay=0``, ``bias_weight_decay=0``) and timm's do. Empty halves are left out."""
    split = []
    for group in groups:
        params = list(group["params"])
        for keep, wd in (([p for p in params if p.ndim > 1], {}), ([p for p in params if p.ndim <= 1],
                                                                      {"weight_decay": 0.0})):
            if keep:
                split.append({**group, "params": keep, **wd})
    return split


def build_optimization(cfg: TrainConfig, groups: Callable[[float], list[dict]], world_size: int,
                       steps_per_epoch: int, num_epochs: int
                       ) -> tuple[float, torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """(peak lr for ``world_size`` processes, the optimizer over the parameter ``groups`` made for that lr,
    its schedule: every group's lr follows the same warm-up and decay)."""
    lr = cfg.base_lr * lr_scale(cfg.lr_scaling, world_size)
    made = groups(lr)
    optimizer = build_optimizer(cfg, made if cfg.wd_norm_bias else without_norm_bias_decay(made), lr)
    return lr, optimizer, build_scheduler(cfg, optimizer, steps_per_epoch, num_epochs)


def build_scheduler(cfg: TrainConfig, optimizer: torch.optim.Optimizer, steps_per_epoch: int,
                    num_epochs: int) -> torch.optim.lr_scheduler.LambdaLR:
    """The per-step schedule of :func:`lr_lambda`, stepped after every optimizer step."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg, steps_per_epoch, num_epochs))


def grad_norm(params: list[torch.nn.Parameter]) -> torch.Tensor:
    """The global norm of ``params``' gradients, summed in fp64: it is not finite exactly where a gradient is not (no
    overflow of finite ones), so every rank, holding the same all-reduced gradients, agrees."""
    if not params:
        return torch.zeros((), dtype=torch.float64)
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad, dtype=torch.float64)
                                                 for p in params]))


class Diverged(RuntimeError):
    """The training stopped at a step whose gradients were not finite, before its optimizer step (every rank at the
    same step); the newest checkpoint holds the last good weights. Its text is the one line the worker prints."""

    def __init__(self, epoch: int, step: int, norm: float, cfg: TrainConfig) -> None:
        clip = "null" if cfg.grad_clip_norm is None else f"{cfg.grad_clip_norm:g}"
        super().__init__(
            f"training diverged at epoch {epoch}, step {step}: the gradient norm is {norm} (a loss gone to inf or NaN);"
            f" stopped before that step's update, nothing written as finished, the newest checkpoint kept. The usual "
            f"suspects: train.base_lr = {cfg.base_lr:g} (lower it) and train.grad_clip_norm = {clip} "
            "(set it, e.g. 1.0)")
        self.epoch, self.step, self.norm = epoch, step, norm


class Optimization:
    """One training's optimizer over the parameter ``groups`` made for its peak lr (``effective_lr``), the lr
    schedule and fp16 loss scaling: :meth:`backward` for each micro-batch's loss, :meth:`step` once per
    optimizer step (gradient clipping first, when ``train.grad_clip_norm`` is set)."""

    def __init__(self, cfg: TrainConfig, groups: Callable[[float], list[dict]], world_size: int, steps_per_epoch: int,
                 num_epochs: int, scaler: torch.amp.GradScaler, clip: Callable[..., torch.Tensor]) -> None:
        self.cfg, self.scaler, self.clip, self.stepped_lr = cfg, scaler, clip, 0.0
        self.effective_lr, self.optimizer, self.scheduler = build_optimization(cfg, groups, world_size,
                                                                               steps_per_epoch, num_epochs)

    def backward(self, loss: torch.Tensor) -> None:
        """The gradients of one of ``grad_accum_steps`` micro-batches' mean loss."""
        self.scaler.scale(loss / self.cfg.grad_accum_steps).backward()

    def step(self, parameters: Iterable[torch.nn.Parameter], where: tuple[int, int]) -> torch.Tensor | None:
        """Optimizer step ``where`` (epoch, step, both from 1); returns the global gradient norm before clipping.
        Gradients that are not finite (a loss gone to inf or NaN on any rank: DDP's sum spreads it to every rank's
        gradients, so every rank sees it at the same step) raise :class:`Diverged` before the optimizer steps: the
        weights stay the last good ones. Under fp16 loss scaling (None returned unless clipping) the scaler skips
        such a step itself."""
        params = [p for p in parameters if p.grad is not None]
        norm, scaled = None, self.scaler.is_enabled()
        if self.cfg.grad_clip_norm is not None:
            self.scaler.unscale_(self.optimizer)
            norm = self.clip(params, self.cfg.grad_clip_norm)
        elif not scaled:
            norm = grad_norm(params)
        if norm is not None and not scaled and not torch.isfinite(norm):  # one host sync a step
            raise Diverged(*where, float(norm), self.cfg)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.stepped_lr = self.lr  # the lr this step used (the schedule moves on now)
        self.scheduler.step()
        return norm

    @property
    def lr(self) -> float:
        """The first group's lr now (the head's, when fine-tuning gives the body less)."""
        return self.optimizer.param_groups[0]["lr"]

    def parts(self) -> dict[str, object]:
        """What a checkpoint holds of it, by name."""
        return {"optimizer": self.optimizer, "scheduler": self.scheduler, "scaler": self.scaler}
