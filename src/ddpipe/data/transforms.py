"""What the network sees of an image, keyed so that no rank, worker or resume changes it.

Raw images (small, one size) are augmented a batch at a time on the training device
(:class:`BatchTransform`: seeded pad-and-crop and flip, then normalisation). Encoded images are decoded
and cropped one at a time in the loader's workers, by the ImageNet recipe of torchvision's reference
scripts: for training a random-resized crop (``train.min_crop_scale`` to all of the area, aspect 3/4 to
4/3) to ``data.image_size`` plus a flip (:class:`TrainCrop`); for validation, the test split and the
served model the centre square of ``data.eval_crop_ratio`` of the shorter side (as resolved: the recipe's preset,
the whole shorter side for encoded images; ImageNet's :data:`IMAGENET_CROP_RATIO` on request), resized to
``data.eval_image_size`` (as resolved; FixRes: larger than ``data.image_size``) (:class:`EvalCrop`: as Resize +
CenterCrop, in one resampling). Images stay uint8 until
:class:`BatchTransform` normalises them on the device.

Every random choice is a function of (seed, epoch, sample index), never of a generator's position: the
same sample gets the same crop on any rank, in any worker, at any world size, after any resume.
"""

from __future__ import annotations

import contextlib
import copy
import math
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ddpipe.data.augment import ImagePolicy, keyed_rng

