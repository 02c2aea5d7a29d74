"""The learning rate: its scaling with the world size, warm-up and cosine decay."""

from __future__ import annotations

import math

import pytest

from ddpipe.config.schema import TrainConfig
from ddpipe.optim import lr_lambda, lr_scale


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
