"""What a training measures: exact validation over ranks, the epoch sums, the final metrics."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ddpipe.core.devices import PrecisionPolicy
from ddpipe.core.ranks import DistInfo
from ddpipe.data.loaders import BatchKey, Splits, eval_batches
from ddpipe.data.store import load_meta
from ddpipe.data.transforms import BatchTransform
from ddpipe.engine.meters import EpochProgress, measure_split
from tests.conftest import spawn


def _eval_rank(rank: int, world: int, prepared: Path, out: Path) -> None:
    torch.manual_seed(0)
    from ddpipe.models.nets import ResNetSmall

    model = ResNetSmall(1, 10, 8).eval()
    splits = Splits(prepared, load_meta(prepared), ("val",), [28, 28])
    n = 143  # not divisible by 2 or 3
    batches = (splits.__getitems__(BatchKey("val", None, b)) for b in eval_batches(n, 16, rank, world))
    info = DistInfo(distributed=True, rank=rank, local_rank=rank, world_size=world, local_world_size=world,
                    backend="gloo")
    t = BatchTransform([0.3], [0.3], 0, False, 0, info.device, False)
    loss, acc = measure_split(model, batches, n, t, info, PrecisionPolicy(info.device, "fp32", channels_last=False))
    if rank == 0:
        torch.save({"loss": loss, "acc": acc}, out)


@pytest.mark.parametrize("world", [2, 3])
def test_validation_counts_each_sample_once_at_any_world_size(prepared: Path, world: int, tmp_path: Path) -> None:
    spawn(_eval_rank, 1, prepared, tmp_path / "one.pt")
    spawn(_eval_rank, world, prepared, tmp_path / "many.pt")
    one, many = (torch.load(tmp_path / f, weights_only=True) for f in ("one.pt", "many.pt"))
    assert one["acc"] == pytest.approx(many["acc"], abs=1e-12)
    assert one["loss"] == pytest.approx(many["loss"], rel=1e-6)


def test_a_checkpoints_epoch_progress_loads_by_name_and_from_older_checkpoints() -> None:
    """Today's named form; and through the checkpoint's format 0 (written before format versions), the float64
    tensor of before the fields were named and the nothing of before mid-epoch checkpoints recorded it."""
    from ddpipe.engine.checkpoint import upgraded

    done = EpochProgress(loss_sum=12.5, correct=40.0, count=64.0, seconds=3.25)
    assert EpochProgress.from_state(done.as_state()) == done
    older = {"epoch_progress": torch.tensor([12.5, 40.0, 64.0, 3.25], dtype=torch.float64)}
    assert EpochProgress.from_state(upgraded(older, 0)["epoch_progress"]) == done
    assert EpochProgress.from_state(upgraded({}, 0)["epoch_progress"]) == EpochProgress()
    assert EpochProgress.from_state(upgraded({"epoch_progress": done.as_state()}, 0)["epoch_progress"]) == done
