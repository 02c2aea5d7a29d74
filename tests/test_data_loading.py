"""What a rank reads: DistributedSampler's order kept as one tensor, every sample counted once in evaluation,
keyed augmentation, and a DataLoader whose workers never change a batch."""

from __future__ import annotations

import pickle
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import BatchSampler, DistributedSampler

from ddpipe.config.load import load_config
from ddpipe.config.schema import ConfigError
from ddpipe.core.devices import PrecisionPolicy
from ddpipe.data.loaders import BatchKey, Splits, TrainingData, TrainOrder, eval_batches, real_sample_mask
from ddpipe.data.store import load_meta
from ddpipe.data.transforms import BatchTransform, EncodedBatch, EvalCrop, TrainCrop, decode
from ddpipe.engine.resolved import RECIPE_PRESETS, eval_input_size, input_size, resolve
from tests.conftest import prepare_generated_folder

CPU = torch.device("cpu")


@pytest.mark.parametrize("n, world, batch", [(100, 2, 8), (101, 2, 8), (97, 3, 4), (64, 1, 16)])
def test_train_order_is_distributed_samplers(n: int, world: int, batch: int) -> None:
    for rank in range(world):
        order = TrainOrder(n, batch, rank, world, seed=5)
        sampler = DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=True, seed=5, drop_last=True)
        for epoch in (0, 3):
            sampler.set_epoch(epoch)
            expected = list(BatchSampler(sampler, batch, drop_last=True))
            assert order.batches(epoch).tolist() == expected and len(order) == len(expected)


def test_a_steps_global_batch_is_the_same_at_every_world_size() -> None:
    two = [TrainOrder(100, 8, rank, 2, seed=0).batches(0) for rank in range(2)]
    one = TrainOrder(100, 16, 0, 1, seed=0).batches(0)
    assert len(one) == len(two[0]) == 6
    for step in range(6):
        assert set(one[step].tolist()) == set(two[0][step].tolist()) | set(two[1][step].tolist())
    flat = torch.cat([two[0].flatten(), two[1].flatten()])
    assert len(set(flat.tolist())) == 96  # no sample twice in an epoch
    assert not torch.equal(TrainOrder(100, 16, 0, 1, seed=0).batches(1), one)  # a new shuffle each epoch


@pytest.mark.parametrize("n, world", [(10, 3), (7, 2), (5, 4), (12, 1)])
def test_eval_shards_count_every_sample_exactly_once(n: int, world: int) -> None:
    counted = []
    for rank in range(world):
        seen = 0
        for idx in eval_batches(n, 2, rank, world):
            mask = real_sample_mask(seen, len(idx), rank, world, n)
            counted += idx[mask].tolist()
            seen += len(idx)
    assert sorted(counted) == list(range(n))


def test_augmentation_depends_on_sample_and_epoch_not_on_batch() -> None:
    images = torch.randint(0, 255, (6, 1, 12, 12), dtype=torch.uint8)
    t = BatchTransform([0.5], [0.25], crop_padding=2, hflip=True, seed=3, device=CPU, channels_last=False)
    idx = torch.tensor([10, 11, 12, 13, 14, 15])
    full = t(images, idx, epoch=1)
    part = t(images[[4, 1]], idx[[4, 1]], epoch=1)  # other batch, other order, same samples
    assert torch.equal(part, full[[4, 1]])
    assert not torch.equal(t(images, idx, epoch=2), full)
    assert not torch.equal(full, t(images, idx, epoch=None))
    plain = t(images, idx, epoch=None)
    np.testing.assert_allclose(plain.numpy(), ((images.float() / 255 - 0.5) / 0.25).numpy(), rtol=1e-5, atol=1e-5)


def test_augmentation_keeps_images_with_zero_padding() -> None:
    images = torch.full((64, 1, 8, 8), 200, dtype=torch.uint8)
    t = BatchTransform([0.0], [1.0], crop_padding=2, hflip=False, seed=0, device=CPU, channels_last=True)
    out = t(images, torch.arange(64), epoch=0)
    assert out.shape == (64, 1, 8, 8) and out.is_contiguous(memory_format=torch.channels_last)
    shifted = (out != out[0:1].max()).flatten(1).any(1)
    assert 0 < shifted.sum() < 64  # most crops move, the centred one does not


