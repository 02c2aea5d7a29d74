"""The learning rate: its scaling with the world size, warm-up and cosine decay."""

from __future__ import annotations

import math

import pytest
from torch import nn

from ddpipe.config.schema import TrainConfig
from ddpipe.engine.optimizer import build_optimization, lr_lambda, lr_scale


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


@pytest.mark.parametrize("wd_norm_bias", [True, False])
def test_norms_and_biases_go_without_weight_decay_when_asked(wd_norm_bias: bool) -> None:
    net = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4, 2))
    cfg = TrainConfig(weight_decay=0.05, wd_norm_bias=wd_norm_bias)
    _, optimizer, _ = build_optimization(cfg, lambda lr: [{"params": list(net.parameters()), "lr": lr}], 1, 10, 1)
    decay = {id(p): g["weight_decay"] for g in optimizer.param_groups for p in g["params"]}
    assert len(decay) == len(list(net.parameters()))
    for name, p in net.named_parameters():
        assert decay[id(p)] == (0.05 if wd_norm_bias or p.ndim > 1 else 0.0), name
