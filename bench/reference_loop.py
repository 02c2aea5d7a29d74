"""The plain DDP training loop of the PyTorch tutorials (per-sample transforms, DataLoader + DistributedSampler,
DDP), written as they describe it: the benchmarks' reference.

    torchrun --standalone --nproc-per-node=2 bench/reference_loop.py --epochs 5           # accuracy
    torchrun --standalone --nproc-per-node=W bench/reference_loop.py --max-train-samples 12800 --epochs 2
    torchrun --standalone --nproc-per-node=1 bench/reference_loop.py --quick               # smoke run

torchvision's FashionMNIST with per-sample ``ToTensor`` + ``Normalize``, a ``DataLoader`` over a
``DistributedSampler`` (``pin_memory=True``), ddpipe's ``SeedCNN(1, 10, 32)`` with synchronised
BatchNorm wrapped in DDP, Adam at 1e-3 x sqrt(world size), fp32, ``cores // world size`` threads per
process. Rank 0 prints the machine (CPU model and flags), each epoch's training images/s (the
training loop only: data loading, forward, backward, step), then the test accuracy on the official
test split, as a Markdown table; the run is appended to ``bench/results/reference_loop.jsonl``. The
data come from Debian's Fashion-MNIST files (or data/raw), extracted once into bench/results/torchvision.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from common import append_jsonl, fashion_mnist_root, markdown_table, print_machine, write_json
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset
from torchvision import datasets, transforms

from ddpipe.core.devices import cpu_count
from ddpipe.distributed.batchnorm import convert_sync_batchnorm
from ddpipe.models.nets import SeedCNN

# pin_memory=True is what the DDP tutorials use; on a CPU-only machine torch ignores it, with a
# warning at every epoch's iterator.
warnings.filterwarnings("ignore", message=".*pin_memory.*")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=128, help="per rank")
    p.add_argument("--max-train-samples", type=int, default=None, help="take the first N (throughput)")
    p.add_argument("--max-test-samples", type=int, default=None, help="take the first N of the test split")
    p.add_argument("--threads", type=int, default=None, help="per process (default: cores // world size)")
    p.add_argument("--data-root", default=None, help="torchvision root (default: bench/results/torchvision)")
    p.add_argument("--quick", action="store_true", help="1 epoch, 1024 train and 1000 test samples")
    p.add_argument("--json-out", default=None, help="also write rank 0's result as JSON here")
    args = p.parse_args(argv)
    if args.quick:
        args.epochs, args.max_train_samples, args.max_test_samples = 1, 1024, 1000
    return args


def setup(threads: int | None) -> tuple[int, int, torch.device]:
    """Join the process group (gloo on CPU, nccl on CUDA); (rank, world size, device)."""
    if "RANK" not in os.environ:
        sys.exit("launch with torchrun: torchrun --standalone --nproc-per-node=W bench/reference_loop.py")
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if cuda:
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    torch.set_num_threads(threads or max(1, cpu_count() // world))
    return rank, world, device


def load_splits(root: Path, max_train: int | None, max_test: int | None) -> tuple:
    tf = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.2860,), (0.3530,))])
    train = datasets.FashionMNIST(root, train=True, transform=tf, download=False)
    test = datasets.FashionMNIST(root, train=False, transform=tf, download=False)
    if max_train is not None:
        train = Subset(train, range(min(max_train, len(train))))
    if max_test is not None:
        test = Subset(test, range(min(max_test, len(test))))
    return train, test


def build_model(device: torch.device) -> nn.Module:
    model = SeedCNN(1, 10, 32)
    if device.type == "cuda":
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    else:
        # torch's SyncBatchNorm raises on CPU tensors; ddpipe's CPUSyncBatchNorm computes the same
        # statistics over all ranks with gloo (plain BatchNorm at world size 1).
        model = convert_sync_batchnorm(model, device)
    model = model.to(device)
    return DDP(model, device_ids=[device.index] if device.type == "cuda" else None)


def train_epoch(model: nn.Module, loader: DataLoader, optimizer: torch.optim.Optimizer,
                device: torch.device) -> tuple[float, float, float]:
    """(global images, seconds, mean train loss) of one epoch; the time ends once every rank is done."""
    model.train()
    loss_fn = nn.CrossEntropyLoss()
    sums = torch.zeros(2, dtype=torch.float64, device=device)  # loss sum, images
    t0 = time.perf_counter()
    for images, labels in loader:
        images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        optimizer.zero_grad()
        loss = loss_fn(model(images), labels)
        loss.backward()
        optimizer.step()
        sums += torch.stack([loss.detach().double() * len(labels),
                             torch.tensor(float(len(labels)), dtype=torch.float64, device=device)])
    dist.all_reduce(sums)
    seconds = time.perf_counter() - t0
    return sums[1].item(), seconds, (sums[0] / sums[1]).item()


@torch.no_grad()
def test_accuracy(module: nn.Module, test: torch.utils.data.Dataset, device: torch.device) -> float:
    module.eval()
    correct = total = 0
    for images, labels in DataLoader(test, batch_size=1000, pin_memory=True):
        preds = module(images.to(device)).argmax(1).cpu()
        correct += int((preds == labels).sum())
        total += len(labels)
    return correct / total


def report(args: argparse.Namespace, world: int, epochs: list[dict], acc: float) -> None:
    """Rank 0: a Markdown table, the JSONL record, and the optional JSON for a parent process."""
    result = {
        "bench": "reference_loop", "world_size": world, "threads": torch.get_num_threads(),
        "batch_size_per_rank": args.batch_size, "epochs": args.epochs,
        "max_train_samples": args.max_train_samples, "max_test_samples": args.max_test_samples,
        "quick": args.quick,
        "images_per_s": epochs[-1]["images_per_s"], "test_accuracy": acc, "per_epoch": epochs,
    }
    print(markdown_table(["world size", "threads/process", "batch/rank", "epochs", "last epoch images/s",
                          "test accuracy"],
                         [[world, result["threads"], args.batch_size, args.epochs, result["images_per_s"], acc]]))
    append_jsonl("reference_loop", [result])
    write_json(args.json_out, result)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rank, world, device = setup(args.threads)
    if rank == 0:
        print_machine()
    root = fashion_mnist_root(args.data_root) if args.data_root else fashion_mnist_root()
    train, test = load_splits(root, args.max_train_samples, args.max_test_samples)
    sampler = DistributedSampler(train)
    loader = DataLoader(train, batch_size=args.batch_size, sampler=sampler, pin_memory=True)
    model = build_model(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3 * math.sqrt(world))
    epochs = []
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        images, seconds, loss = train_epoch(model, loader, optimizer, device)
        epochs.append({"epoch": epoch + 1, "train_loss": loss, "images_per_s": images / seconds,
                       "seconds": seconds})
        if rank == 0:
            print(f"epoch {epoch + 1}/{args.epochs}: train loss {loss:.4f} | "
                  f"{images / seconds:.0f} images/s, {seconds:.1f} s", flush=True)
    if rank == 0:
        acc = test_accuracy(model.module, test, device)
        report(args, world, epochs, acc)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
