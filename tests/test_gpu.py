"""The CUDA and NCCL paths, on a GPU: autocast with the GradScaler, channels_last, augmentation and
pinned non-blocking copies on the device, torch's SyncBatchNorm, torch.compile, a model saved on the
GPU loaded on the CPU, a short training, and the launcher under torchrun with NCCL (a stop, then the
resume). Skipped cleanly without a GPU; ``make test-gpu`` runs them. They need torch and the small
pure-Python packages ddpipe imports (omegaconf, PyYAML, tqdm), not MLflow: without it the tracker
warns and training goes on."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from ddpipe.config.load import load_config
from ddpipe.core.devices import PrecisionPolicy, cuda_kernels
from ddpipe.core.exits import EXIT_PREEMPTED
from ddpipe.data.store import load_meta, open_split
from ddpipe.data.transforms import BatchTransform
from ddpipe.distributed.batchnorm import convert_sync_batchnorm
from ddpipe.engine.resolved import resolve, use_channels_last
from ddpipe.models.nets import ResNetSmall
from ddpipe.models.saved import load_model
from tests.conftest import FIRST_EPOCH, ROOT, args_for, same_weights, subprocess_env, weights

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CUDA = torch.device("cuda", 0)
NO_MLFLOW = ("mlflow.log_model=false", "mlflow.log_system_metrics=false")


def _cfg(tiny_cfg, prepared: Path, *extra: str):
    return tiny_cfg(f"paths.prepared={prepared}", "train.hflip=false", *NO_MLFLOW, *extra)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_a_short_training_on_one_gpu(tiny_cfg, prepared: Path, precision: str) -> None:
    """Two epochs in-process on the GPU learn the generated bars; fp16 runs through the GradScaler,
    whose state travels in the checkpoint."""
    from ddpipe.engine.loop import train
    from ddpipe.engine.resolved import resolve
    from ddpipe.launch.torchrun import this_device

    cfg = _cfg(tiny_cfg, prepared, f"train.precision={precision}")
    metrics = train(resolve(cfg, this_device()))
    assert metrics["val_accuracy"] > 0.5, metrics
    # train.deterministic false, the default: cuDNN times its algorithms, fp32 products in TF32
    assert torch.backends.cudnn.benchmark and not torch.are_deterministic_algorithms_enabled()
    weights = torch.load(cfg.paths.model, map_location="cpu", weights_only=True)["state_dict"]
    assert all(torch.isfinite(w).all() for w in weights.values() if w.is_floating_point())
    newest = sorted(Path(cfg.paths.checkpoints).glob("ckpt-*.pt"))[-1]
    scaler = torch.load(newest, map_location="cpu", weights_only=True)["scaler"]
    assert ("scale" in scaler) == (precision == "fp16")


def test_a_model_trained_on_the_gpu_loads_on_the_cpu_and_answers_the_same(tiny_cfg, prepared: Path) -> None:
    from ddpipe.engine.loop import train
    from ddpipe.engine.resolved import resolve
    from ddpipe.launch.torchrun import this_device

    cfg = _cfg(tiny_cfg, prepared, "num_epochs=1", "train.precision=fp32")
    train(resolve(cfg, this_device()))
    cpu_model, saved = load_model(cfg.paths.model)
    assert all(t.device.type == "cpu" for t in cpu_model.state_dict().values())
    gpu_model = load_model(cfg.paths.model)[0].to(CUDA)
    images, idx = torch.from_numpy(open_split(prepared, "val").pixels(range(64))), torch.arange(64)
    transform = BatchTransform(saved.mean, saved.std, 0, False, 0, torch.device("cpu"), False)
    cuda_kernels(CUDA, deterministic=True)  # fp32 as the CPU computes it (the training left TF32 on)
    try:
        with torch.no_grad():
            on_cpu = cpu_model(transform(images, idx, None))
            on_gpu = gpu_model(transform(images, idx, None).to(CUDA)).cpu()
    finally:
        cuda_kernels(CUDA, deterministic=False)
    torch.testing.assert_close(on_gpu, on_cpu, rtol=1e-3, atol=1e-3)
    assert torch.equal(on_gpu.argmax(1), on_cpu.argmax(1))


def test_a_model_trained_on_the_gpu_in_bf16_exports_an_onnx_graph_that_answers_as_it_does(tiny_cfg,
                                                                                          prepared: Path) -> None:
    """The export stage's graph (``ddpipe.export.graph``) of a bf16 GPU training, run by ONNX Runtime on the raw uint8
    test images: the classes and probabilities of the saved model on the CPU."""
    ort = pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    from ddpipe.engine.loop import train
    from ddpipe.export.graph import ExportedClassifier, export_onnx
    from ddpipe.launch.torchrun import this_device

    cfg = _cfg(tiny_cfg, prepared, "num_epochs=1", "train.precision=bf16")
    train(resolve(cfg, this_device()))
    model, saved = load_model(cfg.paths.model)
    graph = Path(cfg.paths.model).with_suffix(".onnx")
    export_onnx(model, saved, graph, 18)
    images = open_split(prepared, "test").pixels(range(200))
    probs = ort.InferenceSession(str(graph), providers=["CPUExecutionProvider"]).run(None, {"images": images})[0]
    with torch.no_grad():
        reference = ExportedClassifier(model, saved)(torch.from_numpy(images)).numpy()
    assert probs.shape == reference.shape and (probs.argmax(1) == reference.argmax(1)).all()
    assert abs(probs - reference).max() < 1e-4


def test_augmentation_on_the_gpu_is_the_cpu_augmentation(prepared: Path) -> None:
    """Crops and flips are keyed by integer hashes that CUDA and the CPU compute alike: the same
    pixels on either device, so a run's augmentation does not depend on where it runs."""
    meta = load_meta(prepared)
    images, idx = torch.from_numpy(open_split(prepared, "train").pixels(range(128))), torch.arange(128)
    cpu = BatchTransform(meta.mean, meta.std, 2, True, 42, torch.device("cpu"), True)
    gpu = BatchTransform(meta.mean, meta.std, 2, True, 42, CUDA, True)
    assert torch.equal(gpu._augment(images.to(CUDA), idx.to(CUDA), 3).cpu(), cpu._augment(images, idx, 3))
    out = gpu(images.to(CUDA), idx, 3)
    assert out.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(out.cpu(), cpu(images, idx, 3), rtol=0, atol=1e-6)


