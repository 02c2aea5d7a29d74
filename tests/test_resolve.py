"""The configuration a training runs with: every `auto` made concrete once, typed, for the launcher and the
workers alike (ddpipe.engine.resolved)."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from ddpipe.config.load import load_config
from ddpipe.config.schema import ConfigError
from ddpipe.engine import resolved as resolve_run
from ddpipe.engine.checkpoint import run_fingerprint
from ddpipe.engine.resolved import resolve

CPU = torch.device("cpu")


@pytest.mark.parametrize("amx, device, expected", [
    (False, "cpu", ("resnet_compact", 128)), (True, "cpu", ("resnet_small", 256)),
    (False, "cuda", ("resnet_small", 256)),
])
def test_auto_model_and_batch_follow_the_device(monkeypatch: pytest.MonkeyPatch, prepared: Path, amx: bool,
                                                 device: str, expected: tuple[str, int]) -> None:
    monkeypatch.setattr(resolve_run, "cpu_has_amx", lambda: amx)
    cfg = load_config([f"paths.prepared={prepared}"])  # params.yaml: both auto
    run = resolve(cfg, torch.device(device))
    assert (run.model_name, run.batch_size_per_rank) == expected and run.model_was_auto
    assert run.eval_batch_size_per_rank == 2 * expected[1]  # auto: twice the training batch
    assert cfg.model.name == "auto" and cfg.train.batch_size_per_rank == "auto"  # what the user set, untouched
    assert run.input_size == [28, 28] and run.device_kind == resolve_run.device_kind(torch.device(device))


def test_explicit_values_are_kept_and_typed(prepared: Path) -> None:
    cfg = load_config([f"paths.prepared={prepared}", "model.name=seed_cnn", "train.batch_size_per_rank=32",
                       "train.grad_accum_steps=2"])
    for device in ("cpu", "cuda"):
        run = resolve(cfg, torch.device(device))
        assert (run.model_name, run.batch_size_per_rank) == ("seed_cnn", 32) and not run.model_was_auto
        assert isinstance(run.batch_size_per_rank, int) and isinstance(run.eval_batch_size_per_rank, int)
    assert run.global_batch_size(2) == 128 and run.steps_per_epoch(2) == run.meta.sizes["train"] // 2 // 32 // 2 > 0
    params = run.params()  # what MLflow records: the values auto took, as ints
    assert params["train.batch_size_per_rank"] == 32 and params["train.eval_batch_size_per_rank"] == 64
    assert params["model.name"] == "seed_cnn"


def test_a_global_batch_larger_than_the_split_is_refused_at_that_world_size(prepared: Path) -> None:
    run = resolve(load_config([f"paths.prepared={prepared}", "train.batch_size_per_rank=600"]), CPU)
    run.check_world_size(1)
    with pytest.raises(ConfigError, match=r"train.batch_size_per_rank = 600 x 2 process\(es\) exceeds"):
        run.check_world_size(2)


def test_the_fingerprint_tells_torchvisions_resnet18_from_the_small_stem_one(prepared: Path) -> None:
    base = [f"paths.prepared={prepared}", "train.batch_size_per_rank=32"]
    new = resolve(load_config([*base, "model.name=resnet18"]), CPU)
    old = resolve(load_config([*base, "model.name=resnet18_cifar"]), CPU)
    assert new.trajectory()["model.torchvision_stem"] is True and "model.torchvision_stem" not in old.trajectory()

    def fingerprint(run: resolve_run.Resolved, world_size: int) -> str:  # as the trainer makes it
        return run_fingerprint(run.trajectory(), run.global_batch_size(world_size), 0.003, asdict(run.meta))

    assert fingerprint(new, 1) != fingerprint(old, 1)
    assert fingerprint(new, 2) != fingerprint(new, 1)  # the global batch differs


def test_every_auto_becomes_a_typed_value_and_the_config_keeps_what_was_written(prepared: Path) -> None:
    cfg = load_config([f"paths.prepared={prepared}", "train.freeze_body_epochs=all", "train.precision=fp32"])
    run = resolve(cfg, CPU)
    assert (run.precision, run.channels_last, run.backend) == ("fp32", True, "gloo")  # auto: CPU
    assert run.freeze_body_epochs is None
    assert run.model.name == run.model_name != "auto" and cfg.model.name == "auto"
    assert resolve(load_config([f"paths.prepared={prepared}", "train.freeze_body_epochs=2",
                                "distributed.backend=gloo"]), torch.device("cuda")).freeze_body_epochs == 2
    assert run.trajectory()["model.name"] == run.model_name  # what a checkpoint's fingerprint covers
    with pytest.raises(ConfigError, match="distributed.backend = 'nccl' needs CUDA GPUs"):
        resolve(load_config([f"paths.prepared={prepared}", "distributed.backend=nccl"]), CPU)