def test_random_resized_crops_are_keyed_by_seed_epoch_and_index() -> None:
    image = torch.randint(0, 256, (3, 300, 200), dtype=torch.uint8)
    crop = TrainCrop(64, 0.08, hflip=True, seed=1)
    a = crop(image, 7, 2)
    assert a.shape == (3, 64, 64) and a.dtype == torch.uint8
    assert torch.equal(a, crop(image, 7, 2))
    assert not torch.equal(a, crop(image, 8, 2)) and not torch.equal(a, crop(image, 7, 3))
    assert not torch.equal(a, TrainCrop(64, 0.08, hflip=True, seed=2)(image, 7, 2))
    centre = EvalCrop(64)(image)  # the centre square of 0.875 of the shorter side: 175 x 175
    assert centre.shape == (3, 64, 64) and torch.equal(centre, EvalCrop(64)(image.clone()))


@pytest.fixture(scope="module")
def encoded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return prepare_generated_folder(tmp_path_factory.mktemp("enc"), 90, 0.2)


def _data(prepared: Path, workers: int, rank: int = 0, world: int = 1, batch: int = 8, *extra: str) -> TrainingData:
    cfg = load_config([f"paths.prepared={prepared}", "data.image_size=48", "seed=4",
                       f"train.batch_size_per_rank={batch}", *extra], params_file=None)
    return resolve(cfg, CPU).training_data(load_meta(prepared), PrecisionPolicy(CPU, "fp32", False), rank=rank,
                             world_size=world, num_workers=workers)


@pytest.mark.parametrize("policy", [[], ["train.auto_augment=trivialaugment", "train.random_erasing=0.5"]])
def test_images_decoded_on_the_device_are_the_workers_images(encoded: Path, policy: list[str]) -> None:
    """data.decode_on=device: the loader hands over the files undecoded with each one's crop, flip and keys; on
    the device (here the CPU) they become the very batches the workers make, policy and all, for training and
    validation, read in the training process or in a worker."""
    workers = _data(encoded, 1, 0, 1, 8, *policy)
    later, later_read_ahead = (_data(encoded, n, 0, 1, 8, "data.decode_on=device", *policy) for n in (0, 1))
    try:
        for epoch in (0, 1):
            for x, y, z in zip(workers.train_batches(epoch), later.train_batches(epoch),
                               later_read_ahead.train_batches(epoch)):
                assert isinstance(y[0], EncodedBatch) and isinstance(z[0], EncodedBatch)
                assert len(y[0]) == 8 and y[0].data.dtype == torch.uint8
                assert torch.equal(y[0].to(CPU), x[0]) and torch.equal(z[0].to(CPU, non_blocking=True), x[0])
                assert torch.equal(y[1], x[1]) and torch.equal(y[2], x[2])
        for x, y in zip(workers.eval_batches("val", 5), later.eval_batches("val", 5)):
            assert torch.equal(y[0].to(CPU), x[0])
        assert torch.equal(later.examples(4), workers.examples(4))
    finally:
        workers.loader.close()
        later_read_ahead.loader.close()


def test_where_images_are_decoded_resolves_by_device(encoded: Path, prepared: Path) -> None:
    """auto: in the workers, on a CPU and on CUDA alike, until a GPU run shows decoding on the device at least as fast
    (issue 71: it has never run); device when told; raw data has nothing to decode; the run records which; decoding
    on the device reads ahead with one worker on CUDA and none on a CPU."""
    cfg = load_config([f"paths.prepared={encoded}", "data.image_size=48"], params_file=None)
    on_cpu = resolve(cfg, CPU)
    assert not on_cpu.decode_on_device and on_cpu.params()["data.decode_on"] == "workers"
    on_cuda = replace(on_cpu, device=torch.device("cuda"))
    assert not on_cuda.decode_on_device and on_cuda.params()["data.decode_on"] == "workers"
    told = resolve(replace(cfg, data=replace(cfg.data, decode_on="device")), CPU)
    assert told.decode_on_device and told.params()["data.decode_on"] == "device" and told.loader_workers(2) == 0
    assert replace(told, device=torch.device("cuda")).loader_workers(8) == 1
    assert not replace(told, device=torch.device("cuda"), meta=load_meta(prepared)).decode_on_device
    with pytest.raises(ConfigError, match="data.decode_on"):
        load_config(["data.decode_on=gpu"], params_file=None)


