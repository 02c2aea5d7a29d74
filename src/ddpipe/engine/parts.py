"""A training's parts, built from the resolved run for one rank, in one place and one order: the network on its
device (the same initial weights on every rank), the data, the DDP wrapper, the loss, the weight average, the
optimizer and its schedule, the MLflow tracker, the model selection and the checkpointer. The Trainer
(``ddpipe.engine.loop``) takes them built, as the DDP tutorials' and torchtitan's trainers do, and only trains.

The order is the training's arithmetic: the network is built right after the seed is set, before anything else
draws from the global RNG.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import asdict, dataclass, replace

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpipe.core.devices import PrecisionPolicy, cuda_kernels
from ddpipe.core.ranks import DistInfo
from ddpipe.data.loaders import TrainingData
from ddpipe.distributed import group as dd
from ddpipe.distributed.batchnorm import CPUSyncBatchNorm
from ddpipe.distributed.exact import clip_grad_norm_ as exact_clip_grad_norm_
from ddpipe.distributed.host_leases import HostShare
from ddpipe.distributed.preemption import StopRequests
from ddpipe.engine.assembly import Network, build_network
from ddpipe.engine.checkpoint import Checkpointer, run_fingerprint
from ddpipe.engine.ema import WeightAverage
from ddpipe.engine.meters import StepLog
from ddpipe.engine.objective import Objective
from ddpipe.engine.optimizer import Optimization
from ddpipe.engine.resolved import Resolved
from ddpipe.engine.selection import ModelSelection
from ddpipe.models.nets import global_pools_as_reductions
from ddpipe.tracking.tracker import Tracker, make_tracker

logger = logging.getLogger(__name__)


@dataclass
class TrainingParts:
    """What one rank trains with, built (:func:`build_parts`)."""

    run: Resolved
    info: DistInfo
    stops: StopRequests  # the ranks' agreement to stop at a step, asked at every step
    share: HostShare  # this rank's share of the host's cores
    compute: PrecisionPolicy
    network: Network  # as built: its fine-tuning, normalisation and pretrained weights
    module: nn.Module  # the network's module on this rank's device
    model: nn.Module  # ``module`` as it is called: under DDP (and torch.compile when asked)
    num_workers: int  # data.num_workers resolved
    data: TrainingData
    objective: Objective
    ema: WeightAverage | None
    steps_per_epoch: int
    step_log: StepLog
    optim: Optimization
    tracker: Tracker  # MLflow on global rank 0
    selection: ModelSelection
    checkpointer: Checkpointer


def build_parts(run: Resolved, info: DistInfo, stops: StopRequests | None = None,
                share: HostShare | None = None) -> TrainingParts:
    """``run``'s parts on this rank (``info``); ``stops`` and ``share`` as the worker holds them (a plain process, a
    benchmark: made here, the share not registered)."""
    cfg, tc = run.cfg, run.cfg.train
    stops = stops or StopRequests(info, cfg.distributed.timeout_s)
    share = share or HostShare(run.threads_per_process, info.processes_on_host, enabled=False)
    compute = run.compute_on(info.device)
    cuda_kernels(info.device, run.deterministic)
    network, module = placed_network(run, info, compute)
    meta = replace(run.meta, mean=network.mean, std=network.std)  # the input the network expects
    num_workers = run.loader_workers(share.cores(info.device))
    data = run.training_data(meta, compute, rank=info.rank, world_size=info.world_size, num_workers=num_workers)
    model = wrap(module, info, tc.compile)
    objective = Objective(tc, data, info.device)
    ema = WeightAverage(module, tc.ema_decay) if tc.ema_decay is not None else None
    steps_per_epoch = run.steps_per_epoch(info.world_size)
    step_log = StepLog(tc.log_every_n_steps, steps_per_epoch, info)
    optim = Optimization(tc, lambda lr: network.finetune.param_groups(module, lr), info.world_size,
                         steps_per_epoch, cfg.num_epochs, compute.grad_scaler(),
                         exact_clip_grad_norm_ if cfg.distributed.exact else nn.utils.clip_grad_norm_)
    tracker = make_tracker(cfg.mlflow, info)
    selection = ModelSelection(tc)
    fp = run_fingerprint(run.trajectory(), run.global_batch_size(info.world_size), optim.effective_lr, asdict(meta))
    checkpointer = Checkpointer(cfg.paths.checkpoints, fp, tc.keep_checkpoints, info)
    return TrainingParts(run, info, stops, share, compute, network, module, model, num_workers, data, objective, ema,
                         steps_per_epoch, step_log, optim, tracker, selection, checkpointer)


def placed_network(run: Resolved, info: DistInfo, compute: PrecisionPolicy) -> tuple[Network, nn.Module]:
    """The run's network and its module on this rank's device, with the same initial weights on every rank. Nothing
    in training draws from the global RNG after this (augmentation is keyed by seed, epoch and sample, its v2
    policies under a seeded generator put back after each image; the samplers seed their own generators): a layer
    that did (Dropout) would draw the same numbers on every rank."""
    torch.manual_seed(run.cfg.seed)
    network = build_network(run, info)
    for line in network.notes:
        logger.info(line)
    if run.deterministic_kernels(info.device):
        global_pools_as_reductions(network.module)
    return network, compute.place(network.module)


def in_ddp(info: DistInfo) -> bool:
    """Whether :func:`wrap` puts the module in DDP: under a process group of more than one process. One process
    (torchrun of one rank too) has nothing to sum, and its weights are the same bits without DDP (its average over
    one rank divides by 1); DDP's reducer cost that process 5% of its images/s (BENCHMARKS.md, "`auto` by
    measuring")."""
    return info.distributed and info.world_size > 1


def wrap(module: nn.Module, info: DistInfo, compile_model: bool) -> nn.Module:
    """DDP under a process group of more than one process (:func:`in_ddp`; its gradients summed as
    ``ddpipe.distributed`` sums), then torch.compile if asked."""
    model = module
    if in_ddp(info):
        # CPUSyncBatchNorm (ExactBatchNorm too) updates its running statistics from sums every rank gets
        # bit for bit, so they never differ between ranks: DDP's broadcast of them from rank 0 before
        # every forward (a blocking gloo collective per step) would copy equal bits.
        own_buffers = [m for m in module.modules() if list(m.buffers(recurse=False))]
        equal_buffers = all(isinstance(m, CPUSyncBatchNorm) for m in own_buffers)
        # torch 2.14 names it forward_sync_buffers (and deprecates broadcast_buffers); older torch has only the latter
        flag = "forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(DDP).parameters \
            else "broadcast_buffers"
        model = dd.wrap_ddp(module, info, **{flag: not equal_buffers})
    return torch.compile(model) if compile_model else model
