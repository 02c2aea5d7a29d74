"""Cost of world-size-exact mode (``distributed.exact``): one training step (forward, backward) of the
default model, ordinary layers vs ``ddpipe.exact.make_exact``, one process, all cores.

    python bench/exact_mode.py [--batch 256] [--steps 10] [--reps 3]

Random images of the prepared data's shape (the cost does not depend on the pixels). Prints a Markdown
table of the median milliseconds per step (min-max over ``--reps``) and appends the figures to
``bench/results/exact_mode.jsonl``.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from common import append_jsonl, markdown_table, summary

from ddpipe.config import load_config
from ddpipe.exact import make_exact
from ddpipe.models import build_model


def step_ms(exact: bool, precision: str, batch: int, steps: int) -> float:
    cfg = load_config([])
    torch.manual_seed(0)
    model = build_model(cfg.model, 1, 10)
    model = (make_exact(model) if exact else model).to(memory_format=torch.channels_last)
    x = torch.randn(batch, 1, 28, 28).contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (batch,))

    def one() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = F.cross_entropy(model(x), y, label_smoothing=0.1)
        loss.backward()
        model.zero_grad(set_to_none=True)

    for _ in range(2):
        one()
    start = time.perf_counter()
    for _ in range(steps):
        one()
    return (time.perf_counter() - start) / steps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    rows, records = [], []
    for precision in ("bf16", "fp32"):
        times = {exact: [] for exact in (False, True)}
        for _ in range(args.reps):  # interleaved
            for exact in (False, True):
                times[exact].append(step_ms(exact, precision, args.batch, args.steps))
        plain, exact = summary(times[False]), summary(times[True])
        rows.append([precision, f"{plain[0]:.1f} ({plain[1]:.1f}-{plain[2]:.1f})",
                     f"{exact[0]:.1f} ({exact[1]:.1f}-{exact[2]:.1f})", f"{exact[0] / plain[0]:.2f}x"])
        records.append({"precision": precision, "batch": args.batch, "threads": torch.get_num_threads(),
                        "plain_ms": times[False], "exact_ms": times[True]})
    append_jsonl("exact_mode", records)
    print(markdown_table(["precision", "ordinary ms/step (min-max)", "exact ms/step (min-max)", "ratio"], rows))


if __name__ == "__main__":
    main()
