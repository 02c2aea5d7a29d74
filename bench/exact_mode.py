"""Cost of world-size-exact mode (``distributed.exact``): one forward and backward pass of the default
model, ordinary vs exact, one process, all cores.

    python bench/exact_mode.py [--batch 256] [--steps 10] [--reps 3]
    python bench/exact_mode.py --quick                       # smoke run

The network is built as training builds it (``ddpipe.engine.assembly.build_network`` from params.yaml with
``distributed.exact`` off or on, channels_last and autocast as ``ddpipe.engine.resolved.resolve`` chooses them),
fed random images of Fashion-MNIST's shape (the cost does not depend on the pixels). Prints the machine and a
Markdown table of the median milliseconds per step (min-max over ``--reps``, interleaved); appends the
figures to ``bench/results/exact_mode.jsonl``.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from common import append_jsonl, config, markdown_table, print_machine, summary

from ddpipe.core.ranks import DistInfo
from ddpipe.data.store import Prepared
from ddpipe.engine.assembly import build_network
from ddpipe.engine.resolved import resolve

FASHION_SHAPE = Prepared("random", [str(c) for c in range(10)], 1, "raw", [28, 28], None, [0.0], [1.0], {})


def step_ms(exact: bool, precision: str, batch: int, steps: int) -> float:
    info = DistInfo()
    overrides = [f"distributed.exact={str(exact).lower()}", f"train.precision={precision}"]
    run = resolve(config(overrides), info.device, FASHION_SHAPE)  # auto as for these images on this device
    cfg, compute = run.cfg, run.compute_on(info.device)
    torch.manual_seed(0)
    model = compute.place(build_network(run, info).module)
    x = torch.randn(batch, 1, 28, 28)
    x = x.contiguous(memory_format=torch.channels_last) if compute.channels_last else x
    y = torch.randint(0, 10, (batch,))

    def one() -> None:
        with compute.autocast():
            loss = F.cross_entropy(model(x), y, label_smoothing=cfg.train.label_smoothing)
        loss.backward()
        model.zero_grad(set_to_none=True)

    for _ in range(2):
        one()
    start = time.perf_counter()
    for _ in range(steps):
        one()
    return (time.perf_counter() - start) / steps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="batch 32, 2 steps, 1 repetition")
    args = parser.parse_args()
    if args.quick:
        args.batch, args.steps, args.reps = 32, 2, 1
    print_machine()
    rows, records = [], []
    for precision in ("bf16", "fp32"):
        times: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(args.reps):  # interleaved
            for exact in (False, True):
                times[exact].append(step_ms(exact, precision, args.batch, args.steps))
        plain, exact = summary(times[False]), summary(times[True])
        rows.append([precision, f"{plain[0]:.1f} ({plain[1]:.1f}-{plain[2]:.1f})",
                     f"{exact[0]:.1f} ({exact[1]:.1f}-{exact[2]:.1f})", f"{exact[0] / plain[0]:.2f}x"])
        records.append({"precision": precision, "batch": args.batch, "threads": torch.get_num_threads(),
                        "quick": args.quick, "plain_ms": times[False], "exact_ms": times[True]})
    append_jsonl("exact_mode", records)
    print(markdown_table(["precision", "ordinary ms/step (min-max)", "exact ms/step (min-max)", "ratio"], rows))


if __name__ == "__main__":
    main()
