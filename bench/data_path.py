"""The training data path alone (no model): batches per second into the first layer.

    python bench/data_path.py                       # every variant, full train split, batch 128
    python bench/data_path.py --variant reference   # one variant (bench/run_all.py section f)
    python bench/data_path.py --quick               # smoke run

Variants:
  ddpipe         data.TrainShards over the prepared train split, batches rebuilt per epoch as
                 Trainer.run_epoch does, then BatchTransform (seeded crop + flip, normalise,
                 channels_last) on the CPU
  ddpipe-noaug   the same without augmentation (normalise + channels_last only)
  reference      the seed loop's DataLoader (DistributedSampler for one replica, pin_memory=True)
                 over torchvision's FashionMNIST with per-sample ToTensor + Normalize
Each runs ``--epochs`` epochs with ``cores`` torch threads; the last epoch's images/s is reported.
Prints a Markdown table and appends to ``bench/results/data_path.jsonl``.
"""

from __future__ import annotations

import argparse
import time
import warnings
from collections.abc import Callable, Iterable

import torch
from common import REPO, append_jsonl, cores, fashion_mnist_root, markdown_table, write_json
from torch.utils.data import DataLoader, DistributedSampler, Subset

from ddpipe.data import BatchTransform, InMemoryDataset, TrainShards, load_meta

VARIANTS = ("ddpipe", "ddpipe-noaug", "reference")
warnings.filterwarnings("ignore", message=".*pin_memory.*")  # the reference's pin_memory on CPU


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variant", choices=(*VARIANTS, "all"), default="all")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--max-samples", type=int, default=None, help="first N samples (default: all)")
    p.add_argument("--prepared", default=str(REPO / "data" / "prepared"), help="a paths.prepared folder")
    p.add_argument("--quick", action="store_true", help="2 epochs over 2048 samples")
    p.add_argument("--json-out", default=None, help="also write the result as JSON here")
    args = p.parse_args(argv)
    if args.quick:
        args.epochs, args.max_samples = 2, 2048
    return args


def ddpipe_epochs(args: argparse.Namespace, augment: bool) -> Callable[[int], Iterable[torch.Tensor]]:
    """One epoch of ddpipe's data path per call, yielding the transformed batches."""
    meta = load_meta(args.prepared)
    data = InMemoryDataset.load(args.prepared, "train")
    if args.max_samples:
        data = InMemoryDataset(data.images[:args.max_samples], data.labels[:args.max_samples])
    shards = TrainShards(data, args.batch_size, 0, 1, 42, pin_memory=False)
    pad, flip = (2, True) if augment else (0, False)
    transform = BatchTransform(meta["mean"], meta["std"], pad, flip, 42, torch.device("cpu"), True)

    def epoch(e: int) -> Iterable[torch.Tensor]:
        for images, _labels, idx in shards.loader(e):
            yield transform(images, idx, e)

    return epoch


def reference_epochs(args: argparse.Namespace) -> Callable[[int], Iterable[torch.Tensor]]:
    from torchvision import datasets, transforms

    tf = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.2860,), (0.3530,))])
    train = datasets.FashionMNIST(fashion_mnist_root(), train=True, transform=tf, download=False)
    if args.max_samples:
        train = Subset(train, range(args.max_samples))
    sampler = DistributedSampler(train, num_replicas=1, rank=0)
    loader = DataLoader(train, batch_size=args.batch_size, sampler=sampler, pin_memory=True)

    def epoch(e: int) -> Iterable[torch.Tensor]:
        sampler.set_epoch(e)
        for images, _labels in loader:
            yield images

    return epoch


def measure(variant: str, args: argparse.Namespace) -> dict[str, float]:
    epoch = reference_epochs(args) if variant == "reference" else ddpipe_epochs(args, variant == "ddpipe")
    rates = []
    for e in range(args.epochs):
        n, t0 = 0, time.perf_counter()
        for x in epoch(e):
            n += len(x)
        rates.append(n / (time.perf_counter() - t0))
    return {"images_per_s": rates[-1], "images": float(n)}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(cores())
    chosen = VARIANTS if args.variant == "all" else (args.variant,)
    results = {v: measure(v, args) for v in chosen}
    print(markdown_table(["variant", "images/epoch", "images/s (last epoch)"],
                         [[v, int(r["images"]), r["images_per_s"]] for v, r in results.items()]))
    records = [{"bench": "data_path", "variant": v, "batch_size": args.batch_size, "epochs": args.epochs,
                "threads": torch.get_num_threads(), "quick": args.quick, **r} for v, r in results.items()]
    append_jsonl("data_path", records)
    write_json(args.json_out, {"results": records})


if __name__ == "__main__":
    main()
