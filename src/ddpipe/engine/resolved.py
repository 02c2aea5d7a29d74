"""A training's whole run, typed, with every ``auto`` made concrete for its device and prepared data: what the
launcher checks and every worker trains with, and the evaluate stage's batch and loader workers.

``Config`` holds what the user wrote, ``auto`` words included (``train.batch_size_per_rank: auto``); a
:class:`Resolved` holds what the training runs with: the network's name, the batches, the input size, precision
and memory format, the backend, the fine-tuning's frozen epochs, the recipe's views. :func:`resolve` makes it; the
tables it reads are measured (BENCHMARKS.md, "Which network `auto` picks" and "The recipe").
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from typing import Any

import torch

from ddpipe.config.keys import flatten, trajectory
from ddpipe.config.schema import (
    Config,
    ConfigError,
    DistributedConfig,
    ModelConfig,
    TrainConfig,
)
from ddpipe.core.devices import PrecisionPolicy, cpu_count, cpu_has_amx, cpu_int8_kind, cpu_supports_bf16
from ddpipe.data.encoding import SMALL_IMAGE_SIDE
from ddpipe.data.loaders import TrainingData, Views
from ddpipe.data.store import Prepared, load_meta
from ddpipe.data.transforms import IMAGENET_CROP_RATIO
from ddpipe.engine.autotune import Ask, Choice, choose
from ddpipe.engine.timing import LoaderFeed
from ddpipe.models.catalog import RENAMED

# What ``model.name: auto`` and ``train.batch_size_per_rank: auto`` become, by device (BENCHMARKS.md,
# "Which network `auto` picks"). resnet_compact at batch 128 reached 0.923 test accuracy in 10 epochs
# at 2.2x resnet_small's images/s in fp32 on an AVX2/AVX512 CPU; resnet_small at batch 256 is the
# combination measured on an AMX Xeon (bf16, 0.44x the reference loop's time) and the one the GPU
# tests ran, kept unchanged there until the compact one is measured on those devices.
AUTO_CHOICES = {  # device_kind -> (model.name, train.batch_size_per_rank)
    "cpu": ("resnet_compact", 128),  # a CPU without AMX
    "cpu-amx": ("resnet_small", 256),
    "cuda": ("resnet_small", 256),
}
# Inputs above SMALL_IMAGE_SIDE px a side (encoded images, 224 by default) get torchvision's ImageNet networks, whose
# stem downsamples 4x at once: ddpipe's small-image nets keep full resolution through their first layers.
# ResNet-50 at batch 128 is torchvision's reference recipe per GPU (8 GPUs x 32 there; bf16 fits 128 in 40 GB);
# on a CPU, ResNet-18 (a fifth of ResNet-50's multiply-adds) at batch 64.
AUTO_LARGE_INPUT = {"cpu": ("resnet18", 64), "cpu-amx": ("resnet18", 64), "cuda": ("resnet50", 128)}
# data.image_size null for encoded images: torchvision's classification default
DEFAULT_ENCODED_SIZE = 224
# What data.decode_on: auto means, on every device: the loader's workers. Decoding on the GPU (nvJPEG) has never been
# timed against them (issue 71); it becomes auto's on CUDA once `make gpu-check` shows it at least as fast at 224 px.
AUTO_DECODE_ON = "workers"


@dataclass(frozen=True)
class Preset:
    """What the recipe's ``auto`` keys become for one kind of input."""

    min_crop_scale: float  # train.min_crop_scale: the random-resized crop's smallest area share
    eval_crop_ratio: float  # data.eval_crop_ratio: the evaluation crop's share of the shorter side
    eval_size_ratio: float  # data.eval_image_size over data.image_size (FixRes when above 1)


