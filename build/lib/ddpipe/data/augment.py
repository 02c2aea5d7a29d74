"""Augmentation beyond the crop and the flip, keyed as they are, so that no rank, worker, world size or resume
changes a step.

Per image (:class:`ImagePolicy`): TrivialAugmentWide or RandAugment, then RandomErasing, torchvision.transforms.v2's
own transforms on the uint8 image. They draw from torch's global generator; each image is transformed with that
generator seeded by (seed, epoch, sample key) and restored afterwards, so the draws are the sample's alone.

Between samples (:class:`Mixing`): MixUp and CutMix with soft targets. torchvision's v2.MixUp and v2.CutMix pair
each image of a batch with its neighbour (``roll(1)``) and draw one share for the batch: a rank's batch is
a different set of images at every world size, so those pairs, and the step, would change with it. Here each
sample's partner is a sample of the whole training split chosen by (seed, epoch, sample key), loaded beside it,
and each sample draws its own share (timm's ``mode="elem"``), with v2's conventions: the share from
Beta(alpha, alpha), CutMix's box centred uniformly with sides ``sqrt(1 - share)`` of the image's, clipped, and
the share recomputed from the box's area. The mixing is element-wise on the normalised batch, on the device.

A sample key is the sample's index, or for a sample drawn again in the same epoch (``train.sampler:
balanced``) its index plus the split's size times the number of earlier draws (``ddpipe.data.sampling``).
"""

from __future__ import annotations

import hashlib
import math
import struct
from dataclasses import dataclass

import numpy as np
import torch

from ddpipe.config.schema import TrainConfig

_POLICY, _MIX = 1, 2  # streams: the per-image policy's seed and the mixing draws never share numbers


def keyed_rng(seed: int, epoch: int, key: int, *stream: int) -> np.random.Generator:
    """A generator that only (seed, epoch, sample key[, stream]) determine (the crops draw from the stream-less
    one)."""
    return np.random.default_rng([seed, epoch, key, *stream])