def test_images_decoded_by_the_batched_jpeg_decoder_are_counted(tmp_path: Path) -> None:
    """decode_jpegs_on counts the images it decoded (what tests/test_gpu.py reads to fail when nvJPEG did not decode,
    where EncodedBatch.to would fall back to the CPU); a batch it cannot decode raises and counts none."""
    from torchvision.io import encode_jpeg

    from ddpipe.data import transforms

    files = [encode_jpeg(torch.randint(0, 256, (3, 20 + k, 30), dtype=torch.uint8)) for k in range(3)]
    before = transforms.decoded_on_device()
    images = transforms.decode_jpegs_on(CPU, files, 3)
    assert [tuple(i.shape) for i in images] == [(3, 20 + k, 30) for k in range(3)]
    assert transforms.decoded_on_device() == before + 3
    with pytest.raises(RuntimeError):
        transforms.decode_jpegs_on(CPU, [torch.tensor([0xFF, 0xD8, 0xFF, 0, 1, 2], dtype=torch.uint8)], 3)
    assert transforms.decoded_on_device() == before + 3


def test_loader_workers_never_change_a_batch(encoded: Path) -> None:
    """The same batches, bit for bit, decoded in the training process or in 2 persistent workers, across
    epochs, with validation passes between them, and from a resumed step."""
    plain, workers = _data(encoded, 0), _data(encoded, 2)
    try:
        for epoch in (0, 1):
            a, b = list(plain.train_batches(epoch)), list(workers.train_batches(epoch))
            assert len(a) == len(b) == len(plain.order)
            for x, y in zip(a, b):
                assert all(torch.equal(u, v) for u, v in zip(x, y))
            va, vb = list(plain.eval_batches("val", 5)), list(workers.eval_batches("val", 5))
            assert all(torch.equal(x[0], y[0]) for x, y in zip(va, vb))
        resumed = list(workers.train_batches(1, start=2))
        assert all(torch.equal(x[0], y[0]) for x, y in zip(resumed, list(plain.train_batches(1))[2:]))
        assert a[0][0].shape == (8, 3, 48, 48) and a[0][0].dtype == torch.uint8
    finally:
        workers.loader.close()


def test_a_sample_looks_the_same_on_any_rank_and_world_size(encoded: Path) -> None:
    one = _data(encoded, 0, batch=8)
    two = [_data(encoded, 0, rank=r, world=2, batch=4) for r in range(2)]
    views = {}
    for data in (two[0], two[1]):
        for images, _, idx in data.train_batches(0):
            views.update({int(i): img for i, img in zip(idx, images)})
    for images, _, idx in one.train_batches(0):
        for i, img in zip(idx.tolist(), images):
            assert torch.equal(views[i], img)


def test_the_splits_pickle_as_paths_not_data(encoded: Path) -> None:
    """A spawned worker maps the files itself: what crosses to it does not grow with the dataset."""
    splits = Splits(encoded, load_meta(encoded), ("train", "val"), [48, 48])
    blob = pickle.dumps(splits)
    assert len(blob) < 2000
    again = pickle.loads(blob)
    key = BatchKey("val", None, torch.arange(3))
    assert torch.equal(again.__getitems__(key)[0], splits.__getitems__(key)[0])
    first = decode(splits.stored["val"].blob(0), 3)
    assert torch.equal(splits.__getitems__(key)[0][0], EvalCrop(48)(first))


