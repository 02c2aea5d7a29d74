"""ddpipe's own networks: small residual CNNs for 28x28/32x32 images, and torchvision's ResNets with a
small-image stem. No distributed code here: the trainer converts BatchNorm and wraps in DDP."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn


def _conv_bn(c_in: int, c_out: int, stride: int = 1) -> list[nn.Module]:
    return [nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU(inplace=True)]


class GlobalMaxPool(nn.Module):
    """``nn.AdaptiveMaxPool2d(1)``'s forward as a reduction."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.amax(dim=(-2, -1), keepdim=True)


class GlobalAvgPool(nn.Module):
    """``nn.AdaptiveAvgPool2d(1)``'s forward as a reduction."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(dim=(-2, -1), keepdim=True)


def global_pools_as_reductions(network: nn.Module, average: bool = True) -> nn.Module:
    """``network`` with its global adaptive max pools (and, if ``average``, its average pools) replaced in place by
    reductions that compute the same forward: exporters translate them, and their backward on CUDA is deterministic
    (adaptive pooling's backward adds with atomics). No weights change."""
    kinds = (nn.AdaptiveMaxPool2d, nn.AdaptiveAvgPool2d) if average else (nn.AdaptiveMaxPool2d,)
    for name, module in list(network.named_modules()):
        if not name or not isinstance(module, kinds) or module.output_size not in (1, (1, 1)) or \
                getattr(module, "return_indices", False):
            continue
        parent, _, child = name.rpartition(".")
        reduction = GlobalMaxPool() if isinstance(module, nn.AdaptiveMaxPool2d) else GlobalAvgPool()
        setattr(network.get_submodule(parent), child, reduction)
    return network


class Residual(nn.Module):
    """x + f(x), with f two 3x3 conv-BN-ReLU layers (the post-activation of the last is kept:
    this is the ResNet-9 block that trains fast on small images)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.body = nn.Sequential(*_conv_bn(channels, channels), *_conv_bn(channels, channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.body(x)


class ResNetSmall(nn.Module):
    """The default: a compact residual CNN (the ResNet-9 layout, scaled down) for 28x28/32x32 images.

    conv (w) -> pool -> conv (2w) -> residual(2w) -> conv (4w) -> pool -> residual(4w)
    -> global max pool -> linear. Only the 1-channel stem runs at full resolution; the rest runs at
    1/2 and 1/4, which on a 2-core CPU measured 1.5x the images/s of the same widths pooled after
    the second conv, for ~0.3 points of Fashion-MNIST accuracy at equal epochs (BENCHMARKS.md).
    """

    def __init__(self, in_channels: int, num_classes: int, width: int = 16) -> None:
        super().__init__()
        w = width
        self.features = nn.Sequential(
            *_conv_bn(in_channels, w), nn.MaxPool2d(2),
            *_conv_bn(w, 2 * w),
            Residual(2 * w),
            *_conv_bn(2 * w, 4 * w), nn.MaxPool2d(2),
            Residual(4 * w),
            nn.AdaptiveMaxPool2d(1), nn.Flatten(),
        )
        self.classifier = nn.Linear(4 * w, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


class ResNetCompact(nn.Module):
    """ResNetSmall with its 14x14 residual block dropped and its third conv moved after the second pool:
    conv (w) -> pool -> conv (2w) -> pool -> conv (4w) -> residual(4w) -> global max pool -> linear.
    Under half of ResNetSmall's multiply-adds (5.5M against 11.9M per 28x28 image at width 16)."""

    def __init__(self, in_channels: int, num_classes: int, width: int = 16) -> None:
        super().__init__()
        w = width
        self.features = nn.Sequential(
            *_conv_bn(in_channels, w), nn.MaxPool2d(2),
            *_conv_bn(w, 2 * w), nn.MaxPool2d(2),
            *_conv_bn(2 * w, 4 * w),
            Residual(4 * w),
            nn.AdaptiveMaxPool2d(1), nn.Flatten(),
        )
        self.classifier = nn.Linear(4 * w, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


class SeedCNN(nn.Module):
    """A plain 5-conv BatchNorm CNN, as in the PyTorch DDP tutorials (the benchmarks' reference model)."""

    def __init__(self, in_channels: int, num_classes: int, width: int = 32) -> None:
        super().__init__()
        w = width
        self.features = nn.Sequential(
            *_conv_bn(in_channels, w), *_conv_bn(w, w), nn.MaxPool2d(2),
            *_conv_bn(w, 2 * w), *_conv_bn(2 * w, 2 * w), nn.MaxPool2d(2),
            *_conv_bn(2 * w, 4 * w), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        )
        self.classifier = nn.Linear(4 * w, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


def cifar_resnet(depth: int, in_channels: int, num_classes: int, **kwargs: Any) -> nn.Module:
    """torchvision's ResNet-``depth`` with its ImageNet stem (7x7 stride-2 conv + max pool, which would shrink
    a 28x28 image to 7x7 before the first block) replaced by a 3x3 stride-1 conv for small images: what
    ``resnet18`` meant before torchvision's names were accepted (now ``resnet18_cifar``)."""
    import torchvision

    model = getattr(torchvision.models, f"resnet{depth}")(weights=None, num_classes=num_classes, **kwargs)
    model.conv1 = nn.Conv2d(in_channels, model.conv1.out_channels, 3, 1, 1, bias=False)
    model.maxpool = nn.Identity()
    return model


# ddpipe's own networks: model.name -> constructor(in_channels, num_classes, width, **model.kwargs)
OWN: dict[str, Callable[..., nn.Module]] = {
    "resnet_small": ResNetSmall,
    "resnet_compact": ResNetCompact,
    "seed_cnn": SeedCNN,
    "resnet18_cifar": lambda c, n, width, **kw: cifar_resnet(18, c, n, **kw),
    "resnet34_cifar": lambda c, n, width, **kw: cifar_resnet(34, c, n, **kw),
    "resnet50_cifar": lambda c, n, width, **kw: cifar_resnet(50, c, n, **kw),
}


def predict_logits(model: nn.Module, x: torch.Tensor, flips: bool) -> torch.Tensor:
    """fp32 logits of ``model`` for ``x``; with ``flips`` (``model.eval_flips``), averaged with the logits
    of ``x`` mirrored left-right. Validation, the evaluate stage and the served model all predict here."""
    logits = model(x).float()
    return (logits + model(x.flip(-1)).float()) / 2 if flips else logits