# The recipe's presets, by the prepared data's encoding (BENCHMARKS.md, "The recipe" and "Each step alone, and
# the crops that became the defaults": a 2-core AMD EPYC with AVX512-BF16, 3 seeds each, the same wall time).
# Encoded images (photos, any size): on the generated photo-like folder at 64 px (objects anywhere in the frame,
# 30 epochs) the whole shorter side evaluated (crop ratio 1.0), training crops of at least 35% of the area and
# evaluation at 72 px took test accuracy from 0.9422 ± 0.0059 (ImageNet's 0.08 / 0.875 / 64) to 0.9611 ± 0.0118;
# the crop ratio alone 0.9511, the crop scale alone 0.9478, 72 px alone 0.9406. Raw images (one small size,
# Fashion-MNIST) are padded and cropped in training and evaluated whole: no crop to choose, the values stay
# ImageNet's. Neither input has a device axis: crops and resolution change no arithmetic, and only this CPU has
# measured them. The recipe's other steps stay off by default because none measured better within the same wall
# time, on either input: EMA of the weights (train.ema_decay), MixUp/CutMix, TrivialAugmentWide, RandomErasing,
# no weight decay on norms and biases (Fashion-MNIST, 10 epochs' time: the defaults 0.9216 ± 0.0022, EMA 0.999
# 0.9199 ± 0.0010, MixUp 0.2 / CutMix 1.0 0.9127 ± 0.0016).
RECIPE_PRESETS = {
    "raw": Preset(min_crop_scale=0.08, eval_crop_ratio=IMAGENET_CROP_RATIO, eval_size_ratio=1.0),
    "encoded": Preset(min_crop_scale=0.35, eval_crop_ratio=1.0, eval_size_ratio=1.125),
}


