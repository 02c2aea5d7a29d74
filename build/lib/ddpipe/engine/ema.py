"""An exponential moving average of a network's weights (``train.ema_decay``), as timm's ModelEmaV3, torchvision's
reference ``ExponentialMovingAverage`` and Lightning's ``WeightAveraging`` keep one.

After every optimizer step each floating-point entry of the network's state (parameters and BatchNorm's running
statistics alike) moves towards the network's: ``avg += (1 - d) * (w - avg)``; integer buffers (BatchNorm's
batch count) are copied. The decay warms up, ``d = min(decay, (1 + n) / (10 + n))`` after ``n`` updates (timm's
and TensorFlow's ``num_updates`` form), so the first averages are not anchored to the random initialisation.

The update is element-wise arithmetic on weights that every rank holds bit for bit, so every rank's average is
the same at any world size, and the average travels in the checkpoints (with its update count): a resumed run
averages exactly as an uninterrupted one. The trainer validates it each epoch beside the raw weights
(:meth:`WeightAverage.applied`), and ``ddpipe.engine.selection`` exports it when it validates better.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn


class WeightAverage:
    """The average of ``module``'s state, starting from its present weights."""

    def __init__(self, module: nn.Module, decay: float) -> None:
        self.decay, self.updates = decay, 0
        self.average = {name: value.detach().clone() for name, value in module.state_dict().items()}

    def decay_now(self) -> float:
        """The decay of the next update (warmed up)."""
        return min(self.decay, (1 + self.updates) / (10 + self.updates))

    @torch.no_grad()
    def update(self, module: nn.Module) -> None:
        """One step towards ``module``'s state (after an optimizer step)."""
        weight = 1.0 - self.decay_now()
        averaged, current = [], []
        for name, value in module.state_dict().items():
            mine = self.average[name]
            if mine.is_floating_point():
                averaged.append(mine)
                current.append(value.detach())
            else:
                mine.copy_(value)
        if averaged:
            torch._foreach_lerp_(averaged, current, weight)
        self.updates += 1

    @contextlib.contextmanager
    def applied(self, module: nn.Module) -> Iterator[nn.Module]:
        """``module`` holding the average for the ``with`` block (validation), its own state put back bit for bit
        afterwards (copies in place: a DDP wrapper and the optimizer keep their tensors)."""
        own = {name: value.detach().clone() for name, value in module.state_dict().items()}
        module.load_state_dict(self.average)
        try:
            yield module
        finally:
            module.load_state_dict(own)

    def weights(self) -> dict[str, torch.Tensor]:
        """A CPU copy of the average (what an export of it saves)."""
        return {name: value.detach().to("cpu", copy=True) for name, value in self.average.items()}

    def state_dict(self) -> dict[str, object]:
        """For the checkpoint (tensors and numbers only, so ``weights_only`` loading accepts it)."""
        return {"updates": self.updates, "decay": self.decay, "average": self.average}

    def load_state_dict(self, state: dict[str, object]) -> None:
        self.updates = int(state["updates"])  # type: ignore[arg-type]
        average = state["average"]
        assert isinstance(average, dict)
        for name, value in average.items():
            self.average[name].copy_(value)
