"""A training's configuration with every ``auto`` made concrete for its device and the prepared data, by one
function: the launcher checks a job with it, and every worker resolves it once, checks it and trains with it.

``Config`` holds what the user set, ``auto`` words included (``train.batch_size_per_rank: auto``); a
:class:`Resolved` holds what the training runs with, typed: the network's name, the batches as ints, the
input size. :func:`resolve` is the one place where they depend on the device (``ddpipe.devices``' tables).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from ddpipe.checkpoint import run_fingerprint
from ddpipe.config.keys import flatten, trajectory
from ddpipe.config.schema import Config
from ddpipe.data.loading import check_global_batch, input_size, steps_per_epoch
from ddpipe.data.store import Prepared, load_meta
from ddpipe.devices import auto_choice, device_kind, eval_batch_size
from ddpipe.models.registry import RENAMED


@dataclass(frozen=True)
class Resolved:
    """The configuration a training runs with."""

    cfg: Config  # as loaded, with model.name concrete (auto: by device and input size)
    meta: Prepared  # the prepared data's meta.json
    input_size: list[int]  # what the network sees: data.image_size resolved
    batch_size_per_rank: int
    eval_batch_size_per_rank: int
    device_kind: str  # the row of ddpipe.devices' tables that `auto` took
    model_was_auto: bool

    def global_batch_size(self, world_size: int) -> int:
        return self.batch_size_per_rank * world_size * self.cfg.train.grad_accum_steps

    def steps_per_epoch(self, world_size: int) -> int:
        return steps_per_epoch(self.meta.sizes["train"], self.batch_size_per_rank, self.cfg.train.grad_accum_steps,
                               world_size)

    def check_world_size(self, world_size: int) -> None:
        """ConfigError unless an epoch has an optimizer step at ``world_size`` processes."""
        check_global_batch(self.meta.sizes["train"], self.batch_size_per_rank, self.cfg.train.grad_accum_steps,
                           world_size)

    def fingerprint(self, world_size: int, effective_lr: float, data: Prepared) -> str:
        """What a checkpoint of this run must match to be resumed (:func:`ddpipe.checkpoint.run_fingerprint`),
        ``data`` being the prepared data as the training reads it."""
        return run_fingerprint(self.trajectory(), self.global_batch_size(world_size), effective_lr, asdict(data))

    def params(self) -> dict[str, Any]:
        """Every config key flattened, with the values ``auto`` took: what the run records as its params."""
        return {**flatten(self.cfg), "train.batch_size_per_rank": self.batch_size_per_rank,
                "train.eval_batch_size_per_rank": self.eval_batch_size_per_rank}

    def trajectory(self) -> dict[str, Any]:
        """The keys that shape the training trajectory (``config.keys.trajectory``) with the network resolved."""
        keys = trajectory(self.cfg)
        if self.cfg.model.name in RENAMED:  # torchvision's network now, not the small-stem one of older checkpoints
            keys["model.torchvision_stem"] = True
        return keys


def resolve(cfg: Config, device: torch.device) -> Resolved:
    """``cfg`` for ``device`` and the data in ``paths.prepared`` (PreparedDataError if it cannot be read):
    ``model.name`` and ``train.batch_size_per_rank`` auto by :func:`ddpipe.devices.auto_choice`, an explicit
    value kept; ``train.eval_batch_size_per_rank`` auto: twice the training batch."""
    meta = load_meta(cfg.paths.prepared)
    size = input_size(meta, cfg.data.image_size)
    name, batch = auto_choice(device, size[0])
    requested = cfg.train.batch_size_per_rank
    model = replace(cfg.model, name=name) if cfg.model.name == "auto" else cfg.model
    return Resolved(cfg=replace(cfg, model=model), meta=meta, input_size=size,
                    batch_size_per_rank=batch if requested == "auto" else int(requested),
                    eval_batch_size_per_rank=eval_batch_size(cfg.train, device, size[0]),
                    device_kind=device_kind(device), model_was_auto=cfg.model.name == "auto")
