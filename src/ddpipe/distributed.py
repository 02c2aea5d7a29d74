"""All distributed plumbing: process group set-up and tear-down, rank/device/backend, threads,
SyncBatchNorm (including a CPU implementation), and reductions.

Under ``torchrun`` the environment (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK...)
says who we are; as a plain ``python`` process we are rank 0 of 1 and no process group exists.
"""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from ddpipe.config import DistributedConfig


@dataclass(frozen=True)
class DistInfo:
    """Who this process is. ``distributed`` is True when a process group exists (under torchrun)."""

    distributed: bool
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    num_nodes: int
    device: torch.device
    backend: str | None

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


def cpu_count() -> int:
    """Cores this process may run on (affinity/cgroup aware where the OS says)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def resolve_nproc(cfg: DistributedConfig) -> int:
    """Processes per node for torchrun. ``auto``: one per visible GPU; on a CPU-only machine one
    process that uses every core as intra-op threads, which measured faster here than one
    single-thread process per core (BENCHMARKS.md, "DDP overhead"). An int is taken as given."""
    if cfg.nproc_per_node != "auto":
        return int(cfg.nproc_per_node)
    return torch.cuda.device_count() if torch.cuda.is_available() else 1


def _attempt_store(rank: int, world_size: int, timeout_s: int) -> dist.Store:
    """torchrun's rendezvous store, with keys private to this restart attempt.

    After torchrun restarts a worker group (``--max-restarts``), the new workers could read the
    gloo addresses that the dead attempt left in the store and fail with "connectFullMesh ...
    Connection refused" (seen here with torch 2.14, intermittently). A prefix per
    TORCHELASTIC_RESTART_COUNT keeps each attempt's keys apart.
    """
    from torch.distributed.rendezvous import rendezvous

    store, _, _ = next(rendezvous("env://", rank, world_size, timeout=datetime.timedelta(seconds=timeout_s)))
    return dist.PrefixStore(f"ddpipe/attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def _processes_on_this_host(local_world_size: int) -> int:
    """How many ranks share this host. Usually LOCAL_WORLD_SIZE, but several torchrun agents can run
    on one host (a multi-node test, containers on one machine), each told it has the host alone."""
    names: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(names, socket.gethostname())
    return max(local_world_size, names.count(socket.gethostname()))


def init_distributed(cfg: DistributedConfig) -> DistInfo:
    """Bind this process to its device, set its CPU threads, and join the process group if launched
    by torchrun. Each rank takes its device from LOCAL_RANK."""
    under_launcher = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    rank, world_size = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
    local_rank = _env_int("LOCAL_RANK", 0)
    local_world_size = _env_int("LOCAL_WORLD_SIZE", 1)
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    backend = None
    if under_launcher:
        backend = cfg.backend if cfg.backend != "auto" else ("nccl" if device.type == "cuda" else "gloo")
        if backend == "nccl" and device.type != "cuda":
            raise ValueError("distributed.backend = 'nccl' needs CUDA GPUs; accepted here: auto or gloo")
        dist.init_process_group(
            backend=backend, store=_attempt_store(rank, world_size, cfg.timeout_s), rank=rank,
            world_size=world_size, timeout=datetime.timedelta(seconds=cfg.timeout_s),
            device_id=device if device.type == "cuda" else None,
        )
    if device.type == "cpu":
        # Each process gets its share of the host's cores; more threads than cores just thrash.
        sharing = _processes_on_this_host(local_world_size) if under_launcher else 1
        torch.set_num_threads(cfg.threads_per_process or max(1, cpu_count() // sharing))
    num_nodes = max(1, world_size // max(1, local_world_size))
    return DistInfo(under_launcher, rank, local_rank, world_size, local_world_size, num_nodes, device, backend)


class CollectiveTimeout(RuntimeError):
    """A collective outlived ``distributed.timeout_s``: some rank stopped answering."""


def is_timeout(exc: BaseException) -> bool:
    text = str(exc).lower()
    return "timed out" in text or "timeout" in text


def explain_timeout(exc: BaseException, info: DistInfo, timeout_s: int) -> CollectiveTimeout:
    """Name the ranks that stopped answering: after the timeout every healthy rank meets at a gloo
    monitored barrier, which reports the ranks that never arrive (best effort: on NCCL, or if the
    group is already broken, the message names this rank and the bound only)."""
    missing = ""
    if info.backend == "gloo":
        try:
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=max(5, timeout_s // 2)),
                                   wait_all_ranks=True)
        except Exception as probe:  # the barrier's own error names the missing ranks
            found = [line for line in str(probe).splitlines() if "failed to pass" in line]
            missing = f" {found[0].strip()}." if found else ""
    return CollectiveTimeout(
        f"rank {info.rank}/{info.world_size} (node {os.uname().nodename}, local rank {info.local_rank}): a "
        f"collective did not complete within distributed.timeout_s = {timeout_s} s, so another rank stopped "
        f"answering (hung, stopped, or its node is unreachable).{missing} Cause: {str(exc).splitlines()[0][:300]}"
    )


def cleanup() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def barrier(info: DistInfo) -> None:
    if info.distributed:
        dist.barrier()


def all_reduce_sum(tensor: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """Sum over ranks in place (no-op for one process)."""
    if info.distributed:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def broadcast_object(obj: object, info: DistInfo) -> object:
    """Rank 0's ``obj`` on every rank."""
    if not info.distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def print0(*args: object, info: DistInfo | None = None, **kwargs: object) -> None:
    """Print on global rank 0 only."""
    if info is None or info.is_main:
        print(*args, **kwargs, flush=True)