@dataclass(frozen=True)
class Resolved:
    """The run a training makes: what the user wrote (``cfg``) and what each ``auto`` of it became here."""

    cfg: Config  # what the user wrote, untouched
    device: torch.device  # the kind of device the ranks train on (each takes its own GPU: ddpipe.distributed)
    meta: Prepared  # the prepared data's meta.json
    model_name: str  # model.name, concrete
    model_was_auto: bool
    device_kind: str  # the row of AUTO_CHOICES that `auto` took
    input_size: list[int]  # what the network sees: data.image_size resolved, [H, W]
    eval_size: list[int]  # what it sees in validation, test and serving: data.eval_image_size resolved
    eval_crop_ratio: float  # data.eval_crop_ratio resolved
    min_crop_scale: float  # train.min_crop_scale resolved
    batch_size_per_rank: int
    eval_batch_size_per_rank: int
    precision: str  # fp32 | bf16 | fp16
    channels_last: bool
    backend: str  # nccl | gloo
    freeze_body_epochs: int | None  # None: the body stays frozen for good
    auto: Choice | None = None  # what `auto` measured on this machine kind (train.auto_by: measured), or None

    @property
    def model(self) -> ModelConfig:
        """The ``model`` section with its name concrete: what builds the network and what the saved model records."""
        return replace(self.cfg.model, name=self.model_name)

    @property
    def deterministic(self) -> bool:
        """Fixed kernels on CUDA (``train.deterministic``; exact mode implies it)."""
        return self.cfg.train.deterministic or self.cfg.distributed.exact

    def deterministic_kernels(self, device: torch.device) -> bool:
        """Whether the training on ``device`` runs CUDA's deterministic kernels (the CPU's always are)."""
        return self.deterministic and device.type == "cuda"

    def compute_on(self, device: torch.device) -> PrecisionPolicy:
        """How this run computes on ``device`` (a rank's own GPU, or the CPU)."""
        return PrecisionPolicy(device, self.precision, self.channels_last)

    @property
    def views(self) -> Views:
        """The sizes and crops the network sees, resolved."""
        return Views(self.input_size, self.eval_size, self.eval_crop_ratio, self.min_crop_scale)

    def training_data(self, meta: Prepared, compute: PrecisionPolicy, *, rank: int, world_size: int,
                      num_workers: int) -> TrainingData:
        """What rank ``rank`` of ``world_size`` reads (``meta``: the prepared data's, its normalisation perhaps the
        pretrained weights'), onto ``compute``'s device."""
        return TrainingData.load(self.cfg, self.views, self.batch_size_per_rank, meta, compute, rank=rank,
                                 world_size=world_size, num_workers=num_workers, decode_on_device=self.decode_on_device)

    def loader_workers(self, cores: int) -> int:
        """``data.num_workers`` for a rank that may use ``cores`` cores (:func:`loader_workers`)."""
        tc = self.cfg.train
        per_image = tc.auto_augment != "none" or tc.random_erasing > 0
        return loader_workers(self.cfg.data.num_workers, self.meta.encoding, self.device, cores, per_image,
                              self.decode_on_device)

    @property
    def threads_per_process(self) -> int | None:
        """``distributed.threads_per_process``, or the fewer threads ``auto`` measured faster (a thread per physical
        core where the cores are hyperthreads); None: a thread on each core of the process's share."""
        fixed = self.cfg.distributed.threads_per_process
        return fixed if fixed is not None else ((self.auto.threads or None) if self.auto else None)

    @property
    def decode_on_device(self) -> bool:
        """Whether encoded images are decoded on the training device (``data.decode_on``; auto:
        :data:`AUTO_DECODE_ON`)."""
        setting = self.cfg.data.decode_on
        return (AUTO_DECODE_ON if setting == "auto" else setting) == "device" and self.meta.encoding != "raw"

    def global_batch_size(self, world_size: int) -> int:
        return self.batch_size_per_rank * world_size * self.cfg.train.grad_accum_steps

    def steps_per_epoch(self, world_size: int) -> int:
        """Optimizer steps in an epoch (each rank's shard, its full batches, then ``grad_accum_steps`` of them a
        step, as ``ddpipe.data.loaders.TrainOrder`` serves them)."""
        return self.meta.sizes["train"] // world_size // self.batch_size_per_rank // self.cfg.train.grad_accum_steps

    def check_world_size(self, world_size: int) -> None:
        """ConfigError unless an epoch has an optimizer step at ``world_size`` processes."""
        if self.steps_per_epoch(world_size) < 1:
            raise ConfigError(
                f"train.grad_accum_steps = {self.cfg.train.grad_accum_steps} x train.batch_size_per_rank = "
                f"{self.batch_size_per_rank} x {world_size} process(es) exceeds the training split "
                f"({self.meta.sizes['train']} samples); accepted: a global batch no larger than the split")

    def params(self) -> dict[str, Any]:
        """Every config key flattened, with the values ``auto`` took: what the run records as its params."""
        measured = {"auto_key": self.auto.key, "auto_source": self.auto.source,  # why it chose what it chose
                    "auto_basis": self.auto.basis[:6000], "auto_spread": round(self.auto.spread, 3),
                    "auto_table": self.auto.summary()[:6000]} if self.auto else {}
        return {**flatten(self.cfg), "model.name": self.model_name,
                "data.decode_on": "device" if self.decode_on_device else "workers",
                "train.batch_size_per_rank": self.batch_size_per_rank,
                "train.eval_batch_size_per_rank": self.eval_batch_size_per_rank, **self._recipe(), **measured}

    def _recipe(self, fingerprint: bool = False) -> dict[str, Any]:
        """The recipe's keys as this run resolved them (:data:`RECIPE_PRESETS`). For the fingerprint, an evaluation
        at the training size is null, as a config written before ``auto`` said it (such runs still resume)."""
        same = self.meta.encoding == "raw" or (fingerprint and self.eval_size == self.input_size)
        return {"data.eval_image_size": None if same else self.eval_size[0],
                "data.eval_crop_ratio": self.eval_crop_ratio, "train.min_crop_scale": self.min_crop_scale}

    def trajectory(self) -> dict[str, Any]:
        """The keys that shape the training trajectory (``ddpipe.config.keys.trajectory``) with the network
        resolved: what a checkpoint's fingerprint covers (``ddpipe.engine.checkpoint.run_fingerprint``)."""
        keys = {**trajectory(self.cfg), "model.name": self.model_name, **self._recipe(fingerprint=True)}
        if self.auto is not None:  # a measured choice may differ once re-measured: the values it took, not `auto`
            keys.update({"train.batch_size_per_rank": self.batch_size_per_rank, "train.precision": self.precision})
        if self.model_name in RENAMED:  # torchvision's network now, not the small-stem one of older checkpoints
            keys["model.torchvision_stem"] = True
        return keys


