"""torch.profiler over ddpipe's training step: where a step's CPU time goes, by op.

    python bench/profile_step.py                                  # params.yaml's model, ~20 steps
    python bench/profile_step.py model.name=seed_cnn model.width=32 train.batch_size_per_rank=128
    python bench/profile_step.py --quick                          # smoke run

The pieces are built as training.Trainer builds them (one process, no DDP; Trainer itself also
loads the validation split, a tracker and checkpoints): the model from params.yaml (plus any
``key=value`` overrides) in channels_last and the precision ``training.resolve_precision`` picks
(bf16 autocast where the CPU has AVX512-BF16/AMX), BatchTransform with augmentation, AdamW with the
Trainer's settings, batches from ``data.TrainShards``. After ``--warmup`` steps, ``--steps`` steps run
under the profiler, each phase labelled (data+transform, forward, backward, optimizer). Prints the
step time and the top ops by self CPU time as Markdown; appends to bench/results/profile_step.jsonl.
"""

from __future__ import annotations

import argparse
import contextlib
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F
from common import REPO, append_jsonl, cores, markdown_table
from torch.profiler import ProfilerActivity, profile, record_function

from ddpipe.config import Config, load_config
from ddpipe.data import BatchTransform, InMemoryDataset, TrainShards, load_meta
from ddpipe.models import build_model
from ddpipe.training import resolve_precision, use_channels_last


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("overrides", nargs="*", help="key=value, as on a stage's command line")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="default: all cores")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--quick", action="store_true", help="3 profiled steps after 1 warm-up at batch 64")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.warmup = 3, 1
        args.overrides = ["train.batch_size_per_rank=64", *args.overrides]
    return args


class Step:
    """One training step of ddpipe's loop, with the Trainer's model, transform and optimizer."""

    def __init__(self, cfg: Config, device: torch.device) -> None:
        tc = cfg.train
        self.cfg, self.device = cfg, device
        self.precision = resolve_precision(tc.precision, device)
        self.channels_last = use_channels_last(tc.channels_last, device, self.precision)
        meta = load_meta(cfg.paths.prepared)
        self.data = InMemoryDataset.load(cfg.paths.prepared, "train")
        self.transform = BatchTransform(meta["mean"], meta["std"], tc.random_crop_padding, tc.hflip,
                                        cfg.seed, device, self.channels_last)
        torch.manual_seed(cfg.seed)
        model = build_model(cfg.model, meta["num_channels"], len(meta["classes"])).to(device)
        self.model = model.to(memory_format=torch.channels_last) if self.channels_last else model
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=tc.base_lr,
                                           betas=(tc.momentum, 0.999), weight_decay=tc.weight_decay)
        self.batches = TrainShards(self.data, tc.batch_size_per_rank, 0, 1, cfg.seed, False).batches(0)

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.precision == "fp32":
            return contextlib.nullcontext()
        dtype = torch.bfloat16 if self.precision == "bf16" else torch.float16
        return torch.autocast(self.device.type, dtype=dtype)

    def __call__(self, i: int) -> None:
        with record_function("data+transform"):
            images, labels, idx = self.data.__getitems__(self.batches[i % len(self.batches)])
            x = self.transform(images.to(self.device), idx, 0)
            labels = labels.to(self.device)
        with record_function("forward"), self.autocast():
            loss = F.cross_entropy(self.model(x), labels, label_smoothing=self.cfg.train.label_smoothing)
        with record_function("backward"):
            loss.backward()
        with record_function("optimizer"):
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)


def top_ops(prof: profile, n: int) -> list[dict[str, float | str | int]]:
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events) or 1.0
    return [{"op": e.key, "self_cpu_ms": e.self_cpu_time_total / 1e3,
             "self_cpu_pct": 100 * e.self_cpu_time_total / total, "cpu_total_ms": e.cpu_time_total / 1e3,
             "calls": e.count} for e in events[:n]]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads or cores())
    cfg = load_config(args.overrides, params_file=REPO / "params.yaml")
    if not Path(cfg.paths.prepared).is_absolute():
        cfg.paths.prepared = str(REPO / cfg.paths.prepared)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    step = Step(cfg, device)
    for i in range(args.warmup):
        step(i)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        for i in range(args.warmup, args.warmup + args.steps):
            step(i)
    seconds = time.perf_counter() - t0
    batch = cfg.train.batch_size_per_rank
    ops = top_ops(prof, args.top)
    print(f"{cfg.model.name} width {cfg.model.width}, batch {batch}, precision {step.precision}, "
          f"channels_last {step.channels_last}, {torch.get_num_threads()} threads: "
          f"{1e3 * seconds / args.steps:.1f} ms/step, {batch * args.steps / seconds:.0f} images/s "
          "(under the profiler)\n")
    print(markdown_table(["op", "self CPU ms", "self CPU %", "CPU total ms", "calls"],
                         [[o["op"], o["self_cpu_ms"], o["self_cpu_pct"], o["cpu_total_ms"], o["calls"]]
                          for o in ops]))
    append_jsonl("profile_step", [{
        "bench": "profile_step", "model": asdict(cfg.model), "batch_size": batch, "precision": step.precision,
        "channels_last": step.channels_last, "threads": torch.get_num_threads(), "steps": args.steps,
        "quick": args.quick, "ms_per_step": 1e3 * seconds / args.steps, "images_per_s": batch * args.steps / seconds,
        "top_ops": ops}])


if __name__ == "__main__":
    main()