def test_pinned_batches_reach_the_gpu_with_non_blocking_copies(prepared: Path) -> None:
    cfg = load_config([f"paths.prepared={prepared}", "train.batch_size_per_rank=32"], params_file=None)
    data = resolve(cfg, CUDA).training_data(load_meta(prepared), PrecisionPolicy(CUDA, "fp32", True), rank=0,
                             world_size=1, num_workers=0)
    images, labels, _ = next(iter(data.train_batches(0)))
    assert images.is_pinned() and labels.is_pinned()
    on_gpu = images.to(CUDA, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(on_gpu.cpu(), images)


def test_encoded_images_decoded_by_loader_workers_reach_the_gpu_pinned(tmp_path: Path) -> None:
    """JPEG/PNG files of many sizes: 2 persistent workers decode and crop, the pin-memory thread pins, and
    the batches equal those decoded without workers."""
    from bench.imageset import generate
    from ddpipe.config.schema import DataConfig
    from ddpipe.data.prepare import prepare

    src = generate(tmp_path / "imgs", 60, 3)
    prepare(DataConfig(dataset="imagefolder", source_dir=str(src)), 0, tmp_path / "raw", tmp_path / "p", workers=1)
    cfg = load_config([f"paths.prepared={tmp_path / 'p'}", "data.image_size=64", "seed=0",
                       "train.batch_size_per_rank=8", "data.decode_on=workers"], params_file=None)
    meta = load_meta(tmp_path / "p")
    run = resolve(cfg, CUDA)
    workers = run.training_data(meta, PrecisionPolicy(CUDA, "fp32", True), rank=0, world_size=1, num_workers=2)
    plain = run.training_data(meta, PrecisionPolicy(torch.device("cpu"), "fp32", True), rank=0, world_size=1,
                              num_workers=0)
    try:
        for (images, labels, _), (expected, _, _) in zip(workers.train_batches(0), plain.train_batches(0)):
            assert images.is_pinned() and labels.is_pinned()
            assert torch.equal(images.to(CUDA, non_blocking=True).cpu(), expected)
    finally:
        workers.loader.close()


def test_jpegs_decoded_on_the_gpu_match_the_workers_and_train(tiny_cfg, tmp_path: Path) -> None:
    """data.decode_on=device (auto is the workers until this path is shown as fast: issue 71): the loader's one worker
    reads the files into pinned memory, nvJPEG decodes the JPEGs of a batch at once on the GPU (PNGs on the CPU), and
    the crops, flips and policy taken there give the workers' batches up to the decoders' rounding; a short training
    reads them. nvJPEG must have decoded every JPEG: a batch it refused would be decoded on the CPU with a warning
    (EncodedBatch.to), which fails here, and the images it decoded are counted."""
    from bench.imageset import generate
    from ddpipe.config.schema import DataConfig
    from ddpipe.data.prepare import prepare
    from ddpipe.data.transforms import JPEG_START, EncodedBatch, decoded_on_device
    from ddpipe.engine.loop import train

    src = generate(tmp_path / "imgs", 90, 3)
    prepare(DataConfig(dataset="imagefolder", source_dir=str(src)), 0, tmp_path / "raw", tmp_path / "p", workers=1)
    base = [f"paths.prepared={tmp_path / 'p'}", "data.image_size=64", "seed=0", "train.batch_size_per_rank=8"]
    meta, compute = load_meta(tmp_path / "p"), PrecisionPolicy(CUDA, "bf16", True)
    assert not resolve(load_config(base, params_file=None), CUDA).decode_on_device  # auto: the workers, on CUDA too
    run = resolve(load_config([*base, "data.decode_on=device", "train.random_erasing=0.5"], params_file=None), CUDA)
    assert run.decode_on_device and run.loader_workers(16) == 1
    on_gpu = run.training_data(meta, compute, rank=0, world_size=1, num_workers=1)
    cpu = resolve(load_config([*base, "train.random_erasing=0.5", "data.decode_on=workers"], params_file=None),
                  CUDA).training_data(meta, compute, rank=0, world_size=1, num_workers=0)
    jpegs, before = 0, decoded_on_device()
    try:
        for (batch, labels, _), (expected, expected_labels, _) in zip(on_gpu.train_batches(0), cpu.train_batches(0)):
            assert isinstance(batch, EncodedBatch) and batch.data.is_pinned()
            jpegs += sum(bytes(f[:3].tolist()) == JPEG_START for f in batch.files())
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # nvJPEG's fallback to the CPU is a warning: here, a failure
                images = batch.to(CUDA, non_blocking=True)
            assert images.device.type == "cuda" and images.shape == expected.shape
            diff = (images.cpu().int() - expected.int()).abs().float()
            assert diff.mean() < 1.0 and diff.max() <= 32, (diff.mean(), diff.max())
            assert torch.equal(labels, expected_labels)
    finally:
        on_gpu.loader.close()
    assert jpegs > 0 and decoded_on_device() - before == jpegs  # every JPEG by nvJPEG, none by the fallback
    cfg = tiny_cfg(*base, "data.decode_on=device", *NO_MLFLOW, "num_epochs=2")
    before = decoded_on_device()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="nvJPEG could not decode")
        metrics = train(resolve(cfg, CUDA))
    assert decoded_on_device() > before  # the training's batches were decoded by nvJPEG
    assert metrics["val_loss"] == metrics["val_loss"] and metrics["val_loss"] < 10, metrics  # finite
    weights = torch.load(cfg.paths.model, map_location="cpu", weights_only=True)["state_dict"]
    assert all(torch.isfinite(w).all() for w in weights.values() if w.is_floating_point())