# ---------------------------------------------------------------------------------------------
# SyncBatchNorm


def affine(t: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """``t * scale + shift`` per channel in one fused pass: eval-mode batch_norm with mean 0, var 1
    and eps 0 is exactly that, and keeps bf16 activations bf16 (mixed bf16/fp32 addcmul was the
    slowest op of a step)."""
    zeros, ones = torch.zeros_like(scale), torch.ones_like(scale)
    return torch.batch_norm(t, scale, shift, zeros, ones, False, 0.0, 0.0, False)


def batchnorm_input_grad(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, mean: torch.Tensor,
                         invstd: torch.Tensor, mean_dy: torch.Tensor, mean_dy_xhat: torch.Tensor) -> torch.Tensor:
    """dx = w * invstd * (dy - mean(dy) - x_hat * mean(dy * x_hat)), the means over the global batch, as
    two fused per-channel affine maps of dy and x. The per-channel coefficients are computed in the
    dtype they come in (fp64 for the exact mode) and rounded to fp32 once."""
    a = weight * invstd
    b = -a * invstd * mean_dy_xhat
    offset = -a * mean_dy - b * mean
    a, b, offset = a.float(), b.float(), offset.float()
    dx = affine(dy, a, offset)
    dx += affine(x, b, torch.zeros_like(b))
    return dx


class _SyncBatchNormFunction(torch.autograd.Function):
    """Batch normalisation over the union of every rank's batch, with a hand-written backward.

    Forward all-reduces per-channel [sum, sum of squares, count]; backward all-reduces
    [sum(dy), sum(dy * x_hat)], as torch's CUDA SyncBatchNorm does; both in fp64 (a few values per
    channel). The passes over the activations use ATen's fused CPU batch-norm kernels (stats,
    eval-mode normalisation, backward reductions):
    composing var_mean and elementwise ops instead made a 2-process step 3x slower (BENCHMARKS.md).
    Weight and bias gradients stay local; DDP averages them like any other parameter's.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        # Per-rank statistics from ATen's kernel (fp64 accumulation inside; fp32 even for bf16
        # activations), combined across ranks in fp64: E[x^2] - mean^2 in fp32 would lose up to
        # mean^2/var x 6e-8 of the variance to cancellation.
        mean_l, var_l = (t.double() for t in torch.batch_norm_update_stats(x.float(), None, None, 0.0))
        n_l = x.numel() / x.shape[1]
        stats = torch.cat([mean_l * n_l, (var_l + mean_l * mean_l) * n_l, mean_l.new_full((1,), n_l)])
        dist.all_reduce(stats)
        c = x.shape[1]
        total = stats[2 * c]
        mean64 = stats[:c] / total
        var64 = (stats[c:2 * c] / total - mean64 * mean64).clamp_min(0.0)
        mean, var = mean64.float(), var64.float()
        y = torch.batch_norm(x, weight, bias, mean, var, False, 0.0, eps, False)
        invstd = torch.rsqrt(var64 + eps).float()
        ctx.save_for_backward(x, weight, mean, invstd)
        ctx.total, ctx.eps = total, eps
        return y, mean, var, total

    @staticmethod
    def backward(ctx, dy, _mean, _var, _total):
        x, weight, mean, invstd = ctx.saved_tensors
        _, sum_dy_xhat, sum_dy = torch.ops.aten.native_batch_norm_backward(
            dy, x, weight, None, None, mean, invstd, True, ctx.eps, [False, True, True])
        grad_weight, grad_bias = sum_dy_xhat.clone(), sum_dy.clone()  # local, as DDP expects
        both = torch.cat([sum_dy.double(), sum_dy_xhat.double()])
        dist.all_reduce(both)
        c = x.shape[1]
        mean_dy, mean_dy_xhat = (both[:c] / ctx.total).float(), (both[c:] / ctx.total).float()
        dx = batchnorm_input_grad(dy, x, weight.float(), mean, invstd, mean_dy, mean_dy_xhat)
        return dx.to(x.dtype), grad_weight.to(weight.dtype), grad_bias.to(weight.dtype), None


class CPUSyncBatchNorm(_BatchNorm):
    """BatchNorm whose batch statistics span all ranks, for CPU process groups (gloo).

    torch.nn.SyncBatchNorm raises for CPU tensors. This one gives the same outputs, input and
    parameter gradients (summed over ranks) and running statistics as one BatchNorm over the
    concatenated batch; running statistics are updated as torch does (momentum average,
    unbiased variance). Outside a multi-process group, or in eval mode, it is plain BatchNorm.
    """

    def _check_input_dim(self, x: torch.Tensor) -> None:
        if x.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {x.dim()}D input)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.training and dist.is_available() and dist.is_initialized()
                and dist.get_world_size() > 1):
            return super().forward(x)
        assert self.affine, "ddpipe's models use affine BatchNorm"
        with torch.autocast(x.device.type, enabled=False):
            y, mean, var, total = _SyncBatchNormFunction.apply(x, self.weight, self.bias, self.eps)
        if self.track_running_stats:
            self._update_running_stats(mean.detach(), var.detach(), float(total.detach()))
        return y

    @torch.no_grad()
    def _update_running_stats(self, mean: torch.Tensor, var: torch.Tensor, total: float) -> None:
        self.num_batches_tracked += 1
        momentum = self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)
        unbiased = var * (total / max(total - 1.0, 1.0))
        self.running_mean.mul_(1 - momentum).add_(mean, alpha=momentum)
        self.running_var.mul_(1 - momentum).add_(unbiased, alpha=momentum)


def convert_sync_batchnorm(model: nn.Module, device: torch.device) -> nn.Module:
    """Replace every BatchNorm with a synchronised one: torch's on CUDA, ours on CPU."""
    if device.type == "cuda":
        return nn.SyncBatchNorm.convert_sync_batchnorm(model)
    return _convert_cpu(model)


def _convert_cpu(module: nn.Module) -> nn.Module:
    out = module
    if isinstance(module, _BatchNorm) and not isinstance(module, CPUSyncBatchNorm):
        out = CPUSyncBatchNorm(module.num_features, module.eps, module.momentum,
                               module.affine, module.track_running_stats)
        if module.affine:
            with torch.no_grad():
                out.weight.copy_(module.weight)
                out.bias.copy_(module.bias)
        if module.track_running_stats:
            out.running_mean.copy_(module.running_mean)
            out.running_var.copy_(module.running_var)
            out.num_batches_tracked.copy_(module.num_batches_tracked)
    for name, child in module.named_children():
        out.add_module(name, _convert_cpu(child))
    return out