def resolve(cfg: Config, device: torch.device, meta: Prepared | None = None, choice: Choice | None = None) -> Resolved:
    """``cfg`` for ``device`` and the data ``meta`` describes (by default ``paths.prepared``'s meta.json:
    PreparedDataError if it cannot be read); ConfigError for a value this device cannot run (fp16 or nccl without
    CUDA, exact mode on CUDA) or a ``data.image_size`` the prepared data cannot give. The job's processes and nodes
    are the launcher's to resolve (:func:`resolve_job`): a worker is one of them. ``choice``: what ``auto`` measured
    here (:func:`measured_choice`), taken by every key left ``auto``; else the fixed table."""
    meta = load_meta(cfg.paths.prepared) if meta is None else meta
    size = input_size(meta, cfg.data.image_size)
    preset = RECIPE_PRESETS[meta.encoding]
    crop_ratio = preset.eval_crop_ratio if cfg.data.eval_crop_ratio == "auto" else float(cfg.data.eval_crop_ratio)
    name, batch = (choice.model_name, choice.batch_size_per_rank) if choice else auto_choice(device, size[0])
    tc, d = cfg.train, cfg.distributed
    precision = choice.precision if choice and tc.precision == "auto" else resolve_precision(tc.precision, device)
    batch = batch if tc.batch_size_per_rank == "auto" else int(tc.batch_size_per_rank)
    if d.backend == "nccl" and device.type != "cuda":
        raise ConfigError("distributed.backend = 'nccl' needs CUDA GPUs; accepted here: auto or gloo")
    if d.exact and device.type != "cpu":
        raise ConfigError("distributed.exact = True is not accepted on CUDA (cuDNN picks its algorithms by "
                          "batch size, so results depend on the split); accepted there: false")
    return Resolved(
        cfg=cfg, device=device, meta=meta, model_name=name if cfg.model.name == "auto" else cfg.model.name,
        model_was_auto=cfg.model.name == "auto", device_kind=device_kind(device), input_size=size,
        eval_size=eval_input_size(meta, cfg.data.eval_image_size, crop_ratio, size, preset),
        eval_crop_ratio=crop_ratio,
        min_crop_scale=preset.min_crop_scale if tc.min_crop_scale == "auto" else float(tc.min_crop_scale),
        batch_size_per_rank=batch, eval_batch_size_per_rank=eval_batch_size(tc, device, size[0], batch),
        precision=precision, channels_last=choice.channels_last if choice and tc.channels_last == "auto" else
        use_channels_last(tc.channels_last, device, precision),
        backend=d.backend if d.backend != "auto" else ("nccl" if device.type == "cuda" else "gloo"),
        freeze_body_epochs=None if tc.freeze_body_epochs == "all" else int(tc.freeze_body_epochs), auto=choice)