def test_channels_last_and_bf16_on_the_gpu_match_the_plain_layout() -> None:
    torch.manual_seed(0)
    plain = ResNetSmall(1, 10, 8)
    fast = PrecisionPolicy(CUDA, "bf16", use_channels_last("auto", CUDA, "bf16"))
    assert fast.channels_last and fast.pin_memory  # auto: channels_last with bf16 on CUDA
    model = fast.place(ResNetSmall(1, 10, 8))
    model.load_state_dict(plain.state_dict())
    conv = next(m for m in model.modules() if isinstance(m, nn.Conv2d))
    assert conv.weight.is_contiguous(memory_format=torch.channels_last)
    x = torch.randn(16, 1, 28, 28)
    with torch.no_grad():
        expected = plain.to(CUDA).eval()(x.to(CUDA))
        with fast.autocast():
            got = model.eval()(x.to(CUDA).contiguous(memory_format=torch.channels_last))
    torch.testing.assert_close(got.float(), expected, rtol=5e-2, atol=5e-2)


def test_torch_sync_batchnorm_on_cuda_trains_like_batchnorm() -> None:
    """convert_sync_batchnorm picks torch's SyncBatchNorm on CUDA; in a one-rank NCCL group it trains
    as plain BatchNorm does (a group of several ranks needs several GPUs)."""
    import torch.distributed as dist

    torch.manual_seed(0)
    plain = ResNetSmall(1, 10, 8).to(CUDA)
    synced = convert_sync_batchnorm(ResNetSmall(1, 10, 8), CUDA).to(CUDA)
    synced.load_state_dict(plain.state_dict())
    num_bn = sum(isinstance(m, nn.BatchNorm2d) for m in plain.modules())
    assert num_bn and sum(isinstance(m, nn.SyncBatchNorm) for m in synced.modules()) == num_bn
    store = dist.HashStore()
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=CUDA)
    try:
        x = torch.randn(32, 1, 28, 28, device=CUDA)
        for model in (plain, synced):
            model.train()
            model(x).square().mean().backward()
        for a, b in zip(plain.parameters(), synced.parameters()):
            torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-5)
        for (name, a), b in zip(plain.named_buffers(), synced.buffers()):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=name)
    finally:
        dist.destroy_process_group()


