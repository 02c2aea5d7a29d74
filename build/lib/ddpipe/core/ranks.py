"""Who this process is among a job's ranks (:class:`DistInfo`): plain data, so that what only reads it (the
tracker, and through it the evaluate stage) imports nothing of ``ddpipe.distributed``, the process group, its
shared-memory transport or preemption. ``ddpipe.distributed`` makes it when the process joins the job."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DistInfo:
    """Who this process is. ``distributed`` is True when a process group exists (under torchrun); the
    defaults describe one plain CPU process."""

    distributed: bool = False
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    num_nodes: int = 1
    device: torch.device = torch.device("cpu")
    backend: str | None = None
    processes_on_host: int = 1  # this job's processes on this host (several agents may share one)
    # how sums over ranks travel: "shared memory" (ddpipe.distributed.host_sums), "gloo"/"nccl", or "none"
    sums: str = "none"

    @property
    def is_main(self) -> bool:
        return self.rank == 0