def measured_choice(cfg: Config, device: torch.device, meta: Prepared | None = None) -> Choice | None:
    """What ``auto`` becomes on this machine kind by measuring (:mod:`ddpipe.engine.autotune`: its cache, or a few
    seconds of each candidate now, fed by the training's loader over ``paths.prepared``): on a CPU with
    ``train.auto_by: measured`` when any of the keys it picks is ``auto``; else None (the fixed table)."""
    tc, d = cfg.train, cfg.distributed
    picks = (cfg.model.name, tc.batch_size_per_rank, tc.precision, tc.channels_last)
    if device.type != "cpu" or tc.auto_by != "measured" or "auto" not in picks:
        return None
    table = resolve(cfg, device, meta)  # what `auto_by: table` trains: a candidate must beat it by the margin
    side, workers = table.input_size[0], table.loader_workers(cpu_count())
    precision = None if tc.precision == "auto" else resolve_precision(tc.precision, device)
    return choose(Ask(network=None if cfg.model.name == "auto" else cfg.model.name, model=cfg.model,
                      channels=table.meta.num_channels, classes=len(table.meta.classes), side=side,
                      large=side > SMALL_IMAGE_SIDE, precision=precision,
                      batch_size_per_rank=None if tc.batch_size_per_rank == "auto" else int(tc.batch_size_per_rank),
                      channels_last=None if tc.channels_last == "auto" else tc.channels_last == "on",
                      threads=d.threads_per_process, feed=LoaderFeed.describe(table, workers),
                      table_pick=(table.model_name, table.batch_size_per_rank, table.precision, table.channels_last)),
                  feed=lambda: LoaderFeed.of(table, workers))


def device_kind(device: torch.device) -> str:
    """The key of :data:`AUTO_CHOICES` for this device."""
    if device.type == "cuda":
        return "cuda"
    return "cpu-amx" if cpu_has_amx() else "cpu"


def auto_choice(device: torch.device, side: int) -> tuple[str, int]:
    """(model.name, train.batch_size_per_rank) that ``auto`` means on ``device`` for inputs ``side`` px a side."""
    table = AUTO_CHOICES if side <= SMALL_IMAGE_SIDE else AUTO_LARGE_INPUT
    return table[device_kind(device)]


def input_size(meta: Prepared, image_size: int | None) -> list[int]:
    """[H, W] the network sees: encoded images are cropped to ``data.image_size`` (null: 224); raw images
    keep their stored size, which ``data.image_size`` may only repeat (ConfigError otherwise)."""
    if meta.encoding == "encoded":
        side = image_size or DEFAULT_ENCODED_SIZE
        return [side, side]
    stored = list(meta.image_size or [])
    if image_size is not None and [image_size, image_size] != stored:
        raise ConfigError(f"data.image_size = {image_size} is not accepted for the prepared raw images of "
                          f"{stored[0]}x{stored[1]} px (meta.json encoding 'raw'); accepted: null or {stored[0]} "
                          "when square, or prepare them with data.encoding=encoded")
    return stored


def eval_input_size(meta: Prepared, eval_image_size: str | None, crop_ratio: float, size: list[int],
                    preset: Preset) -> list[int]:
    """[H, W] of the evaluation view: encoded images' centre crop resized to ``data.eval_image_size`` (auto: the
    preset's share of the training size ``size``; null: ``size``); raw images are evaluated as stored, so neither
    key may ask otherwise there."""
    if meta.encoding == "encoded":
        if eval_image_size is None:
            return list(size)
        side = round(size[0] * preset.eval_size_ratio) if eval_image_size == "auto" else int(eval_image_size)
        return [side, side]
    if eval_image_size not in (None, "auto") and [int(eval_image_size)] * 2 != size:
        raise ConfigError(f"data.eval_image_size = {eval_image_size} is not accepted for the prepared raw images of "
                          f"{size[0]}x{size[1]} px (evaluated as stored); accepted: auto or null, or prepare them "
                          "with data.encoding=encoded")
    if crop_ratio != preset.eval_crop_ratio:
        raise ConfigError(f"data.eval_crop_ratio = {crop_ratio} is not accepted for prepared raw images (evaluated "
                          f"whole, uncropped); accepted: auto or {preset.eval_crop_ratio}, or prepare them with "
                          "data.encoding=encoded")
    return size


def eval_batch_size(cfg: TrainConfig, device: torch.device, side: int, train_batch: int | None = None) -> int:
    """``train.eval_batch_size_per_rank`` for ``device``: auto is twice the training batch (``train_batch``, the
    training's resolved; else itself auto, by the table, or not)."""
    if cfg.eval_batch_size_per_rank != "auto":
        return int(cfg.eval_batch_size_per_rank)
    if train_batch is not None:
        return 2 * train_batch
    requested = cfg.batch_size_per_rank
    return 2 * (auto_choice(device, side)[1] if requested == "auto" else int(requested))


