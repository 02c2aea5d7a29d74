"""All distributed plumbing: process group set-up and tear-down, rank/device/backend, threads, and every
exchange between ranks (BatchNorm over the global batch is ``ddpipe.distributed.batchnorm``'s, and sums through it).

Under ``torchrun`` the environment (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK...)
says who we are; as a plain ``python`` process we are rank 0 of 1 and no process group exists.

One way to sum over ranks: :func:`all_reduce_sum` (SyncBatchNorm's statistics, the epoch's sums, validation)
and DDP's gradient hook (:func:`wrap_ddp`). When every rank of a CPU job runs on this host, sums that fit go
through shared memory (``ddpipe.distributed.host_sums``, a transport: ``distributed.shared_memory``), else through the
process group. torch.distributed's collectives are called here and in that transport only.
"""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ddpipe.config.schema import DistributedConfig
from ddpipe.core.devices import cpu_count, keep_freed_memory
from ddpipe.core.ranks import DistInfo
from ddpipe.distributed import host_sums


def _env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


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


def init_distributed(cfg: DistributedConfig, backend: str) -> DistInfo:
    """Bind this process to its device, set its CPU threads, and join the process group on ``backend`` (nccl or
    gloo, resolved: ``ddpipe.engine.resolved``) if launched by torchrun. Each rank takes its device from LOCAL_RANK."""
    under_launcher = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    rank, world_size = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
    local_rank = _env_int("LOCAL_RANK", 0)
    local_world_size = _env_int("LOCAL_WORLD_SIZE", 1)
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if under_launcher:  # nccl without CUDA was refused when the run was resolved
        dist.init_process_group(
            backend=backend, store=_attempt_store(rank, world_size, cfg.timeout_s), rank=rank,
            world_size=world_size, timeout=datetime.timedelta(seconds=cfg.timeout_s),
            device_id=device if device.type == "cuda" else None,
        )
    sharing = local_world_size
    if device.type == "cpu":
        # Each process gets its share of the host's cores; more threads than cores just thrash.
        # (Other trainings on the host shrink it further while they run: ddpipe.distributed.host_leases.)
        sharing = _processes_on_this_host(local_world_size) if under_launcher else 1
        torch.set_num_threads(cfg.threads_per_process or max(1, cpu_count() // sharing))
        keep_freed_memory()  # a step's tensors reuse the last step's memory: no fresh pages faulted in every step
    num_nodes = max(1, world_size // max(1, local_world_size))
    return DistInfo(distributed=under_launcher, rank=rank, local_rank=local_rank, world_size=world_size,
                    local_world_size=local_world_size, num_nodes=num_nodes, device=device,
                    backend=backend if under_launcher else None, processes_on_host=sharing,
                    sums=backend if under_launcher else "none")


def open_host_sums(cfg: DistributedConfig, info: DistInfo) -> DistInfo:
    """Sums over ranks through shared memory from now on, when ``distributed.shared_memory`` is on, the mode is
    not exact (its sums stay on gloo, as it was measured) and every rank is a CPU process of this host (a
    collective: every rank calls it after :func:`init_distributed`); ``info`` saying how sums travel."""
    if not (cfg.shared_memory and not cfg.exact and info.distributed and host_sums.usable(
            info.world_size, info.processes_on_host, info.device, info.backend)):
        return info
    segment = use_host_sums(info.rank, info.world_size, cfg.timeout_s)
    return replace(info, sums="shared memory" if segment is not None else info.sums)


# This process's shared-memory transport while it is on (set by use_host_sums, dropped by cleanup): read only by
# the sums below, as torch.distributed keeps its default group.
_host_sums: host_sums.HostReduce | None = None


def use_host_sums(rank: int, world: int, timeout_s: float) -> host_sums.HostReduce | None:
    """Send this process's sums that fit through one shared-memory segment of this host's ranks (a collective:
    every rank calls it; :func:`open_host_sums` does when ``distributed.shared_memory`` allows); the segment.
    None, with rank 0 saying why, if it cannot be made: every sum then stays on the process group."""
    global _host_sums
    _host_sums = host_sums.open_segment(rank, world, timeout_s)
    return _host_sums


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
    """Leave the process group and drop the shared-memory transport."""
    global _host_sums
    _host_sums = None
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def world_size() -> int:
    """Ranks in the default process group (1 without one)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def barrier(info: DistInfo) -> None:
    if info.distributed:
        dist.barrier()


def all_reduce_sum(tensor: torch.Tensor, info: DistInfo | None = None) -> torch.Tensor:
    """``tensor`` replaced by its sum over the ranks (every rank calls it with the same shape and dtype): through
    shared memory when that transport is on and the tensor fits, else the process group; a no-op for one
    process (or when ``info`` says this one is alone)."""
    if (info is not None and not info.distributed) or world_size() == 1:
        return tensor
    if _host_sums is not None and _host_sums.fits(tensor):
        return _host_sums.all_reduce_(tensor)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def wrap_ddp(module: nn.Module, info: DistInfo, **kwargs: Any) -> nn.Module:
    """``module`` in DistributedDataParallel on this rank's device, its gradients averaged through the same
    transport as :func:`all_reduce_sum`."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(module, device_ids=[info.device.index] if info.device.type == "cuda" else None, **kwargs)
    if _host_sums is not None:
        model.register_comm_hook(_host_sums, host_sums.ddp_comm_hook)
    return model


def flag_group(info: DistInfo, timeout_s: int) -> Any:
    """A gloo group of every rank for one-integer CPU exchanges (the default group of a gloo job, a new one beside
    NCCL, so that asking never waits for the GPU); None without a process group."""
    if not info.distributed:
        return None
    if info.backend == "gloo":
        return dist.group.WORLD
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))


def start_max(tensor: torch.Tensor, group: Any) -> dist.Work:
    """Begin the all-reduce of ``tensor``'s maximum over ``group`` in place; ``.wait()`` on the result ends it."""
    return dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group, async_op=True)


def broadcast_object(obj: object, info: DistInfo) -> object:
    """Rank 0's ``obj`` on every rank."""
    if not info.distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]