ASPECT_RANGE = (3 / 4, 4 / 3)  # the random-resized crop's aspect ratios (log-uniform)
# ImageNet's evaluation crop, Resize(256) + CenterCrop(224): the crop's side over the shorter side. The crop of raw
# images' preset (they are evaluated whole: no crop is taken) and of files written before the crop was recorded.
IMAGENET_CROP_RATIO = 0.875


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 31-bit integer hash (no int64 overflow, so CPU and CUDA agree bit for bit)."""
    for _ in range(3):
        x = ((x ^ (x >> 13)) * 1103515245 + 12345) & 0x7FFFFFFF
    return x


class BatchTransform:
    """uint8 batch -> normalised float batch on the device; for raw images also seeded per-sample crops and
    flips (encoded images arrive augmented from the workers: ``crop_padding=0, hflip=False``)."""

    def __init__(self, mean: list[float], std: list[float], crop_padding: int, hflip: bool,
                 seed: int, device: torch.device, channels_last: bool) -> None:
        mean_t = torch.tensor(mean, dtype=torch.float32, device=device).view(1, -1, 1, 1)
        std_t = torch.tensor(std, dtype=torch.float32, device=device).view(1, -1, 1, 1)
        self.scale, self.shift = 1.0 / (255.0 * std_t), -mean_t / std_t
        self.crop_padding, self.hflip, self.seed = crop_padding, hflip, seed
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format

    def __call__(self, images: torch.Tensor, indices: torch.Tensor, epoch: int | None) -> torch.Tensor:
        """``epoch=None``: evaluation (no augmentation)."""
        if epoch is not None and (self.crop_padding or self.hflip):
            images = self._augment(images, indices.to(images.device), epoch)
        x = images.float().mul_(self.scale).add_(self.shift)
        return x.contiguous(memory_format=self.memory_format)

    def in_layout(self, channels_last: bool) -> BatchTransform:
        """This transform with its output in channels_last or the contiguous format (``auto`` times both layouts
        on one loader: ``ddpipe.engine.timing``)."""
        other = copy.copy(self)
        other.memory_format = torch.channels_last if channels_last else torch.contiguous_format
        return other

    def _augment(self, images: torch.Tensor, indices: torch.Tensor, epoch: int) -> torch.Tensor:
        key = _mix(_mix(torch.full_like(indices, self.seed & 0x7FFFFFFF)) ^ epoch)
        key = _mix(key ^ (indices & 0x7FFFFFFF))  # keys of repeated draws may exceed 31 bits
        b, _, h, w = images.shape
        if self.crop_padding:
            p = self.crop_padding
            padded = torch.nn.functional.pad(images, (p, p, p, p))
            dy, dx = _mix(key ^ 1) % (2 * p + 1), _mix(key ^ 2) % (2 * p + 1)
            rows = (dy[:, None] + torch.arange(h, device=images.device))[:, :, None]
            cols = (dx[:, None] + torch.arange(w, device=images.device))[:, None, :]
            batch = torch.arange(b, device=images.device)[:, None, None]
            images = padded[batch, :, rows, cols].permute(0, 3, 1, 2)  # [B, H, W, C] -> [B, C, H, W]
        if self.hflip:
            flip = (_mix(key ^ 3) & 1).bool().view(-1, 1, 1, 1)
            images = torch.where(flip, images.flip(-1), images)
        return images


# ---------------------------------------------------------------------------------------------
# Encoded images, one at a time


def decode(blob: np.ndarray | torch.Tensor, channels: int) -> torch.Tensor:
    """A stored JPEG/PNG file (uint8 bytes: a memory-mapped array, or a tensor of its own) as a uint8
    ``C x H x W`` tensor with ``channels`` channels (libjpeg-turbo/libpng through torchvision: 1.4x PIL's JPEG
    decode rate here)."""
    if not isinstance(blob, torch.Tensor):
        blob = torch.from_numpy(np.array(blob, dtype=np.uint8, copy=True))  # out of the read-only memory map
    with _decoders(channels) as (io, mode):
        return io.decode_image(blob, mode=mode)


# Images decode_jpegs_on decoded in this process: on CUDA, nvJPEG's. EncodedBatch.to falls back to the CPU with a
# warning where nvJPEG fails, so a GPU run can only tell that nvJPEG decoded by counting (tests/test_gpu.py does).
_decoded_on_device = 0


def decode_jpegs_on(device: torch.device, blobs: list[torch.Tensor], channels: int) -> list[torch.Tensor]:
    """JPEG files decoded on a CUDA ``device`` in one batched call (nvJPEG through torchvision's
    ``decode_jpeg``), each a uint8 ``C x H x W`` tensor there; counted (:func:`decoded_on_device`)."""
    global _decoded_on_device
    with _decoders(channels) as (io, mode):
        images = io.decode_jpeg(blobs, mode=mode, device=device)
    _decoded_on_device += len(images)
    return images


def decoded_on_device() -> int:
    """How many images :func:`decode_jpegs_on` has decoded in this process (failed batches not counted)."""
    return _decoded_on_device


@contextlib.contextmanager
def _decoders(channels: int) -> Iterator[tuple[Any, Any]]:
    """torchvision's image module and the read mode that gives ``channels`` channels, imported here (the launcher
    and stages need no torchvision)."""
    from torchvision import io
    from torchvision.io import ImageReadMode

    with warnings.catch_warnings():
        # torchvision 0.29 deprecates its decoders for TorchCodec's (torch >= 2.11 only); ddpipe supports
        # torchvision 0.19-0.29, where these are the same functions
        warnings.filterwarnings("ignore", "The image decoding and encoding capabilities", DeprecationWarning)
        yield io, ImageReadMode.GRAY if channels == 1 else ImageReadMode.RGB


def crop_resize(image: torch.Tensor, box: tuple[int, int, int, int], size: int) -> torch.Tensor:
    """The ``(top, left, height, width)`` box of a uint8 ``C x H x W`` image, resized (bilinear, antialiased)
    to ``size x size``, uint8, on the image's device."""
    top, left, height, width = box
    crop = image[None, :, top:top + height, left:left + width]
    if image.device.type != "cpu":  # CUDA's antialiased kernel takes floating point only
        out = F.interpolate(crop.float(), size=(size, size), mode="bilinear", antialias=True, align_corners=False)
        return out[0].round_().clamp_(0, 255).to(torch.uint8)
    # uint8 in channels-last order takes torch's vectorised antialiased kernel: 0.09 ms for a 224 crop of a
    # 160-500 px image against 0.16 ms through torchvision's resized_crop (AMD EPYC, one thread)
    crop = crop.contiguous(memory_format=torch.channels_last)
    return F.interpolate(crop, size=(size, size), mode="bilinear", antialias=True, align_corners=False)[0]


def centre_box(height: int, width: int, ratio: float = IMAGENET_CROP_RATIO) -> tuple[int, int, int, int]:
    """The centre square of ``ratio`` of the shorter side."""
    side = max(1, round(min(height, width) * ratio))
    return (height - side) // 2, (width - side) // 2, side, side


def random_resized_box(height: int, width: int, rng: np.random.Generator, min_scale: float
                       ) -> tuple[int, int, int, int]:
    """torchvision's RandomResizedCrop box (area share in [min_scale, 1], log-uniform aspect in
    ``ASPECT_RANGE``, 10 tries, then the centre crop of the clamped aspect), drawn from ``rng``."""
    area = height * width
    log_lo, log_hi = math.log(ASPECT_RANGE[0]), math.log(ASPECT_RANGE[1])
    for _ in range(10):
        target = area * rng.uniform(min_scale, 1.0)
        aspect = math.exp(rng.uniform(log_lo, log_hi))
        w = round(math.sqrt(target * aspect))
        h = round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            return int(rng.integers(0, height - h + 1)), int(rng.integers(0, width - w + 1)), h, w
    ratio = width / height
    if ratio < ASPECT_RANGE[0]:
        w, h = width, round(width / ASPECT_RANGE[0])
    elif ratio > ASPECT_RANGE[1]:
        h, w = height, round(height * ASPECT_RANGE[1])
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


