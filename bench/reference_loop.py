"""The seed documents' training loop, written as they describe it: the benchmarks' reference.

    torchrun --standalone --nproc-per-node=2 bench/reference_loop.py --epochs 5           # accuracy
    torchrun --standalone --nproc-per-node=W bench/reference_loop.py --max-train-samples 12800 --epochs 2
    torchrun --standalone --nproc-per-node=1 bench/reference_loop.py --quick               # smoke run

torchvision's FashionMNIST with per-sample ``ToTensor`` + ``Normalize``, a ``DataLoader`` over a
``DistributedSampler`` (``pin_memory=True``), ddpipe's ``SeedCNN(1, 10, 32)`` with synchronised
BatchNorm wrapped in DDP, Adam at 1e-3 x sqrt(world size), fp32, ``cores // world size`` threads per
process. Rank 0 prints each epoch's training images/s (the training loop only: data loading, forward,
backward, step), then the test accuracy on the official test split and the wall seconds since the
process started; it prints a Markdown table and appends the run to
``bench/results/reference_loop.jsonl``. The data come from Debian's Fashion-MNIST files (or
data/raw), extracted once into ``bench/results/torchvision``.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
import warnings
from pathlib import Path

_STARTED = time.perf_counter()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from common import append_jsonl, cores, fashion_mnist_root, markdown_table, write_json  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler, Subset  # noqa: E402
from torchvision import datasets, transforms  # noqa: E402

from ddpipe.distributed import convert_sync_batchnorm  # noqa: E402
from ddpipe.models import SeedCNN  # noqa: E402

# pin_memory=True is what the seed documents use; on a CPU-only machine torch ignores it, with a
# warning at every epoch's iterator.
warnings.filterwarnings("ignore", message=".*pin_memory.*")


def process_seconds() -> float:
    """Seconds since this process started (from /proc: interpreter start-up and imports count)."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        start_ticks = int(fields[19])  # field 22 (starttime); fields[0] is field 3
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.perf_counter() - _STARTED


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
    torch.set_num_threads(threads or max(1, cores() // world))
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


def report(args: argparse.Namespace, world: int, epochs: list[dict], acc: float, wall: float) -> None:
    """Rank 0: Markdown tables, the JSONL record, and the optional JSON for a parent process."""
    print(markdown_table(["epoch", "train loss", "images/s", "s"],
                         [[e["epoch"], e["train_loss"], e["images_per_s"], e["seconds"]] for e in epochs]))
    result = {
        "bench": "reference_loop", "world_size": world, "threads": torch.get_num_threads(),
        "batch_size_per_rank": args.batch_size, "epochs": args.epochs,
        "max_train_samples": args.max_train_samples, "max_test_samples": args.max_test_samples,
        "quick": args.quick,
        "images_per_s": epochs[-1]["images_per_s"], "test_accuracy": acc, "wall_s": wall,
        "per_epoch": epochs,
    }
    print()
    print(markdown_table(["world size", "threads/process", "batch/rank", "epochs", "last epoch images/s",
                          "test accuracy", "wall s (from process start)"],
                         [[world, result["threads"], args.batch_size, args.epochs, result["images_per_s"],
                           acc, wall]]))
    append_jsonl("reference_loop", [result])
    write_json(args.json_out, result)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rank, world, device = setup(args.threads)
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
        report(args, world, epochs, acc, process_seconds())
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
