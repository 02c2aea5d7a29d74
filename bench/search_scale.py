"""A study of 100 real trials, and what its DVC experiments cost `dvc exp show`: the wall seconds of each form of the
command at 0, 25, 50 and 100 experiments and after `ddpipe search remove --keep 10`; the seconds per
trial of the study itself; and MLflow's runs search over the study's runs (what the runs table in `mlflow ui` loads).

    python bench/search_scale.py [--clone /tmp/scale-clone] [--steps 25,50,100] [--keep 10] [--reps 3]

A clone of this checkout (its tracked and unignored files, a fresh git repo, this checkout's code: PYTHONPATH is the
clone's src/), its params shrunk so that a trial costs little (256 training images, 1 epoch, width 4, no model
logged), reproduced once and committed; then one study (`search.jobs=2`, no pruner, `train.base_lr` searched) run
with `ddpipe search run search.trials=25`, then 50, then 100: the same study continued, each run timed.
Each `dvc exp show` form runs ``--reps`` times after each step (the median; the first run of the default form is
the first look after the step, its exp cache not yet filled). The clone is kept (its mlflow.db for `mlflow ui`);
given an existing clone, the script continues its study. Prints the machine and Markdown tables; appends to
bench/results/search_scale.jsonl.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import re
import statistics
import time
import urllib.request
from pathlib import Path

from common import (
    REPO,
    append_jsonl,
    clone_checkout,
    clone_env,
    markdown_table,
    mlflow_server,
    print_machine,
    run_in_clone,
)

STUDY = "scale"
CHEAP = {"data.max_train_samples": 256, "num_epochs": 1, "model.width": 4, "train.batch_size_per_rank": 64,
         "model.eval_flips": False, "mlflow.log_model": False, "train.progress_bar": False, "search.study": STUDY,
         "search.jobs": 2, "search.pruner": "none", "search.space": {"train.base_lr": "loguniform(1e-4, 1e-1)"}}
# `dvc exp show` as users type it, and what DVC offers to make it quicker (`dvc exp show --help`); --num 1 and
# --rev HEAD are its defaults, written out; -f collects every experiment again instead of reading DVC's exp cache.
FORMS = {"default": [], "--num 1 --rev HEAD": ["--num", "1", "--rev", "HEAD"], "--only-changed": ["--only-changed"],
         "--csv": ["--csv"], "--json": ["--json"], "--keep 'base_lr|accuracy'": ["--drop", ".*", "--keep",
                                                                               "base_lr|accuracy"],
         "-f (no exp cache)": ["-f"]}


def sh(cmd: list[str], clone: Path) -> tuple[str, float]:
    return run_in_clone(cmd, clone)


def make_clone(dest: Path) -> None:
    clone_checkout(dest, CHEAP, "bench: a cheap trial")


def experiments(clone: Path) -> int:
    refs = sh(["git", "for-each-ref", "--format=%(refname)", "refs/exps"], clone)[0].split()
    return sum(1 for r in refs if re.match(r"refs/exps/[0-9a-f]{2}/", r))


def shown_rows(clone: Path) -> int:
    """The experiments `dvc exp show --csv` lists (rows of type branch_base or branch_commit: not the baseline's)."""
    rows = list(csv.DictReader(io.StringIO(sh(["dvc", "exp", "show", "--no-pager", "--csv"], clone)[0])))
    return sum(1 for row in rows if row["typ"].startswith("branch_"))


def show_times(clone: Path, reps: int) -> dict[str, list[float]]:
    """Wall seconds of each form of `dvc exp show --no-pager`, ``reps`` times each, forms interleaved."""
    times: dict[str, list[float]] = {form: [] for form in FORMS}
    for _ in range(reps):
        for form, extra in FORMS.items():
            times[form].append(sh(["dvc", "exp", "show", "--no-pager", *extra], clone)[1])
    return times


def runs_search(clone: Path, reps: int) -> tuple[int, list[float]]:
    """`mlflow server` on the clone's mlflow.db; the runs of experiment `ddpipe` (POST runs/search, max_results 1000,
    what the runs table of `mlflow ui` asks for), 1 + ``reps`` times: (runs returned, wall seconds of each; the first
    is the server's first search, its workers still starting beside it)."""
    with mlflow_server(f"sqlite:///{clone / 'mlflow.db'}", cwd=clone, env=clone_env(clone), wait_s=240) as base:
        with urllib.request.urlopen(f"{base}/api/2.0/mlflow/experiments/get-by-name?experiment_name=ddpipe") as r:
            experiment = json.load(r)["experiment"]["experiment_id"]
        body = json.dumps({"experiment_ids": [experiment], "max_results": 1000}).encode()
        count, seconds = 0, []
        for _ in range(1 + reps):
            request = urllib.request.Request(f"{base}/api/2.0/mlflow/runs/search", body,
                                             {"Content-Type": "application/json"})
            t0 = time.perf_counter()
            with urllib.request.urlopen(request, timeout=120) as r:
                count = len(json.load(r).get("runs", []))
            seconds.append(time.perf_counter() - t0)
        return count, seconds


def shown(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clone", type=Path, default=Path("/tmp/scale-clone"))
    parser.add_argument("--steps", default="25,50,100", help="trials the study holds at each measurement")
    parser.add_argument("--keep", type=int, default=10)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--runs-search-only", action="store_true", help="only MLflow's runs search, in a clone made "
                        "by an earlier run")
    args = parser.parse_args()
    print_machine()
    clone = args.clone.resolve()
    if args.runs_search_only:
        count, api = runs_search(clone, args.reps)
        print(f"MLflow runs/search (max_results 1000): {count} runs; first {api[0]:.2f} s, then {shown(api[1:])} s")
        append_jsonl("search_scale", [{"point": "mlflow runs/search", "runs": count, "seconds": api}])
        return
    if not (clone / ".git").is_dir():
        clone.mkdir(parents=True)
        t0 = time.perf_counter()
        make_clone(clone)
        print(f"clone {clone} made and reproduced in {time.perf_counter() - t0:.0f} s", flush=True)
    records, study_rows = [], []

    def measure(label: str) -> None:
        times = show_times(clone, args.reps)
        count = experiments(clone)
        record = {"point": label, "experiments": count, "rows_shown": shown_rows(clone), "exp_show_s": times}
        records.append(record)
        print(f"{label}: {count} experiments; dvc exp show (default) {shown(times['default'])} s", flush=True)

    measure("after dvc repro")
    before = 0
    for step in (int(s) for s in args.steps.split(",")):
        out, seconds = sh(["python", "-m", "ddpipe.search", "run", f"search.trials={step}"], clone)
        states = re.search(r"search \S+ \(\w+\): (.*)", out)
        new = step - before
        study_rows.append([f"`ddpipe search run search.trials={step}`", new, f"{seconds:.0f}",
                           f"{seconds / max(new, 1):.1f}", states[1] if states else "?"])
        records.append({"point": f"study run to {step}", "new_trials": new, "seconds": seconds,
                        "states": states[1] if states else None})
        print(f"study run to {step} trials: {seconds:.0f} s ({states[1] if states else '?'})", flush=True)
        before = step
        measure(f"{step} trials")
    out, seconds = sh(["python", "-m", "ddpipe.search", "remove", "--keep", str(args.keep)], clone)
    records.append({"point": f"remove --keep {args.keep}", "seconds": seconds, "said": out})
    print(out + f"remove --keep {args.keep}: {seconds:.1f} s", flush=True)
    measure(f"after remove --keep {args.keep}")
    count, api = runs_search(clone, args.reps)
    records.append({"point": "mlflow runs/search", "runs": count, "seconds": api})

    print(f"\nthe study, {STUDY}, {CHEAP['search.jobs']} trials at once:\n")
    print(markdown_table(["command", "new trials", "wall s", "s per trial", "the study after it"], study_rows))
    points = [r for r in records if "exp_show_s" in r]
    print("\n`dvc exp show --no-pager` + form, wall s: median (min-max) of "
          f"{args.reps}; first look after each step: the default's first run\n")
    rows = [[f"`{form}`".replace("|", "\\|"), *(shown(r["exp_show_s"][form]) for r in points)] for form in FORMS]
    rows += [["first run of the default", *(f"{r['exp_show_s']['default'][0]:.2f}" for r in points)],
             ["experiments listed (--csv rows)", *(str(r["rows_shown"]) for r in points)]]
    print(markdown_table(["form", *(f"{r['point']} ({r['experiments']} exps)" for r in points)], rows))
    print(f"\n`ddpipe search remove --keep {args.keep}`: {seconds:.1f} s; MLflow runs/search "
          f"(max_results 1000): {count} runs; first {api[0]:.2f} s, then {shown(api[1:])} s")
    append_jsonl("search_scale", records)


if __name__ == "__main__":
    os.chdir(REPO)
    main()
