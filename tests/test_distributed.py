"""Distributed plumbing on CPU with gloo and 2 processes: SyncBatchNorm equivalence, LR rules."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ddpipe.config import TrainConfig
from ddpipe.distributed import CPUSyncBatchNorm, convert_sync_batchnorm
from ddpipe.models import ResNetSmall
from ddpipe.training import lr_lambda, lr_scale
from tests.conftest import spawn


def _reference(x_full: torch.Tensor, g_full: torch.Tensor, steps: int) -> dict:
    torch.manual_seed(0)
    bn = nn.BatchNorm2d(x_full.shape[1], momentum=0.3)
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-0.5, 0.5)
    for _ in range(steps):
        x = x_full.clone().requires_grad_()
        y = bn(x)
        (y * g_full).sum().backward()
    return {"y": y.detach(), "dx": x.grad, "dw": bn.weight.grad / steps, "db": bn.bias.grad / steps,
            "mean": bn.running_mean, "var": bn.running_var, "n": bn.num_batches_tracked}


def _sync_bn_rank(rank: int, world: int, x_full: torch.Tensor, g_full: torch.Tensor, steps: int,
                  channels_last: bool, out_dir: Path) -> None:
    torch.manual_seed(0)
    bn = convert_sync_batchnorm(nn.Sequential(nn.BatchNorm2d(x_full.shape[1], momentum=0.3)),
                                torch.device("cpu"))[0]
    assert isinstance(bn, CPUSyncBatchNorm)
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-0.5, 0.5)
    # uneven shards: rank 0 gets 5 samples, rank 1 gets 3
    bounds = [0, 5, 8]
    sl = slice(bounds[rank], bounds[rank + 1])
    for _ in range(steps):
        x = x_full[sl].clone()
        if channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        x.requires_grad_()
        y = bn(x)
        (y * g_full[sl]).sum().backward()
    dw, db = bn.weight.grad.clone() / steps, bn.bias.grad.clone() / steps
    dist.all_reduce(dw)  # parameter gradients are local; their sum over ranks is the full-batch one
    dist.all_reduce(db)
    torch.save({"y": y.detach().contiguous(), "dx": x.grad.contiguous(), "dw": dw, "db": db,
                "mean": bn.running_mean.clone(), "var": bn.running_var.clone(),
                "n": bn.num_batches_tracked.clone()}, out_dir / f"rank{rank}.pt")


@pytest.mark.parametrize("channels_last, std, mean", [(False, 3.0, 1.0), (True, 3.0, 1.0), (False, 0.2, 20.0)])
def test_cpu_sync_batchnorm_equals_batchnorm_over_the_concatenated_batch(channels_last: bool, std: float, mean: float,
                                                                         tmp_path: Path) -> None:
    """Also with mean^2 / var = 1e4, where combining the ranks' E[x^2] - mean^2 in fp32 loses the
    variance to cancellation (the ranks' statistics are combined in fp64)."""
    gen = torch.Generator().manual_seed(1)
    x_full = torch.randn(8, 3, 5, 4, generator=gen, dtype=torch.float64).float() * std + mean
    g_full = torch.randn(8, 3, 5, 4, generator=gen)
    steps = 3
    ref = _reference(x_full, g_full, steps)
    spawn(_sync_bn_rank, 2, x_full, g_full, steps, channels_last, tmp_path)
    results = {r: torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1)}
    y = torch.cat([results[0]["y"], results[1]["y"]])
    dx = torch.cat([results[0]["dx"], results[1]["dx"]])
    torch.testing.assert_close(y, ref["y"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dx, ref["dx"], rtol=1e-4, atol=1e-5)
    for r in (0, 1):
        torch.testing.assert_close(results[r]["dw"], ref["dw"], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(results[r]["db"], ref["db"], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(results[r]["mean"], ref["mean"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(results[r]["var"], ref["var"], rtol=1e-5, atol=1e-6)
        assert int(results[r]["n"]) == int(ref["n"]) == steps


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


@pytest.mark.parametrize("rule, world, factor", [
    ("sqrt", 1, 1.0), ("sqrt", 4, 2.0), ("sqrt", 2, math.sqrt(2)),
    ("linear", 1, 1.0), ("linear", 8, 8.0), ("none", 8, 1.0),
])
def test_lr_scaling_rules(rule: str, world: int, factor: float) -> None:
    assert lr_scale(rule, world) == pytest.approx(factor)


def test_warmup_then_cosine_schedule() -> None:
    f = lr_lambda(TrainConfig(warmup_epochs=1.0, lr_schedule="cosine", min_lr_ratio=0.1), 10, 3)
    values = [f(s) for s in range(30)]
    assert values[0] == pytest.approx(0.1) and values[9] == pytest.approx(1.0)  # linear warm-up
    assert all(a >= b for a, b in zip(values[10:], values[11:]))  # then decays
    assert values[-1] == pytest.approx(0.1, abs=0.01)  # to the floor
    g = lr_lambda(TrainConfig(warmup_epochs=0.0, lr_schedule="constant"), 10, 3)
    assert {g(s) for s in range(30)} == {1.0}
