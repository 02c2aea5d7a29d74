"""Augmentation keyed by (seed, epoch, sample key): v2's policies and erasing, MixUp/CutMix partners and draws,
none of them depending on the batch a sample sits in or on the global generator's position."""

from __future__ import annotations

import pytest
import torch

from ddpipe.config.schema import TrainConfig
from ddpipe.data.augment import ImagePolicy, Mixing

IMAGE = torch.randint(0, 256, (3, 40, 48), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("policy", ["trivialaugment", "randaugment"])
def test_a_policy_is_a_function_of_the_key_and_leaves_the_global_generator_alone(policy: str) -> None:
    augment = ImagePolicy.from_config(TrainConfig(auto_augment=policy, random_erasing=0.5), [0.5, 0.4, 0.3], 7)
    assert augment is not None and len(augment.transforms) == 2
    torch.manual_seed(123)
    before = torch.get_rng_state()
    views = {(epoch, key): augment(IMAGE.clone(), epoch, key) for epoch in range(3) for key in range(8)}
    assert torch.equal(torch.get_rng_state(), before)
    assert all(v.dtype == torch.uint8 and v.shape == IMAGE.shape for v in views.values())
    again = augment(IMAGE.clone(), 2, 5)
    torch.rand(100)  # the global generator moved: the view does not
    assert torch.equal(again, views[(2, 5)]) and torch.equal(augment(IMAGE.clone(), 2, 5), again)
    assert len({v.sum().item() for v in views.values()}) > 12  # the keys choose different operations
    assert ImagePolicy.from_config(TrainConfig(), [0.5], 7) is None


def test_mixing_draws_each_samples_partner_and_share_by_its_key_alone() -> None:
    mixing = Mixing.from_config(TrainConfig(mixup_alpha=0.4, cutmix_alpha=1.0, mix_prob=0.8), n=500, seed=1)
    assert mixing is not None and Mixing.from_config(TrainConfig(), 500, 1) is None
    keys = torch.arange(40, 104)
    partners, plan = mixing.partners(keys, 3), mixing.plan(keys, 3, 16, 20)
    alone_partners, alone = mixing.partners(keys[10:11], 3), mixing.plan(keys[10:11], 3, 16, 20)
    assert partners[10] == alone_partners[0] and torch.equal(plan.box[10], alone.box[0])
    assert plan.lam[10] == alone.lam[0] and partners.max() < 500
    assert 0 < int(plan.mixup.sum()) < 64 and 0 < int(plan.cutmix.sum()) < 64 and not (plan.mixup & plan.cutmix).any()
    unmixed = ~(plan.mixup | plan.cutmix)
    assert bool((plan.lam[unmixed] == 1).all())
    # CutMix's share is what the box leaves of the sample's own image
    x, other = torch.zeros(64, 1, 16, 20), torch.ones(64, 1, 16, 20)
    mixed = mixing.images(x, other, plan)
    own = 1 - mixed.mean(dim=(1, 2, 3))
    assert torch.allclose(own[plan.cutmix], plan.lam[plan.cutmix], atol=1e-5)
    assert torch.allclose(own[plan.mixup], plan.lam[plan.mixup], atol=1e-5)
    # per sample: the same bits in a batch of 64 and alone
    a, b = torch.randn(64, 3, 16, 20), torch.randn(64, 3, 16, 20)
    assert torch.equal(mixing.images(a, b, plan)[10], mixing.images(a[10:11], b[10:11], alone)[0])
    targets = mixing.targets(torch.zeros(64, dtype=torch.long), torch.ones(64, dtype=torch.long), plan, 4)
    assert torch.allclose(targets.sum(1), torch.ones(64)) and torch.equal(targets[:, 0], plan.lam)