def test_input_size_follows_the_encoding(encoded: Path) -> None:
    meta = load_meta(encoded)
    assert input_size(meta, None) == [224, 224] and input_size(meta, 96) == [96, 96]
    raw = replace(meta, encoding="raw", image_size=[28, 28])
    assert input_size(raw, None) == [28, 28] and input_size(raw, 28) == [28, 28]
    with pytest.raises(ConfigError, match="data.image_size = 32 is not accepted for the prepared raw images of 28x28"):
        input_size(raw, 32)
    # the evaluation view: encoded images at data.eval_image_size (FixRes; auto: the preset's share), raw as stored
    preset, raw_preset = RECIPE_PRESETS["encoded"], RECIPE_PRESETS["raw"]
    assert eval_input_size(meta, "80", 0.875, [64, 64], preset) == [80, 80]
    assert eval_input_size(meta, None, 1.0, [64, 64], preset) == [64, 64]
    assert eval_input_size(meta, "auto", 1.0, [64, 64], preset) == [72, 72]
    assert eval_input_size(raw, "auto", 0.875, [28, 28], raw_preset) == [28, 28]
    assert eval_input_size(raw, None, 0.875, [28, 28], raw_preset) == [28, 28]
    with pytest.raises(ConfigError, match="data.eval_image_size = 32 is not accepted for the prepared raw images"):
        eval_input_size(raw, "32", 0.875, [28, 28], raw_preset)
    with pytest.raises(ConfigError, match="data.eval_crop_ratio = 0.9 is not accepted for prepared raw images"):
        eval_input_size(raw, None, 0.9, [28, 28], raw_preset)
    splits = Splits(encoded, meta, ("val",), [32, 32], eval_crop=EvalCrop(40, 1.0))
    first = decode(splits.stored["val"].blob(0), 3)
    assert torch.equal(splits.__getitems__(BatchKey("val", None, torch.arange(2)))[0][0], EvalCrop(40, 1.0)(first))


def test_the_recipes_auto_keys_take_the_preset_of_the_inputs_kind(encoded: Path, prepared: Path) -> None:
    """data.eval_image_size, data.eval_crop_ratio and train.min_crop_scale: auto is RECIPE_PRESETS' row for the
    prepared data's encoding, a number is kept, and the run records (MLflow params) and fingerprints the values."""
    run = resolve(load_config([f"paths.prepared={encoded}", "data.image_size=64"], params_file=None), CPU)
    assert (run.eval_size, run.eval_crop_ratio, run.min_crop_scale) == ([72, 72], 1.0, 0.35)
    assert {k: run.params()[k] for k in ("data.eval_image_size", "data.eval_crop_ratio", "train.min_crop_scale")} \
        == {"data.eval_image_size": 72, "data.eval_crop_ratio": 1.0, "train.min_crop_scale": 0.35}
    imagenet = ["data.eval_crop_ratio=0.875", "train.min_crop_scale=0.08", "data.eval_image_size=null"]
    kept = resolve(load_config([f"paths.prepared={encoded}", "data.image_size=64", *imagenet], params_file=None), CPU)
    assert (kept.eval_size, kept.eval_crop_ratio, kept.min_crop_scale) == ([64, 64], 0.875, 0.08)
    # ImageNet's values fingerprint as a config written before auto did (its checkpoints still resume)
    assert {k: kept.trajectory()[k] for k in ("data.eval_image_size", "data.eval_crop_ratio", "train.min_crop_scale")} \
        == {"data.eval_image_size": None, "data.eval_crop_ratio": 0.875, "train.min_crop_scale": 0.08}
    assert run.trajectory()["train.min_crop_scale"] == 0.35
    loaded = load_config([f"paths.prepared={encoded}", "data.image_size=64", "data.eval_crop_ratio=0.95",
                          "train.min_crop_scale=0.5", "data.eval_image_size=80"], params_file=None)
    mine = resolve(loaded, CPU)
    assert (mine.eval_size, mine.eval_crop_ratio, mine.min_crop_scale) == ([80, 80], 0.95, 0.5)
    raw = resolve(load_config([f"paths.prepared={prepared}"]), CPU)  # params.yaml: all three auto
    assert (raw.eval_size, raw.eval_crop_ratio, raw.min_crop_scale) == ([28, 28], 0.875, 0.08)
    for key, value in (("data.eval_crop_ratio", "1.5"), ("train.min_crop_scale", "0"), ("data.eval_crop_ratio", "big")):
        with pytest.raises(ConfigError, match=rf"{key} = '{value}' is not accepted; expected a number > 0.0 and "
                                              r"<= 1.0 or auto"):
            load_config([f"{key}={value}"])
