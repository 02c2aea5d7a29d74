"""The optimizer steps ``auto`` times (:mod:`ddpipe.engine.autotune`), fed as the training feeds them.

A plan is a list of :class:`Sample`: so many timed steps of a candidate (network, batch, precision, memory format)
with so many intra-op threads. :class:`StepTimer` runs a plan in its order and gives each sample's images/s; it
builds each candidate's network once and keeps it between plans, so a candidate warms up once.

What feeds the steps is a :class:`Feed`. :class:`LoaderFeed` is the training's own: its DataLoader over the prepared
data, with the loader workers the training would start (on the same cores as the steps), its batch transform and its
loss (``ddpipe.engine.objective``); a plan's batches are one pass of that loader, so the workers read ahead across
candidates as they do across a training's steps. Timed on random batches with no loader, the fastest candidate ran at
6,771 images/s and trained at 3,376-4,363 (issue 71): what is timed is what trains. :class:`SyntheticFeed` (random
batches of the input's shape, the model alone) is for a measurement without prepared data.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from ddpipe.config.schema import ModelConfig, TrainConfig
from ddpipe.core.devices import PrecisionPolicy
from ddpipe.data.loaders import BatchKey, TrainingData
from ddpipe.engine.objective import Objective
from ddpipe.engine.optimizer import Optimization

if TYPE_CHECKING:  # resolved imports this module
    from ddpipe.engine.resolved import Resolved

Candidate = tuple[str, int, str, bool]  # (model.name, batch per process, precision, channels_last)
STEPS_SCHEDULED = 10_000  # the lr schedule a timed candidate's optimizer follows: one epoch of so many steps


@dataclass(frozen=True)
class Sample:
    """One entry of a plan: ``steps`` timed optimizer steps of ``candidate`` with ``threads`` intra-op threads, after
    ``warmup`` untimed ones."""

    candidate: Candidate
    threads: int
    steps: int
    warmup: int = 0


class Feed(Protocol):
    """Where a timed step's batches come from, the loss it takes and the training section whose optimizer steps."""

    train: TrainConfig

    def serve(self, sizes: list[int]) -> Iterator[tuple]:
        """Batches of these sizes, in this order, from one pass."""

    def inputs(self, batch: tuple, channels_last: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(network input, labels, soft targets or None) of ``batch`` in the memory format asked."""

    def loss(self, logits: torch.Tensor, labels: torch.Tensor, targets: torch.Tensor | None) -> torch.Tensor:
        """The training's loss of ``logits``."""

    def close(self) -> None:
        """Stop what serves the batches (the loader's workers)."""


class SyntheticFeed:
    """Random batches of the input's shape, made once per size and layout: the model alone, no loader, the schema's
    optimizer."""

    def __init__(self, channels: int, classes: int, side: int) -> None:
        self.channels, self.classes, self.side, self.train = channels, classes, side, TrainConfig()
        self._made: dict[tuple[int, bool], tuple[torch.Tensor, torch.Tensor]] = {}

    def serve(self, sizes: list[int]) -> Iterator[tuple]:
        return iter([(size,) for size in sizes])

    def inputs(self, batch: tuple, channels_last: bool) -> tuple[torch.Tensor, torch.Tensor, None]:
        (size,) = batch
        if (size, channels_last) not in self._made:
            x = torch.randn(size, self.channels, self.side, self.side)
            x = x.contiguous(memory_format=torch.channels_last) if channels_last else x
            self._made[size, channels_last] = x, torch.randint(0, self.classes, (size,))
        return (*self._made[size, channels_last], None)

    def loss(self, logits: torch.Tensor, labels: torch.Tensor, targets: torch.Tensor | None) -> torch.Tensor:
        return F.cross_entropy(logits, labels)

    def close(self) -> None:
        pass


class LoaderFeed:
    """The training's batches: ``data``'s DataLoader (its workers), its transform in each candidate's memory format,
    MixUp/CutMix partners where the training mixes, and the training's loss. The samples are a seeded shuffle of
    the training split (its first epoch's views), taken in turn and again from the start when used up."""

    def __init__(self, data: TrainingData, tc: TrainConfig, device: torch.device, seed: int) -> None:
        self.data, self.train, self.device = data, tc, device
        n = data.meta.sizes["train"]
        self.order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
        self._objectives: dict[bool, Objective] = {}

    @classmethod
    def of(cls, run: Resolved, workers: int) -> LoaderFeed:
        """``run``'s training batches on its device, one process's, with ``workers`` loader workers."""
        data = run.training_data(run.meta, run.compute_on(run.device), rank=0, world_size=1, num_workers=workers)
        return cls(data, run.cfg.train, run.device, run.cfg.seed)

    @staticmethod
    def describe(run: Resolved, workers: int) -> str:
        """What :meth:`of` feeds, in the words that key a measurement (its cache file)."""
        tc = run.cfg.train
        where = "the device" if run.decode_on_device else "the workers"
        return (f"{run.meta.encoding} images, {workers} loader worker(s), decoded on {where}, {run.views}; "
                f"augment {tc.auto_augment}, erasing {tc.random_erasing}, mixup {tc.mixup_alpha}, cutmix "
                f"{tc.cutmix_alpha}, mix_prob {tc.mix_prob}, padding {tc.random_crop_padding}, hflip {tc.hflip}, "
                f"class_weights {tc.class_weights}")

    def serve(self, sizes: list[int]) -> Iterator[tuple]:
        keys, start, mixing = [], 0, self.data.mixing
        for size in sizes:
            indices = self.order[(start + torch.arange(size)) % len(self.order)]
            start += size
            keys.append(BatchKey("train", 0, indices, None, mixing.partners(indices, 0) if mixing else None))
        return self.data.loader.serve(keys)

    def inputs(self, batch: tuple, channels_last: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        return self._objective(channels_last).inputs(batch, 0)

    def loss(self, logits: torch.Tensor, labels: torch.Tensor, targets: torch.Tensor | None) -> torch.Tensor:
        return self._objective(False).loss(logits, labels, targets)

    def _objective(self, channels_last: bool) -> Objective:
        if channels_last not in self._objectives:
            data = replace(self.data, transform=self.data.transform.in_layout(channels_last))
            self._objectives[channels_last] = Objective(self.train, data, self.device)
        return self._objectives[channels_last]

    def close(self) -> None:
        self.data.loader.close()


class _Step:
    """One candidate's network on the CPU in its precision and memory format, stepped by the training's own
    :class:`~ddpipe.engine.optimizer.Optimization` of ``train`` (its optimizer, the gradient norm it checks every
    step or the clipping, the lr schedule): timed with plain SGD, the chosen candidate ran 1.21x the training's
    images/s (BENCHMARKS.md, "`auto` by measuring")."""

    def __init__(self, model: ModelConfig, train: TrainConfig, channels: int, classes: int,
                 candidate: Candidate) -> None:
        from ddpipe.models.catalog import build_model

        name, _, precision, channels_last = candidate
        torch.manual_seed(0)
        self.policy = PrecisionPolicy(torch.device("cpu"), precision, channels_last)
        self.module = self.policy.place(build_model(replace(model, name=name), channels, classes)).train()
        self.optim = Optimization(train, lambda lr: [{"params": list(self.module.parameters()), "lr": lr}], 1,
                                  STEPS_SCHEDULED, 1, self.policy.grad_scaler(), nn.utils.clip_grad_norm_)
        self.steps = 0

    def __call__(self, feed: Feed, batch: tuple) -> None:
        x, labels, targets = feed.inputs(batch, self.policy.channels_last)
        with self.policy.autocast():
            loss = feed.loss(self.module(x), labels, targets)
        self.optim.backward(loss)
        self.steps += 1
        self.optim.step(self.module.parameters(), (1, self.steps))


class StepTimer:
    """Times plans of candidates' steps fed by ``feed``, each candidate's network built with ``model``'s section
    (its width, kwargs) for ``channels`` and ``classes``."""

    def __init__(self, model: ModelConfig, channels: int, classes: int, feed: Feed) -> None:
        self.model, self.channels, self.classes, self.feed = model, channels, classes, feed
        self._steps: dict[Candidate, _Step] = {}

    def rates(self, plan: list[Sample]) -> list[float]:
        """Each sample's images/s, timed in the plan's order from one pass of the feed (the wait for a batch counts:
        the training waits for it too)."""
        batches = self.feed.serve([s.candidate[1] for s in plan for _ in range(s.warmup + s.steps)])
        before, rates = torch.get_num_threads(), []
        try:
            for sample in plan:
                torch.set_num_threads(sample.threads)
                step = self._step(sample.candidate)
                for _ in range(sample.warmup):
                    step(self.feed, next(batches))
                start = time.perf_counter()
                for _ in range(sample.steps):
                    step(self.feed, next(batches))
                rates.append(sample.candidate[1] * sample.steps / (time.perf_counter() - start))
        finally:
            torch.set_num_threads(before)
            getattr(batches, "close", lambda: None)()
        return rates

    def keep_only(self, candidates: list[Candidate]) -> None:
        """Let the other candidates' networks go (their memory): they are not timed again."""
        self._steps = {c: s for c, s in self._steps.items() if c in candidates}

    def _step(self, candidate: Candidate) -> _Step:
        if candidate not in self._steps:
            self._steps[candidate] = _Step(self.model, self.feed.train, self.channels, self.classes, candidate)
        return self._steps[candidate]