def key_seed(seed: int, epoch: int, key: int, stream: int) -> int:
    """A 63-bit seed that only (seed, epoch, sample key, stream) determine."""
    digest = hashlib.blake2b(struct.pack("<qqqq", seed, epoch, key, stream), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class ImagePolicy:
    """v2's TrivialAugmentWide or RandAugment, then RandomErasing, on one uint8 ``C x H x W`` training image."""

    def __init__(self, transforms: list, seed: int) -> None:
        self.transforms, self.seed = transforms, seed

    @classmethod
    def from_config(cls, tc: TrainConfig, mean: list[float], seed: int) -> ImagePolicy | None:
        """The policy ``tc`` asks for (``mean``: the normalisation's, 0-1, the erased rectangle's colour: zero
        after normalisation, as torchvision's reference erases after Normalize); None when it asks for none."""
        if tc.auto_augment == "none" and tc.random_erasing <= 0:
            return None  # without importing torchvision (1.5 s of a process's start)
        from torchvision.transforms import v2  # here: the launcher and stages need no torchvision

        transforms: list = []
        if tc.auto_augment == "trivialaugment":
            transforms.append(v2.TrivialAugmentWide())
        elif tc.auto_augment == "randaugment":
            transforms.append(v2.RandAugment(num_ops=tc.randaugment_ops, magnitude=tc.randaugment_magnitude))
        if tc.random_erasing > 0:
            transforms.append(v2.RandomErasing(p=tc.random_erasing, value=[round(m * 255) for m in mean]))
        return cls(transforms, seed) if transforms else None

    def __call__(self, image: torch.Tensor, epoch: int, key: int) -> torch.Tensor:
        generator = torch.default_generator  # what v2 draws from; torch.manual_seed would also reseed CUDA (slow)
        state = generator.get_state()
        generator.manual_seed(key_seed(self.seed, epoch, key, _POLICY))
        try:
            for transform in self.transforms:
                image = transform(image)
        finally:
            generator.set_state(state)
        return image


@dataclass(frozen=True)
class MixPlan:
    """Each sample's mixing: MixUp (``mixup``), CutMix (``cutmix``, its box rows ``[y0, y1)`` and columns
    ``[x0, x1)``) or neither, and the share of the sample's own image and target (``lam``; 1: unmixed)."""

    mixup: torch.Tensor  # bool [B]
    cutmix: torch.Tensor  # bool [B]
    box: torch.Tensor  # int64 [B, 4]: y0, y1, x0, x1
    lam: torch.Tensor  # float32 [B]

    def to(self, device: torch.device) -> MixPlan:
        return MixPlan(*(t.to(device, non_blocking=True) for t in (self.mixup, self.cutmix, self.box, self.lam)))


class Mixing:
    """MixUp and CutMix between each training sample and its keyed partner (``train.mixup_alpha``,
    ``cutmix_alpha``, ``mix_prob``, ``mix_switch_prob``)."""

    def __init__(self, tc: TrainConfig, n: int, seed: int) -> None:
        self.mixup_alpha, self.cutmix_alpha = tc.mixup_alpha, tc.cutmix_alpha
        self.prob, self.switch, self.n, self.seed = tc.mix_prob, tc.mix_switch_prob, n, seed

    @classmethod
    def from_config(cls, tc: TrainConfig, n: int, seed: int) -> Mixing | None:
        """The mixing of a training split of ``n`` samples; None when both alphas are 0 or ``mix_prob`` is."""
        return cls(tc, n, seed) if (tc.mixup_alpha > 0 or tc.cutmix_alpha > 0) and tc.mix_prob > 0 else None

    def partners(self, keys: torch.Tensor, epoch: int) -> torch.Tensor:
        """Each sample's partner: an index of the training split that (seed, epoch, sample key) choose."""
        return torch.tensor([key_seed(self.seed, epoch, int(k), _MIX) % self.n for k in keys.tolist()],
                            dtype=torch.int64)

    def plan(self, keys: torch.Tensor, epoch: int, height: int, width: int) -> MixPlan:
        """Each sample's draws, from a generator that (seed, epoch, sample key) alone seed."""
        rows = [self._draw(keyed_rng(self.seed, epoch, int(k), _MIX), height, width)
                for k in keys.tolist()]
        mixup, cutmix, box, lam = zip(*rows) if rows else ((), (), (), ())
        return MixPlan(torch.tensor(mixup, dtype=torch.bool), torch.tensor(cutmix, dtype=torch.bool),
                       torch.tensor(box, dtype=torch.int64).view(-1, 4), torch.tensor(lam, dtype=torch.float32))

    def _draw(self, rng: np.random.Generator, height: int, width: int
              ) -> tuple[bool, bool, tuple[int, int, int, int], float]:
        none = (0, 0, 0, 0)
        if rng.random() >= self.prob:
            return False, False, none, 1.0
        use_cutmix = self.cutmix_alpha > 0 and (self.mixup_alpha <= 0 or rng.random() < self.switch)
        if not use_cutmix:
            return True, False, none, float(rng.beta(self.mixup_alpha, self.mixup_alpha))
        lam = rng.beta(self.cutmix_alpha, self.cutmix_alpha)
        cy, cx = int(rng.integers(0, height)), int(rng.integers(0, width))
        half = 0.5 * math.sqrt(1.0 - lam)
        dy, dx = int(half * height), int(half * width)
        y0, y1, x0, x1 = max(cy - dy, 0), min(cy + dy, height), max(cx - dx, 0), min(cx + dx, width)
        return False, True, (y0, y1, x0, x1), 1.0 - (y1 - y0) * (x1 - x0) / (height * width)

    @staticmethod
    def images(x: torch.Tensor, partner: torch.Tensor, plan: MixPlan) -> torch.Tensor:
        """The normalised batch ``x`` mixed with its partners' as ``plan`` says (element-wise per sample)."""
        b, _, h, w = x.shape
        ys = torch.arange(h, device=x.device).view(1, h, 1)
        xs = torch.arange(w, device=x.device).view(1, 1, w)
        box = plan.box.view(b, 4, 1, 1)
        inside = (ys >= box[:, 0]) & (ys < box[:, 1]) & (xs >= box[:, 2]) & (xs < box[:, 3])
        x = torch.where((inside & plan.cutmix.view(b, 1, 1)).unsqueeze(1), partner, x)
        lam = plan.lam.view(b, 1, 1, 1).to(x.dtype)
        return torch.where(plan.mixup.view(b, 1, 1, 1), x * lam + partner * (1 - lam), x)

    @staticmethod
    def targets(labels: torch.Tensor, partner_labels: torch.Tensor, plan: MixPlan, num_classes: int
                ) -> torch.Tensor:
        """Soft targets ``[B, classes]``: ``lam`` of the sample's class and the rest of its partner's."""
        lam = plan.lam.view(-1, 1)
        own = torch.nn.functional.one_hot(labels, num_classes).to(lam.dtype)
        other = torch.nn.functional.one_hot(partner_labels, num_classes).to(lam.dtype)
        return own * lam + other * (1 - lam)
