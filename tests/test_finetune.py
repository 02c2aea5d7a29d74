"""Fine-tuning from an earlier experiment's exported model: a lower lr for the body, the body frozen for an epoch
(its weights and BatchNorm statistics untouched), then trained; exact resume and 2 processes keep working."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from ddpipe.engine.checkpoint import list_checkpoints
from ddpipe.engine.loop import train
from ddpipe.engine.resolved import resolve
from ddpipe.launch.torchrun import this_device
from ddpipe.models.finetune import FineTuning
from ddpipe.models.nets import ResNetCompact
from tests.conftest import ROOT, args_for, run, same_weights, torchrun, weights


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory, prepared: Path) -> Path:
    """A model exported by one experiment (1 epoch of resnet_compact), copied into a pretrained/ folder."""
    tmp = tmp_path_factory.mktemp("source-exp")
    run(["python", "stages/train_worker.py", *args_for(tmp, prepared, "model.name=resnet_compact", "num_epochs=1",
                                                 "mlflow.log_model=false")])
    (tmp / "pretrained").mkdir()
    return Path(shutil.copy(tmp / "model.pt", tmp / "pretrained" / "exp1.pt"))


def finetune_args(tmp: Path, prepared: Path, exported: Path, *extra: str) -> list[str]:
    return args_for(tmp, prepared, "model.name=resnet_compact", f"paths.pretrained={exported.parent}",
                    f"model.weights={exported}", "train.body_lr_ratio=0.1", "train.freeze_body_epochs=1",
                    "train.keep_checkpoints=5", *extra)


def test_param_groups_and_freezing_by_epoch() -> None:
    model = ResNetCompact(1, 10, 8)
    ft = FineTuning(0.1, 2, model, 10)
    head, body = ft.param_groups(model, 0.01)
    assert head["lr"] == 0.01 and body["lr"] == pytest.approx(0.001)
    assert {id(p) for p in head["params"]} == {id(p) for p in model.classifier.parameters()}
    assert len(head["params"]) + len(body["params"]) == len(list(model.parameters()))
    assert ft.set_epoch(model, 0) and not model.features[0].weight.requires_grad
    assert model.classifier.weight.requires_grad
    assert not ft.set_epoch(model, 1)  # still frozen: nothing to re-wrap
    model.train()
    ft.freeze_batchnorm(model)
    assert not model.features[1].training and model.training
    assert ft.set_epoch(model, 2) and model.features[0].weight.requires_grad
    off = FineTuning(1.0, 0, model, 10)
    assert len(off.param_groups(model, 0.01)) == 1 and not off.set_epoch(model, 0)


def test_a_frozen_body_keeps_the_exported_weights_and_statistics_then_trains(
        tmp_path: Path, prepared: Path, exported: Path, tiny_cfg) -> None:
    """Epoch 1 trains the new head only: every body tensor (BatchNorm's running statistics included) is the
    exported model's; epoch 2 trains the body too. MLflow records the weights' file and sha256."""
    cfg = tiny_cfg(*finetune_args(tmp_path, prepared, exported, "mlflow.log_model=false",
                                  "mlflow.log_system_metrics=false"))
    train(resolve(cfg, this_device()))
    source = weights(exported)
    (pos1, first), (pos2, second) = [(p, torch.load(f, weights_only=True)["model"])
                                     for p, f in list_checkpoints(tmp_path / "ckpt")]
    assert (pos1.epoch, pos2.epoch) == (1, 2)
    body = [k for k in source if not k.startswith("classifier.")]
    assert all(torch.equal(first[k], source[k]) for k in body)
    assert not torch.equal(first["classifier.weight"], source["classifier.weight"])
    assert not torch.equal(second["features.0.weight"], source["features.0.weight"])
    assert not torch.equal(second["features.1.running_mean"], source["features.1.running_mean"])

    import hashlib

    from mlflow import MlflowClient

    client = MlflowClient(cfg.mlflow.tracking_uri)
    (run_,) = client.search_runs([client.get_experiment_by_name(cfg.mlflow.experiment_name).experiment_id])
    assert run_.data.params["weights_sha256"] == hashlib.sha256(exported.read_bytes()).hexdigest()
    assert run_.data.params["model.weights"] == str(exported)


@pytest.mark.slow
def test_fine_tuning_resumes_bit_equal_and_runs_under_two_processes(
        tmp_path: Path, prepared: Path, exported: Path) -> None:
    """Killed inside its frozen first epoch and resumed, a fine-tuning ends with the uninterrupted run's
    weights; under 2 processes (DDP re-wrapped when the body thaws) it ends with them too (exact mode)."""
    common = ("num_epochs=2", "mlflow.log_model=false", "train.checkpoint_every_steps=3", "distributed.exact=true",
              "train.lr_scaling=none",
              "train.keep_checkpoints=100", f"mlflow.tracking_uri=sqlite:///{tmp_path}/mlflow.db")
    whole = tmp_path / "whole"
    run(["python", "stages/train_worker.py", *finetune_args(whole, prepared, exported, *common)])
    mid = tmp_path / "mid"  # the whole run's checkpoint of epoch 1, step 3 (the body frozen), resumed
    shutil.copytree(whole / "ckpt", mid / "ckpt")
    for pos, path in list_checkpoints(mid / "ckpt"):
        if (pos.epoch, pos.step) != (0, 3):
            path.unlink()
    out = run(["python", "stages/train_worker.py", *finetune_args(mid, prepared, exported, *common)]).stderr
    assert "at epoch 1, step 3" in out and "epoch 1: the body is frozen" in out
    assert same_weights(weights(mid / "model.pt"), weights(whole / "model.pt"))
    two = tmp_path / "two"
    run([*torchrun(2, *finetune_args(two, prepared, exported, *common, "train.batch_size_per_rank=16"))], cwd=ROOT)
    assert same_weights(weights(two / "model.pt"), weights(whole / "model.pt"))  # the same global batch, bit-equal


def test_a_torchvision_network_trains_from_a_torchvision_state_dict(tmp_path: Path, prepared: Path, tiny_cfg,
                                                                    capsys: pytest.CaptureFixture) -> None:
    """resnet18 from a torchvision-format file (3 channels, 1,000 classes) on grey 10-class images: the stem
    summed, the head replaced, and the run records the file's sha256."""
    import hashlib

    import torchvision
    from mlflow import MlflowClient

    (tmp_path / "pretrained").mkdir()
    file = tmp_path / "pretrained" / "resnet18-f37072fd.pth"
    torch.save(torchvision.models.resnet18(num_classes=1000).state_dict(), file)
    cfg = tiny_cfg(f"paths.prepared={prepared}", "model.name=resnet18", f"paths.pretrained={tmp_path}/pretrained",
                   f"model.weights={file}", "num_epochs=1", "mlflow.log_model=false",
                   "mlflow.log_system_metrics=false")
    train(resolve(cfg, this_device()))
    out = capsys.readouterr().err
    assert "stem conv1: 3-channel weights summed over RGB" in out and "classifier head fc replaced for 10" in out
    client = MlflowClient(cfg.mlflow.tracking_uri)
    (run_,) = client.search_runs([client.get_experiment_by_name(cfg.mlflow.experiment_name).experiment_id])
    assert run_.data.params["weights_sha256"] == hashlib.sha256(file.read_bytes()).hexdigest()
    assert run_.data.params["model.name"] == "resnet18"