def test_a_compiled_training_on_the_gpu(tiny_cfg, prepared: Path) -> None:
    from ddpipe.engine.loop import train
    from ddpipe.engine.resolved import resolve
    from ddpipe.launch.torchrun import this_device

    metrics = train(resolve(_cfg(tiny_cfg, prepared, "train.compile=true", "train.precision=bf16"), this_device()))
    assert metrics["val_accuracy"] > 0.5, metrics


@pytest.mark.parametrize("network", ["resnet_small", "seed_cnn"])  # global max pooling | global average pooling
def test_two_deterministic_trainings_on_the_gpu_end_bit_equal(tmp_path: Path, prepared: Path, network: str) -> None:
    """train.deterministic=true: two launches of one config (each a fresh process: cuBLAS's workspace set before its
    first call) end with the same weights to the bit, in bf16 autocast with channels_last, the CUDA default."""
    ends = []
    for name in ("first", "second"):
        out = tmp_path / name
        out.mkdir()
        args = args_for(out, prepared, "train.deterministic=true", f"model.name={network}", "train.precision=bf16",
                        *NO_MLFLOW)
        done = subprocess.run([sys.executable, "-m", "ddpipe.launch", *args], cwd=ROOT, env=subprocess_env(),
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        assert "backend nccl" in done.stdout + done.stderr, done.stdout[-3000:]
        ends.append(weights(out / "model.pt"))
    assert same_weights(*ends)


def test_the_launcher_under_torchrun_with_nccl_stops_on_sigterm_and_resumes(tmp_path: Path, prepared: Path) -> None:
    """python -m ddpipe.launch on the GPU: one NCCL worker (nproc auto), its stop agreement on a gloo
    side group; SIGTERM in epoch 2 -> exit 75 after a checkpoint; the same command finishes the run."""
    args = args_for(tmp_path, prepared, "num_epochs=3", *NO_MLFLOW)
    cmd = [sys.executable, "-m", "ddpipe.launch", *args]
    log = tmp_path / "first.log"
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=subprocess_env(), stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        deadline = time.time() + 300
        while not FIRST_EPOCH.search(log.read_text()) and proc.poll() is None and time.time() < deadline:
            time.sleep(0.1)
        assert proc.poll() is None, log.read_text()[-3000:]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=300) == EXIT_PREEMPTED, log.read_text()[-3000:]
    first = log.read_text()
    assert "--nproc-per-node=1" in first and "backend nccl" in first, first[-3000:]
    resumed = subprocess.run(cmd, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "resuming from" in resumed.stderr
    assert json.loads((tmp_path / "train.json").read_text())["train"]["epochs"] == 3
