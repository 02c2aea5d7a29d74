"""The network a run trains, built in one place for the launcher's check and for every rank alike, as timm's
builder does: the network by name, its pretrained weights (a head of another size replaced, a stem summed over RGB
for grey images), the input normalisation those weights were trained with, the fine-tuning that finds its
classifier head, and exact mode's layers (or, under several processes, synchronised BatchNorm).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from torch import nn

from ddpipe.config.schema import ConfigError
from ddpipe.core.ranks import DistInfo
from ddpipe.distributed.batchnorm import convert_sync_batchnorm
from ddpipe.distributed.exact import check_exact, make_exact
from ddpipe.engine.resolved import Resolved
from ddpipe.models.catalog import build_model
from ddpipe.models.finetune import FineTuning
from ddpipe.models.pretrained import Pretrained, apply_pretrained, load_pretrained


@dataclass
class Network:
    """A run's network and what was learnt building it."""

    module: nn.Module
    finetune: FineTuning
    mean: list[float]  # the input normalisation: the pretrained weights' where they state one, else the data's
    std: list[float]
    weights: Pretrained | None  # where the pretrained weights came from (their tensors are in ``module`` now)
    notes: list[str]  # what adapting the weights changed, for the log


def build_network(run: Resolved, info: DistInfo | None = None) -> Network:
    """``run``'s network, fresh or from ``model.weights``. Without ``info`` it is a check (the launcher's, before
    any worker starts): exact mode's support is checked and no layer is swapped. For a rank (``info``): exact mode's
    layers swapped in, or synchronised BatchNorm when the job has several processes. ConfigError (WeightsError for
    the weights) for a name, keyword, weights file or fine-tuning setting that does not make a network."""
    cfg, meta = run.cfg, run.meta
    num_classes = len(meta.classes)
    module = build_model(run.model, meta.num_channels, num_classes)
    try:
        weights = load_pretrained(cfg.model.weights) if cfg.model.weights else None
        notes = apply_pretrained(module, weights, num_classes) if weights else []
        # the head by name: make_exact and SyncBatchNorm below keep every module's name when they swap layers
        finetune = FineTuning(cfg.train.body_lr_ratio, run.freeze_body_epochs, module, num_classes)
        if cfg.distributed.exact and info is None:  # the check: every layer supported, nothing swapped
            check_exact(module)
    except ConfigError:
        raise
    except ValueError as exc:
        raise ConfigError(f"{exc} (model.name = {run.model_name!r})") from None
    if info is not None and cfg.distributed.exact:
        module = make_exact(module)  # its BatchNorm is synchronised too
    elif info is not None and info.distributed and info.world_size > 1 and cfg.distributed.sync_batchnorm:
        module = convert_sync_batchnorm(module, info.device)  # before the DDP wrap
    mean, std = (weights and weights.normalisation(meta.num_channels)) or (meta.mean, meta.std)
    # copied into the module: keep only what the run records of them
    return Network(module, finetune, mean, std, replace(weights, state_dict={}) if weights else None, notes)
