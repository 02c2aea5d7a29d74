"""torch.profiler over ddpipe's training step: where a step's CPU time goes, by op.

    python bench/profile_step.py                                  # params.yaml's model, 20 steps
    python bench/profile_step.py model.name=seed_cnn model.width=32 train.batch_size_per_rank=128
    python bench/profile_step.py --quick paths.prepared=/a/small/prepared   # smoke run

The step is ``Trainer.train_step`` of a ``Trainer`` built from params.yaml (plus any ``key=value``
overrides) for one plain process (no DDP; threads: ``distributed.threads_per_process``, default all
cores): the model, precision, memory format, transform, optimizer and schedule the training uses, over
the batches ``trainer.data.train_batches`` serves. After ``--warmup`` steps, ``--steps`` steps run under the
profiler, with the batch gathering and the transform labelled. Prints the machine, the step time and
the top ops by self CPU time as Markdown; appends to bench/results/profile_step.jsonl.
"""

from __future__ import annotations

import argparse
import itertools
import time
from collections.abc import Iterator
from dataclasses import asdict

import torch
from common import REPO, append_jsonl, config, markdown_table, print_machine
from torch.profiler import ProfilerActivity, profile, record_function

from ddpipe.distributed.group import init_distributed
from ddpipe.engine.loop import Trainer
from ddpipe.engine.meters import EpochMeter, EpochProgress
from ddpipe.engine.parts import build_parts
from ddpipe.engine.resolved import resolve
from ddpipe.launch.torchrun import this_device

LABELS = ("data: gather", "data: transform", "train_step")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("overrides", nargs="*", help="key=value, as on a stage's command line")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--quick", action="store_true", help="3 profiled steps after 1 warm-up at batch 64")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.warmup = 3, 1
        args.overrides = ["train.batch_size_per_rank=64", *args.overrides]
    return args


def micro_batches(trainer: Trainer) -> Iterator[tuple[int, list[tuple]]]:
    """(epoch, one optimizer step's micro-batches), epoch after epoch, as ``Trainer.train_epoch`` takes them."""
    accum = trainer.cfg.train.grad_accum_steps
    for epoch in itertools.count():
        batches = iter(trainer.data.train_batches(epoch, 0, trainer.steps_per_epoch * accum))
        for _ in range(trainer.steps_per_epoch):
            with record_function("data: gather"):
                step = [next(batches) for _ in range(accum)]
            yield epoch, step


def label_transform(trainer: Trainer) -> None:
    """Time the transform apart: ``train_step`` calls it inside, with no hook for a label."""
    transform = trainer.data.transform

    def labelled(*args: object) -> torch.Tensor:
        with record_function("data: transform"):
            return transform(*args)

    trainer.data.transform = labelled


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    print_machine()
    cfg = config(args.overrides)
    cfg.paths.prepared = str(REPO / cfg.paths.prepared)  # an absolute path stays as it is
    run = resolve(cfg, this_device())
    info = init_distributed(cfg.distributed, run.backend)  # one plain process: its device, its threads
    trainer = Trainer(build_parts(run, info))
    label_transform(trainer)
    steps, meter = micro_batches(trainer), EpochMeter(trainer.device, EpochProgress())
    trainer.model.train()
    for n, (epoch, step) in enumerate(itertools.islice(steps, args.warmup), start=1):
        trainer.train_step(step, epoch, n, meter)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if trainer.device.type == "cuda" else [])
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        for n, (epoch, step) in enumerate(itertools.islice(steps, args.steps), start=args.warmup + 1):
            with record_function("train_step"):
                trainer.train_step(step, epoch, n, meter)
    report(args, trainer, prof, 1e3 * (time.perf_counter() - t0) / args.steps)


def report(args: argparse.Namespace, trainer: Trainer, prof: profile, step_ms: float) -> None:
    """Wall ms per step (data included), the labelled phases' CPU ms per step, the top ops."""
    events = {e.key: e for e in prof.key_averages()}
    batch = trainer.run.global_batch_size(trainer.info.world_size)
    ranked = sorted((e for e in events.values() if e.key not in LABELS), key=lambda e: e.self_cpu_time_total,
                    reverse=True)
    total = sum(e.self_cpu_time_total for e in ranked) or 1.0
    ops = [{"op": e.key, "self_cpu_ms": e.self_cpu_time_total / 1e3,
            "self_cpu_pct": 100 * e.self_cpu_time_total / total,
            "cpu_total_ms": e.cpu_time_total / 1e3, "calls": e.count} for e in ranked[:args.top]]
    phases = {label: events[label].cpu_time_total / 1e3 / args.steps for label in LABELS if label in events}
    cfg, compute, model = trainer.cfg, trainer.compute, trainer.run.model
    print(f"{model.name} width {model.width}, batch {batch}, precision {compute.precision}, channels_last "
          f"{compute.channels_last}, {torch.get_num_threads()} threads: {step_ms:.1f} ms/step, "
          f"{1e3 * batch / step_ms:.0f} images/s (under the profiler); per step: "
          + ", ".join(f"{label} {ms:.1f} ms" for label, ms in phases.items()) + "\n")
    print(markdown_table(["op", "self CPU ms", "self CPU %", "CPU total ms", "calls"],
                         [list(o.values()) for o in ops]))
    append_jsonl("profile_step", [{
        "bench": "profile_step", "model": asdict(model), "batch_size": batch, "precision": compute.precision,
        "channels_last": compute.channels_last, "threads": torch.get_num_threads(), "steps": args.steps,
        "quick": args.quick, "ms_per_step": step_ms, "phases_ms": phases, "prepared": cfg.paths.prepared,
        "top_ops": ops}])


if __name__ == "__main__":
    main()
