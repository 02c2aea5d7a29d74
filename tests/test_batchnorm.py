"""ddpipe.distributed.batchnorm: the CPU SyncBatchNorm at 2 gloo processes against torch's BatchNorm over the
concatenated batch, for every kind of BatchNorm a user's model may hold; the conversion; plain BatchNorm
outside a group.
(ExactBatchNorm is tested with the rest of the world-size-exact mode in test_exact.py.)"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ddpipe.distributed import group as dd
from ddpipe.distributed.batchnorm import CPUSyncBatchNorm, convert_sync_batchnorm
from ddpipe.models.nets import ResNetSmall
from tests.conftest import spawn

STEPS = 3
# fp32 compared with a tight tolerance, not bit for bit: the global statistics are summed in another order
# (per rank, then across ranks, in fp64) than one BatchNorm's over the whole batch.
RTOL, ATOL = 1e-5, 1e-6


@dataclass(frozen=True)
class Case:
    name: str
    layer: type[nn.Module]
    shape: tuple[int, ...]  # the global batch: 8 samples
    bounds: tuple[int, int, int] = (0, 5, 8)  # rank r holds samples bounds[r]:bounds[r + 1]
    affine: bool = True
    momentum: float | None = 0.3
    track_running_stats: bool = True
    memory_format: torch.memory_format = torch.contiguous_format
    std: float = 3.0
    mean: float = 1.0
    atol: float = ATOL


CASES = [
    Case("2d", nn.BatchNorm2d, (8, 3, 5, 4)),
    Case("2d channels_last", nn.BatchNorm2d, (8, 3, 5, 4), memory_format=torch.channels_last),
    # mean^2 / var = 1e4: combining the ranks' E[x^2] - mean^2 in fp32 would lose up to 6e-4 of the variance
    # to cancellation, 3e-4 of each output (the ranks' statistics are combined in fp64). Here x - mean itself
    # carries fp32's rounding of x (ulp(20) = 1.9e-6, 1e-5 of the std) in both implementations: measured
    # differences up to 6e-6, hence atol 2e-5.
    Case("2d large mean", nn.BatchNorm2d, (8, 3, 5, 4), std=0.2, mean=20.0, atol=2e-5),
    Case("2d 3 + 5 samples", nn.BatchNorm2d, (8, 3, 5, 4), bounds=(0, 3, 8)),
    Case("1d (N, C)", nn.BatchNorm1d, (8, 6)),
    Case("1d (N, C, L)", nn.BatchNorm1d, (8, 4, 7)),
    Case("3d", nn.BatchNorm3d, (8, 3, 4, 3, 2)),
    Case("3d channels_last", nn.BatchNorm3d, (8, 3, 4, 3, 2), memory_format=torch.channels_last_3d),
    Case("no affine", nn.BatchNorm2d, (8, 3, 5, 4), affine=False),
    Case("momentum None", nn.BatchNorm2d, (8, 3, 5, 4), momentum=None),
    Case("no running stats", nn.BatchNorm2d, (8, 3, 5, 4), track_running_stats=False),
    Case("1d bare", nn.BatchNorm1d, (8, 5), affine=False, momentum=None, track_running_stats=False),
    Case("empty rank", nn.BatchNorm2d, (8, 3, 5, 4), bounds=(0, 0, 8)),
    Case("empty rank, no affine", nn.BatchNorm1d, (8, 4, 7), bounds=(0, 8, 8), affine=False),
]


def _layers(case: Case) -> tuple[nn.Module, CPUSyncBatchNorm]:
    """torch's BatchNorm with random affine parameters, and its CPU-synchronised copy."""
    torch.manual_seed(0)
    reference = case.layer(case.shape[1], momentum=case.momentum, affine=case.affine,
                           track_running_stats=case.track_running_stats)
    if case.affine:
        with torch.no_grad():
            reference.weight.uniform_(0.5, 1.5)
            reference.bias.uniform_(-0.5, 0.5)
    synced = convert_sync_batchnorm(nn.Sequential(copy.deepcopy(reference)), torch.device("cpu"))[0]
    assert type(synced) is CPUSyncBatchNorm
    return reference, synced


def _check_case(case: Case, rank: int) -> list[str]:
    """Train both layers STEPS steps (torch's on the whole batch, ours on this rank's share), then one
    eval step; what differs, as messages."""
    failures: list[str] = []

    def close(what: str, got: torch.Tensor | None, expected: torch.Tensor | None) -> None:
        try:
            if got is None or expected is None:
                assert got is None and expected is None, f"{got} != {expected}"
            else:
                torch.testing.assert_close(got, expected, rtol=RTOL, atol=case.atol)
        except AssertionError as e:
            failures.append(f"rank {rank}, {case.name}: {what}: {' '.join(str(e).split())}")

    reference, synced = _layers(case)
    gen = torch.Generator().manual_seed(1)
    share = slice(case.bounds[rank], case.bounds[rank + 1])
    for step in range(STEPS):
        x_full = torch.randn(case.shape, generator=gen, dtype=torch.float64).float() * case.std + case.mean
        g_full = torch.randn(case.shape, generator=gen)
        x_ref = x_full.clone().requires_grad_()
        y_ref = reference(x_ref)
        (y_ref * g_full).sum().backward()
        x = x_full[share].clone().contiguous(memory_format=case.memory_format).requires_grad_()
        y = synced(x)
        (y * g_full[share]).sum().backward()
        close(f"output, step {step}", y, y_ref[share])
        close(f"input gradient, step {step}", x.grad, x_ref.grad[share])
    for name in ("weight", "bias"):  # parameter gradients are local; their sum over ranks is the full batch's
        param, expected = getattr(synced, name), getattr(reference, name)
        if param is None:
            close(f"{name} (none without affine parameters)", None, expected)
            continue
        grad = torch.zeros_like(param) if param.grad is None else param.grad  # None: zeros, to autograd
        dist.all_reduce(grad)
        close(f"{name} gradient", grad, expected.grad)
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        close(name, getattr(synced, name), getattr(reference, name))
        mine = getattr(synced, name)
        if mine is not None:  # the same bits on every rank: DDP need not broadcast them (training.wrap)
            every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
            dist.all_gather(every, mine)
            if not all(torch.equal(t, every[0]) for t in every):
                failures.append(f"rank {rank}, {case.name}: {name} differs between ranks: {every}")
    reference.eval()
    synced.eval()
    with torch.no_grad():  # eval: running statistics, or without them this rank's batch (as torch's SyncBatchNorm)
        close("eval output", synced(x), reference(x_full[share]))
    return failures


