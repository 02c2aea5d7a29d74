"""DVC's queue with ten experiments: `dvc queue start -j 2` on this host, until every one is back; then whether all ten
show in `dvc exp show`, and the wall time.

    python bench/dvc_queue.py [--experiments 10] [--jobs 2] [--samples 2048] [--epochs 1]

A clone of this checkout (its tracked and unignored files, a fresh git repo, this checkout's code) with the default
params but ``--samples`` training images, ``--epochs`` epochs and one thread per training, reproduced once; then
``--experiments`` experiments queued (``train.base_lr`` 0.001, 0.002, ...: the train stage and what follows it run
for each) and started ``--jobs`` at a time. Counts the experiments' refs every half second (git: milliseconds a look),
reads `dvc queue status` once at the end. Prints the machine and a Markdown table; appends to
bench/results/dvc_queue.jsonl.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

from common import append_jsonl, clone_checkout, markdown_table, print_machine, run_in_clone, temp_dir


def refs(clone: Path) -> list[str]:
    out, _ = run_in_clone(["git", "for-each-ref", "--format=%(refname)", "refs/exps"], clone)
    return [r for r in out.split() if re.match(r"refs/exps/[0-9a-f]{2}/", r)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--experiments", type=int, default=10)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--samples", type=int, default=2048)
    parser.add_argument("--epochs", type=int, default=1)
    args = parser.parse_args()
    print_machine()
    with temp_dir("queue") as scratch:
        clone = scratch / "repo"
        clone_checkout(clone, {"data.max_train_samples": args.samples, "num_epochs": args.epochs,
                               "train.progress_bar": False, "distributed.threads_per_process": 1}, "bench: queue")
        names = [f"q{i:02d}" for i in range(args.experiments)]
        for i, name in enumerate(names):
            run_in_clone(["dvc", "exp", "run", "--queue", "-n", name, "-S", f"train.base_lr={0.001 * (i + 1):g}"],
                         clone)
        t0 = time.time()
        run_in_clone(["dvc", "queue", "start", "-j", str(args.jobs)], clone)
        status = ""
        while True:
            if len(refs(clone)) >= args.experiments:
                break
            if time.time() - t0 > 60 * args.experiments and (status := run_in_clone(
                    ["dvc", "queue", "status"], clone)[0]) and "Running" not in status and "Queued" not in status:
                break  # the queue ended short
            time.sleep(0.5)
        wall = time.time() - t0
        status = run_in_clone(["dvc", "queue", "status"], clone)[0]
        run_in_clone(["dvc", "queue", "stop"], clone)
        shown = json.loads(run_in_clone(["dvc", "exp", "show", "--json"], clone)[0])
        # a baseline's experiments: ranges of revisions, each range and revision named (DVC's ExpRange, ExpState)
        listed = {name for base in shown for exp in (base.get("experiments") or [])
                  for name in (exp.get("name"), *(r.get("name") for r in exp.get("revs") or []))}
    seen = [n for n in names if n in listed]
    back, succeeded = len(seen), status.count("Success")
    print(f"{args.experiments} experiments ({args.samples} training images, {args.epochs} epoch(s), 1 thread each), "
          f"`dvc queue start -j {args.jobs}`\n")
    print(markdown_table(["experiments", "Success in `dvc queue status`", "in `dvc exp show`", "wall s",
                          "s per experiment"],
                         [[args.experiments, succeeded, back, f"{wall:.1f}", f"{wall / args.experiments:.1f}"]]))
    append_jsonl("dvc_queue", [{"experiments": args.experiments, "jobs": args.jobs, "samples": args.samples,
                            "epochs": args.epochs, "succeeded": succeeded, "shown": back, "wall_s": wall,
                            "shown_names": seen}])
    if back != args.experiments:
        raise SystemExit(f"only {back} of {args.experiments} experiments show in `dvc exp show`:\n{status}")


if __name__ == "__main__":
    main()
