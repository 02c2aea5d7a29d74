"""Sums through shared memory (ddpipe.distributed.host_sums, the transport behind ddpipe.distributed's sums): the same
bits as gloo's, DDP's gradients unchanged, and a peer that dies or stops answering noticed."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpipe.core.devices import cpu_count
from ddpipe.core.ranks import DistInfo
from ddpipe.distributed import group as dd
from ddpipe.distributed import host_sums
from tests.conftest import spawn

pytestmark = pytest.mark.skipif(not host_sums.usable(2, 2, torch.device("cpu"), "gloo"),
                                reason="shared-memory sums need x86-64 Linux with /dev/shm")


def _sums_rank(rank: int, world: int) -> None:
    reduce = dd.use_host_sums(rank, world, timeout_s=60)
    assert reduce is not None
    g = torch.Generator().manual_seed(rank)
    # many calls of changing sizes and dtypes, so both halves of the segment are reused
    for i, (n, dtype) in enumerate([(129, torch.float64), (7, torch.float32), (200_000, torch.float32),
                                    (5, torch.bfloat16), (1, torch.float64)] * 3):
        t = torch.randn(n, generator=g, dtype=torch.float64).to(dtype) * (i + 1)
        expected = t.clone()
        dist.all_reduce(expected)
        assert reduce.fits(t)
        assert torch.equal(dd.all_reduce_sum(t), expected), (n, dtype)
    big = torch.randn(host_sums.SLOT_BYTES // 4 + 1, generator=g)  # one slot too large: gloo takes it
    expected = big.clone()
    dist.all_reduce(expected)
    assert not reduce.fits(big) and torch.equal(dd.all_reduce_sum(big), expected)
    assert not any(p.name.startswith(f"ddpipe-{os.getuid()}-") for p in host_sums.SHM_DIR.iterdir()), \
        "the segment's name is removed once every rank has mapped it"


def test_shared_memory_sums_equal_gloo_sums_bit_for_bit() -> None:
    spawn(_sums_rank, 2)


def _ddp_rank(rank: int, world: int) -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(10, 64), nn.ReLU(), nn.Linear(64, 3))
    x = torch.randn(8, 10, generator=torch.Generator().manual_seed(rank))
    grads = []
    info = DistInfo(distributed=True, rank=rank, world_size=world)
    for shared in (False, True):
        if shared:
            assert dd.use_host_sums(rank, world, timeout_s=60)
        model = dd.wrap_ddp(nn.Sequential(*[layer for layer in net]), info) if shared else \
            DDP(nn.Sequential(*[layer for layer in net]))
        net.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        grads.append([p.grad.clone() for p in net.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_ddp_gradients_through_shared_memory_equal_the_default_hooks() -> None:
    spawn(_ddp_rank, 2)


def _dead_peer_rank(rank: int, world: int) -> None:
    reduce = host_sums.open_segment(rank, world, timeout_s=60)
    if rank == 1:
        os._exit(0)  # gone without a word
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank 1 \(pid \d+\) exited during a shared-memory all-reduce"):
        reduce.all_reduce_(torch.ones(3))
    assert time.monotonic() - started < 30


def _silent_peer_rank(rank: int, world: int) -> None:
    reduce = host_sums.open_segment(rank, world, timeout_s=2)
    if rank == 0:
        with pytest.raises(RuntimeError, match=r"timed out after 2 s waiting for rank\(s\) \[1\]"):
            reduce.all_reduce_(torch.ones(3))
    dist.barrier()  # rank 1 stayed silent in the all-reduce until rank 0 gave up


@pytest.mark.skipif(cpu_count() < 2, reason="a spinning rank and its peer need a core each")
def test_a_peer_that_dies_or_stops_answering_is_reported() -> None:
    spawn(_dead_peer_rank, 2)  # rank 1 exits with 0; the spawn passes only if rank 0 raised as expected
    spawn(_silent_peer_rank, 2)


def _no_segment_rank(rank: int, world: int) -> None:
    host_sums.SHM_DIR = Path("/nonexistent-ddpipe-test")  # this spawned process only
    assert dd.use_host_sums(rank, world, timeout_s=60) is None
    t = torch.full((3,), float(rank + 1))
    assert torch.equal(dd.all_reduce_sum(t), torch.full((3,), 3.0))  # over gloo


def test_without_a_segment_every_rank_sums_over_gloo() -> None:
    spawn(_no_segment_rank, 2)