def loader_workers(setting: str, encoding: str, device: torch.device, cores: int, per_image: bool = False,
                   decode_on_device: bool = False) -> int:
    """``data.num_workers`` resolved for a rank that may use ``cores`` cores. ``auto``: none for raw data (a
    batch is one gather from the memory map: handing it between processes would cost more) unless each image
    has work of its own (``per_image``: an augmentation policy, random erasing); for encoded data decoded on the
    device one on CUDA (it reads the next batches' files while the GPU computes), none on a CPU (the training
    process decodes); for encoded data decoded in the workers, on CUDA the rank's cores less one (the training
    process feeds the GPU), on CPU half of them (the training's own threads compute on the same cores), at least
    one."""
    if setting != "auto":
        return int(setting)
    if encoding == "raw" and not per_image:
        return 0
    if decode_on_device:  # never for raw data (Resolved.decode_on_device)
        return 1 if device.type == "cuda" else 0
    return max(1, cores - 1) if device.type == "cuda" else max(1, cores // 2)


def int8_target(setting: str) -> str:
    """The CPU kind an INT8 copy is made for (``export.int8_cpu``; auto: the CPU this process runs on)."""
    return cpu_int8_kind() if setting == "auto" else setting


def resolve_precision(requested: str, device: torch.device) -> str:
    """fp32/bf16/fp16 for this device; ConfigError for a precision the device cannot run."""
    if requested == "fp16" and device.type != "cuda":
        raise ConfigError("train.precision = 'fp16' needs a CUDA GPU (GradScaler); on CPU use "
                          "auto, fp32 or bf16")
    if requested != "auto":
        return requested
    if device.type == "cuda":
        # this GPU's answer (a worker's own, before the process group binds it); no index: the current GPU's
        with torch.cuda.device(device.index) if device.index is not None else contextlib.nullcontext():
            return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    return "bf16" if cpu_supports_bf16() else "fp32"


def use_channels_last(setting: str, device: torch.device, precision: str) -> bool:
    """``train.channels_last`` resolved: auto is on for CPU and for CUDA with bf16/fp16 (tensor cores)."""
    if setting != "auto":
        return setting == "on"
    return device.type == "cpu" or precision in ("bf16", "fp16")


@dataclass(frozen=True)
class Job:
    """This node's part of a job, ``distributed.nproc_per_node`` and ``distributed.nnodes`` resolved."""

    nproc_per_node: int
    min_nodes: int
    max_nodes: int
    gpus_requested: int | None = None  # None: nproc_per_node auto, a share of the free GPUs (distributed.host_leases)

    @property
    def max_world_size(self) -> int:
        """Processes in the job at its largest (an elastic ``MIN:MAX`` job's largest global batch)."""
        return self.nproc_per_node * self.max_nodes


def resolve_job(d: DistributedConfig) -> Job:
    """Processes on this node and the job's nodes. ``auto``: one process per visible GPU; on a CPU-only machine
    one process that uses every core as intra-op threads, which measured faster than one single-thread process
    per core (BENCHMARKS.md, "DDP on one host" and "`auto` by measuring"). An int is refused above the GPUs (CUDA) or
    cores (CPU)."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    nodes = [int(n) for n in d.nnodes.split(":")]  # N or MIN:MAX, checked by the config's checks
    if d.nproc_per_node == "auto":
        return Job(gpus or 1, nodes[0], nodes[-1])
    nproc = int(d.nproc_per_node)
    limit, what = (gpus, "visible GPUs") if gpus else (cpu_count(), "CPU cores this process may use")
    if nproc > limit:
        raise ConfigError(f"distributed.nproc_per_node = {nproc} is not accepted on this node: it has {limit} "
                          f"{what}; accepted: 1 to {limit}, or auto")
    return Job(nproc, nodes[0], nodes[-1], nproc)