def _sync_rank(rank: int, world: int, shared_memory: bool) -> None:
    if shared_memory:  # the sums through shared memory, as a one-host training makes them
        assert dd.use_host_sums(rank, world, timeout_s=60)
    failures = [f for case in CASES for f in _check_case(case, rank)]
    # a global batch of one sample: torch's BatchNorm over it raises, so every rank does
    _, synced = _layers(CASES[0])
    with pytest.raises(ValueError, match="Expected more than 1 value per channel when training, got 1 over all"):
        synced(torch.randn(1 - rank, 3, 1, 1))
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("shared_memory", [False, True], ids=["gloo", "shared-memory"])
def test_cpu_sync_batchnorm_equals_batchnorm_over_the_concatenated_batch(shared_memory: bool) -> None:
    """Outputs, input gradients, parameter gradients summed over ranks, running statistics and eval outputs
    of every case in CASES, with the sums over gloo and through shared memory: one 2-process group runs
    them all (a spawn costs seconds)."""
    spawn(_sync_rank, 2, shared_memory)


def test_conversion_keeps_parameters_buffers_flags_and_dtype() -> None:
    """Every BatchNorm kind, torch's SyncBatchNorm included, becomes a CPUSyncBatchNorm with the same
    state, training flag and requires_grad; nested modules are converted too."""
    torch.manual_seed(0)
    frozen = nn.BatchNorm2d(3).eval()
    frozen.weight.requires_grad_(False)
    model = nn.Sequential(nn.BatchNorm1d(4, momentum=None), frozen, nn.Sequential(nn.BatchNorm3d(2, affine=False)),
                          nn.SyncBatchNorm(5, track_running_stats=False), nn.BatchNorm2d(6).double())
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            with torch.no_grad():
                for t in (m.weight, m.bias, m.running_mean, m.running_var):
                    if t is not None:
                        t.uniform_(0.5, 1.5)
            if m.num_batches_tracked is not None:
                m.num_batches_tracked.fill_(7)
    before = copy.deepcopy(model)
    synced = convert_sync_batchnorm(model, torch.device("cpu"))
    pairs = list(zip(before.modules(), synced.modules()))
    assert [type(b) for _, b in pairs].count(CPUSyncBatchNorm) == 5
    for a, b in pairs:
        if isinstance(b, CPUSyncBatchNorm):
            assert (b.num_features, b.eps, b.momentum, b.affine, b.track_running_stats, b.training) == \
                (a.num_features, a.eps, a.momentum, a.affine, a.track_running_stats, a.training)
    assert [(k, p.requires_grad) for k, p in synced.named_parameters()] == \
        [(k, p.requires_grad) for k, p in before.named_parameters()]
    state, expected = synced.state_dict(), before.state_dict()
    assert state.keys() == expected.keys()
    assert all(state[k].dtype == expected[k].dtype and torch.equal(state[k], expected[k]) for k in state)


def test_cpu_sync_batchnorm_is_plain_batchnorm_outside_a_group_and_in_eval() -> None:
    torch.manual_seed(0)
    model = ResNetSmall(1, 10, 8)
    synced = convert_sync_batchnorm(ResNetSmall(1, 10, 8), torch.device("cpu"))
    synced.load_state_dict(model.state_dict())  # same keys, same buffers
    num_bn = sum(isinstance(m, nn.BatchNorm2d) for m in model.modules())
    assert num_bn > 0 and sum(isinstance(m, CPUSyncBatchNorm) for m in synced.modules()) == num_bn
    x = torch.randn(4, 1, 28, 28)
    torch.testing.assert_close(synced(x), model(x))
    model.eval()
    synced.eval()
    torch.testing.assert_close(synced(x), model(x))


def _steps_leave_no_cycles(rank: int, world: int) -> None:
    import gc

    torch.manual_seed(0)
    model = convert_sync_batchnorm(ResNetSmall(1, 10, 4), torch.device("cpu"))
    gc.collect()
    gc.disable()
    try:
        for _ in range(5):
            model(torch.randn(8, 1, 28, 28)).sum().backward()
        cycles = gc.collect()
    finally:
        gc.enable()
    assert cycles == 0, f"{cycles} objects of the steps were left in reference cycles"


def test_a_step_frees_its_graph_without_the_cyclic_collector() -> None:
    """A training step's graph (with every activation it saved) must be freed as soon as the step ends: kept
    in a reference cycle, it waits for Python's cyclic GC, and a 2-process training grew by about 2 MB a step
    (1.2 GB in 3 Fashion-MNIST epochs) until one ran."""
    spawn(_steps_leave_no_cycles, 2)