class TrainCrop:
    """Training view of one decoded image: a keyed random-resized crop to ``size``, flipped half the time."""

    def __init__(self, size: int, min_scale: float, hflip: bool, seed: int) -> None:
        self.size, self.min_scale, self.hflip, self.seed = size, min_scale, hflip, seed

    def plan(self, height: int, width: int, index: int, epoch: int) -> tuple[tuple[int, int, int, int], bool]:
        """The crop's box in a ``height x width`` image, and whether it is flipped."""
        rng = keyed_rng(self.seed, epoch, index)
        box = random_resized_box(height, width, rng, self.min_scale)
        return box, self.hflip and rng.random() < 0.5

    def __call__(self, image: torch.Tensor, index: int, epoch: int) -> torch.Tensor:
        box, flip = self.plan(image.shape[1], image.shape[2], index, epoch)
        crop = crop_resize(image, box, self.size)
        return crop.flip(-1) if flip else crop


class EvalCrop:
    """Evaluation view of one image of any size: the centre square of ``ratio`` of its shorter side, resized to
    ``size`` (validation, the evaluate stage and the served model all use this)."""

    def __init__(self, size: int, ratio: float = IMAGENET_CROP_RATIO) -> None:
        self.size, self.ratio = size, ratio

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        return crop_resize(image, centre_box(image.shape[1], image.shape[2], self.ratio), self.size)


JPEG_START = b"\xff\xd8\xff"


@dataclass
class EncodedBatch:
    """A batch of stored files read but not decoded (``data.decode_on: device``): the files end to end in ``data``
    (file ``k`` ends at ``ends[k]``), each one's crop box (top, left, height, width) in its decoded image and
    flip, the side it is resized to and, for training views, the per-image policy with the epoch and sample keys
    that key it. ``to(device)`` decodes, crops and augments on that device: the uint8 ``[B, C, size, size]``
    batch the workers would have made (on the CPU, the same bytes: the same decoder, crop and policy)."""

    data: torch.Tensor  # uint8 [total bytes]
    ends: torch.Tensor  # int64 [B]
    boxes: torch.Tensor  # int64 [B, 4]
    flips: torch.Tensor  # bool [B]
    size: int
    channels: int
    policy: ImagePolicy | None = None
    epoch: int | None = None
    keys: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.ends)

    def pin_memory(self) -> EncodedBatch:
        """What DataLoader(pin_memory=True) calls: the bytes in page-locked memory, for nvJPEG's copy."""
        return replace(self, data=self.data.pin_memory())

    def files(self) -> list[torch.Tensor]:
        starts = [0, *self.ends[:-1].tolist()]
        return [self.data[a:b] for a, b in zip(starts, self.ends.tolist())]

    def to(self, device: torch.device | str, non_blocking: bool = False) -> torch.Tensor:
        device = torch.device(device)
        files = self.files()
        images: list[torch.Tensor | None] = [None] * len(files)
        if device.type == "cuda":
            jpegs = [k for k, f in enumerate(files) if bytes(f[:3].tolist()) == JPEG_START]
            try:
                decoded = decode_jpegs_on(device, [files[k] for k in jpegs], self.channels) if jpegs else []
            except RuntimeError as exc:  # a file nvJPEG does not take: this batch is decoded on the CPU
                warnings.warn(f"nvJPEG could not decode a batch ({exc}); decoding it on the CPU", stacklevel=2)
                decoded = []
            for k, image in zip(jpegs, decoded):
                images[k] = image
        out = torch.empty((len(files), self.channels, self.size, self.size), dtype=torch.uint8, device=device)
        for k, (file, box, flip) in enumerate(zip(files, self.boxes.tolist(), self.flips.tolist())):
            image = images[k]
            if image is None:
                image = decode(file, self.channels).to(device, non_blocking=non_blocking)
            view = crop_resize(image, tuple(box), self.size)  # type: ignore[arg-type]
            view = view.flip(-1) if flip else view
            if self.policy is not None and self.epoch is not None and self.keys is not None:
                view = self.policy(view, self.epoch, int(self.keys[k]))
            out[k] = view
        return out
