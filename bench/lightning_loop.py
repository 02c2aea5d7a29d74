"""The reference model trained with PyTorch Lightning's Trainer, for the loop comparison.

    python bench/lightning_loop.py --devices 2 --epochs 2 --prepared bench/results/prepared-12k
    python bench/lightning_loop.py --quick                                  # smoke run, seconds

Needs Lightning: ``python -m pip install -e '.[bench]'``. ddpipe's ``SeedCNN(1, 10, 32)`` (BatchNorm
synchronised across processes with ddpipe's CPUSyncBatchNorm, as in the reference loop: torch's
SyncBatchNorm, which ``Trainer(sync_batchnorm=True)`` would use, raises on CPU tensors), trained by
``Trainer(accelerator="cpu", devices=W, strategy="ddp" when W > 1, max_epochs=E, precision=P)`` with
Adam at 1e-3 x sqrt(W) from a plain ``DataLoader`` (shuffled; Lightning inserts the
``DistributedSampler``) over a ``TensorDataset`` of the prepared split, normalised to float once.
Each process uses ``cores // W`` threads. A Callback on rank 0 times each training epoch
(``on_train_epoch_start`` to ``on_train_epoch_end``, after a sum of the images over the ranks); the
script prints a Markdown table and appends the run to ``bench/results/lightning_loop.jsonl``.
No validation, logging, checkpointing or progress bar: Lightning's loop at its leanest.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from common import REPO, append_jsonl, cores, markdown_table, write_json
from torch.utils.data import DataLoader, TensorDataset

from ddpipe.distributed import convert_sync_batchnorm
from ddpipe.models import SeedCNN

try:
    import lightning as L
except ImportError:
    sys.exit("bench/lightning_loop.py needs Lightning, which is not installed: "
             "python -m pip install -e '.[bench]'  (or: python -m pip install lightning)")

logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
logging.getLogger("lightning.fabric").setLevel(logging.WARNING)
warnings.filterwarnings("ignore", message=".*does not have many workers.*")
warnings.filterwarnings("ignore", message=".*sync_dist=True.*")
warnings.filterwarnings("ignore", message=".*LeafSpec.*")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--devices", type=int, default=1, help="processes (world size)")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=128, help="per process")
    p.add_argument("--prepared", default=str(REPO / "data" / "prepared"), help="a paths.prepared folder")
    p.add_argument("--max-train-samples", type=int, default=None, help="take the first N")
    p.add_argument("--precision", default="32-true", help="Lightning precision, e.g. 32-true, bf16-mixed")
    p.add_argument("--threads", type=int, default=None, help="per process (default: cores // devices)")
    p.add_argument("--no-sync-bn", action="store_true", help="plain BatchNorm at every world size")
    p.add_argument("--quick", action="store_true", help="1 epoch over 1024 samples")
    p.add_argument("--json-out", default=None, help="also write rank 0's result as JSON here")
    args = p.parse_args(argv)
    if args.quick:
        args.epochs, args.max_train_samples = 1, 1024
    return args


def load_train(prepared: str | Path, max_samples: int | None) -> TensorDataset:
    """The prepared train split as normalised float images and int64 labels."""
    meta = json.loads((Path(prepared) / "meta.json").read_text())
    data = torch.load(Path(prepared) / "train.pt", weights_only=True)
    images, labels = data["images"][:max_samples], data["labels"][:max_samples]
    mean = torch.tensor(meta["mean"]).view(1, -1, 1, 1)
    std = torch.tensor(meta["std"]).view(1, -1, 1, 1)
    return TensorDataset((images.float() / 255.0 - mean) / std, labels)


class SeedModule(L.LightningModule):
    def __init__(self, lr: float, sync_bn: bool) -> None:
        super().__init__()
        model = SeedCNN(1, 10, 32)
        self.model = convert_sync_batchnorm(model, torch.device("cpu")) if sync_bn else model
        self.lr = lr

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        images, labels = batch
        return F.cross_entropy(self.model(images), labels)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.lr)


class EpochTimer(L.Callback):
    """Training images/s per epoch, over all ranks, kept on every rank and printed on rank 0."""

    def __init__(self) -> None:
        self.epochs: list[dict[str, float]] = []
        self.t0, self.images = 0.0, 0

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.t0, self.images = time.perf_counter(), 0

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: object,
                           batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.images += len(batch[1])

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        total = trainer.strategy.reduce(torch.tensor(float(self.images)), reduce_op="sum")
        seconds = time.perf_counter() - self.t0
        rate = float(total) / seconds
        self.epochs.append({"epoch": trainer.current_epoch + 1, "images_per_s": rate, "seconds": seconds})
        if trainer.is_global_zero:
            print(f"epoch {trainer.current_epoch + 1}/{trainer.max_epochs}: {rate:.0f} images/s, "
                  f"{seconds:.1f} s", flush=True)


def report(args: argparse.Namespace, epochs: list[dict[str, float]]) -> None:
    result = {
        "bench": "lightning_loop", "lightning": L.__version__, "world_size": args.devices,
        "threads": torch.get_num_threads(), "batch_size_per_rank": args.batch_size,
        "precision": args.precision, "epochs": args.epochs, "prepared": str(args.prepared),
        "max_train_samples": args.max_train_samples, "sync_bn": not args.no_sync_bn, "quick": args.quick,
        "images_per_s": epochs[-1]["images_per_s"], "per_epoch": epochs,
    }
    print(markdown_table(["epoch", "images/s", "s"], [[e["epoch"], e["images_per_s"], e["seconds"]]
                                                      for e in epochs]))
    append_jsonl("lightning_loop", [result])
    write_json(args.json_out, result)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads or max(1, cores() // args.devices))
    loader = DataLoader(load_train(args.prepared, args.max_train_samples), batch_size=args.batch_size,
                        shuffle=True)
    module = SeedModule(1e-3 * math.sqrt(args.devices), sync_bn=not args.no_sync_bn)
    timer = EpochTimer()
    trainer = L.Trainer(
        accelerator="cpu", devices=args.devices, strategy="ddp" if args.devices > 1 else "auto",
        max_epochs=args.epochs, precision=args.precision, callbacks=[timer], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(module, loader)
    if trainer.is_global_zero:
        report(args, timer.epochs)


if __name__ == "__main__":
    main()
