"""The moving average of the weights: its arithmetic and warm-up, BatchNorm buffers, validation in place, and a
checkpoint round trip."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ddpipe.engine.ema import WeightAverage


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4 * 6 * 6, 3))


def test_the_average_follows_the_weights_and_buffers_with_a_warmed_up_decay() -> None:
    net = _net()
    ema = WeightAverage(net, 0.99)
    start = {k: v.clone() for k, v in net.state_dict().items()}
    assert [round(WeightAverage(net, 0.99).decay_now(), 4)] == [0.1]  # (1 + 0) / (10 + 0)
    net.train()
    net(torch.randn(8, 1, 8, 8))  # BatchNorm's running statistics and batch count move
    with torch.no_grad():
        net[3].weight.add_(1.0)
    ema.update(net)
    now = net.state_dict()
    for name, value in ema.average.items():
        if value.is_floating_point():  # parameters and running statistics: 0.1 of the old, 0.9 of the new
            assert torch.allclose(value, 0.1 * start[name] + 0.9 * now[name], atol=1e-6), name
        else:  # the batch count is copied
            assert torch.equal(value, now[name])
    for _ in range(5000):
        ema.update(net)
    assert ema.decay_now() == 0.99 and ema.updates == 5001


def test_validating_the_average_leaves_the_module_bit_for_bit_as_it_was() -> None:
    net = _net()
    ema = WeightAverage(net, 0.5)
    with torch.no_grad():
        for p in net.parameters():
            p.mul_(3.0)
    ema.update(net)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    params = [id(p) for p in net.parameters()]
    with ema.applied(net) as averaged:
        assert torch.equal(averaged[3].weight, ema.average["3.weight"])
    assert [id(p) for p in net.parameters()] == params  # in place: DDP's and the optimizer's tensors
    assert all(torch.equal(v, before[k]) for k, v in net.state_dict().items())


def test_the_average_travels_in_a_weights_only_checkpoint(tmp_path: Path) -> None:
    net = _net()
    ema = WeightAverage(net, 0.9)
    with torch.no_grad():
        net[0].weight.add_(1.0)
    ema.update(net)
    ema.update(net)
    torch.save({"ema": ema.state_dict()}, tmp_path / "c.pt")
    again = WeightAverage(_net(), 0.9)
    again.load_state_dict(torch.load(tmp_path / "c.pt", weights_only=True)["ema"])
    assert again.updates == 2 and again.decay_now() == ema.decay_now()
    assert all(torch.equal(again.average[k], v) for k, v in ema.average.items())
