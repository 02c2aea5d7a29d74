"""Every comparison of ddpipe against the seed documents' reference loop, repetitions interleaved.

    python bench/run_all.py                       # all sections, 3 repetitions (make bench)
    python bench/run_all.py --only a --reps 5     # one section (a-f), or several: --only a,c
    python bench/run_all.py --quick               # tiny settings, 1 repetition (per section ~30-60 s)

Sections:
  a  loop throughput (images/s, last epoch) at world sizes 1 and 2 on 12,800 training samples,
     SeedCNN width 32, batch 128 per rank, 2 epochs: ddpipe (defaults: precision auto, channels_last
     auto), ddpipe fp32 without channels_last, the reference loop, Lightning (fp32)
  b  time to accuracy: dvc.yaml's train and evaluate commands in a temporary copy of the repo with
     params.yaml's defaults (wall seconds, test accuracy) next to the reference loop, 2 processes,
     5 epochs
  c  DDP overhead, ddpipe defaults on 12,800 samples, global batch 256: 2 processes x cores/2
     threads (with and without SyncBatchNorm) vs 1 process x all cores under torchrun vs plain
     `python stages/train.py` (no process group, no DDP)
  d  start-up: `import torch`, `import ddpipe.training`, the train stage on 256 samples for one epoch
     (python, python without log_model, torchrun), and a no-op `dvc repro` in a completed temp copy
  e  tracking overhead: bench/tracking_overhead.py's calls as shares of a default epoch (from
     section b's run when it ran in this invocation, else one measured epoch on 12,800 samples
     scaled to the full split)
  f  data path alone: bench/data_path.py (ddpipe's loader + BatchTransform vs the reference's
     per-sample transforms), full train split, batch 128

For each repetition every variant of a section runs once, in turn; the tables give median, min and
max per variant and metric, and the ratio of medians to the section's baseline (the reference loop;
plain python in c). Every ddpipe run writes all its outputs (paths.*, the MLflow store) under
bench/results/tmp, so the repository's outputs are untouched. Results are printed as Markdown and
appended to bench/results/run_all.jsonl; the scripts it runs append to their own files too.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import re
import shutil
import subprocess
import sys
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from common import (
    REPO,
    BenchError,
    append_jsonl,
    clean_env,
    cores,
    ensure_prepared,
    markdown_table,
    remove,
    run_timed,
    summary,
    temp_dir,
    torchrun,
)
from omegaconf import OmegaConf

PY = sys.executable
BENCH = REPO / "bench"
Metrics = dict[str, float]
Values = dict[str, dict[str, list[float]]]  # variant -> metric -> one value per repetition
# Quoted: ddpipe's override parser reads a bare `off` as YAML 1.1's boolean false, which
# train.channels_last (auto | on | off) then rejects as 'False'.
CHANNELS_LAST_OFF = "train.channels_last='off'"
TRAIN_OUTPUTS = ("checkpoints", "model", "run_info", "train_metrics", "history", "test_metrics", "confusion",
                 "reports")


@dataclass
class Options:
    reps: int
    quick: bool
    world_sizes: list[int]
    match: str = ""


@dataclass
class Context:
    """What one section measures and a later one reuses."""

    default_epochs_s: list[float] = field(default_factory=list)
    default_epoch_source: str = ""


@dataclass
class Variant:
    name: str
    run: Callable[[], Metrics]
    baseline: str | None = None  # the variant whose medians the ratios divide by


@dataclass
class Section:
    key: str
    title: str
    variants: list[Variant]
    notes: list[str] = field(default_factory=list)
    cleanup: Callable[[], None] | None = None


# ---------------------------------------------------------------------------------------------
# Running things


def ddpipe_train(nproc: int | None, prepared: Path, overrides: list[str]) -> Metrics:
    """stages/train.py under torchrun (``nproc`` processes) or plain python (``None``), every output
    in a fresh temp dir; wall seconds and the last epoch's images/s and seconds from the history."""
    tmp = temp_dir("ddpipe-")
    paths = {"checkpoints": tmp / "checkpoints", "model": tmp / "model.pt", "run_info": tmp / "run.json",
             "train_metrics": tmp / "train.json", "history": tmp / "history.csv",
             "test_metrics": tmp / "test.json", "confusion": tmp / "confusion.csv", "reports": tmp / "reports"}
    args = [f"paths.{k}={v}" for k, v in paths.items()] + [
        f"paths.prepared={prepared}", f"mlflow.tracking_uri=sqlite:///{tmp / 'mlflow.db'}",
        "train.progress_bar=false", *overrides]
    launcher = torchrun(nproc) if nproc else [PY]
    try:
        done = run_timed([*launcher, "stages/train.py", *args])
        last = read_history(paths["history"])[-1]
    finally:
        remove(tmp)
    return {"images_per_s": last["images_per_s"], "epoch_s": last["epoch_seconds"], "wall_s": done.seconds}


def read_history(path: Path) -> list[dict[str, float]]:
    with path.open() as f:
        return [{k: float(v) for k, v in row.items()} for row in csv.DictReader(f)]


def reference(nproc: int, args: list[str]) -> Metrics:
    tmp = temp_dir("reference-")
    try:
        done = run_timed([*torchrun(nproc), str(BENCH / "reference_loop.py"), *args,
                          "--json-out", str(tmp / "r.json")])
        r = json.loads((tmp / "r.json").read_text())
    finally:
        remove(tmp)
    return {"images_per_s": r["images_per_s"], "test_accuracy": r["test_accuracy"],
            "wall_s": done.seconds, "wall_s_from_worker_start": r["wall_s"]}


def lightning(devices: int, args: list[str]) -> Metrics:
    tmp = temp_dir("lightning-")
    try:
        done = run_timed([PY, str(BENCH / "lightning_loop.py"), f"--devices={devices}", *args,
                          "--json-out", str(tmp / "l.json")])
        r = json.loads((tmp / "l.json").read_text())
    finally:
        remove(tmp)
    return {"images_per_s": r["images_per_s"], "wall_s": done.seconds}


def script_json(script: str, args: list[str]) -> dict:
    tmp = temp_dir("script-")
    try:
        run_timed([PY, str(BENCH / script), *args, "--json-out", str(tmp / "o.json")])
        return json.loads((tmp / "o.json").read_text())
    finally:
        remove(tmp)


# ---------------------------------------------------------------------------------------------
# A temporary copy of the repository


def repo_files() -> list[str]:
    """Tracked files plus untracked ones git does not ignore (most of ddpipe may not be committed)."""
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
                         cwd=REPO, capture_output=True, text=True, check=True).stdout
    return [f for f in out.split("\0") if f and (REPO / f).is_file()]


def repo_copy(prepared: Path, params: dict[str, object] | None = None) -> Path:
    """The repository's files in a temp dir with ``git init``, data/raw and ``prepared`` copied in
    as data/raw and data/prepared (real directories, so DVC hashes them as usual), ``params``
    (dotted keys) set in its params.yaml, and no train/evaluate outputs (no checkpoint to resume)."""
    copy = temp_dir("repo-")
    for rel in repo_files():
        (copy / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / rel, copy / rel)
    subprocess.run(["git", "init", "-q"], cwd=copy, check=True)
    cfg = OmegaConf.load(copy / "params.yaml")
    for key, value in (params or {}).items():
        OmegaConf.update(cfg, key, value)
    OmegaConf.save(cfg, copy / "params.yaml")
    for key in TRAIN_OUTPUTS:
        out = copy / str(OmegaConf.select(cfg, f"paths.{key}"))
        remove(out) if out.is_dir() else out.unlink(missing_ok=True)
    shutil.copytree(REPO / "data" / "raw", copy / "data" / "raw")
    shutil.copytree(prepared, copy / "data" / "prepared")
    return copy


def copy_env(copy: Path) -> dict[str, str]:
    return clean_env(PYTHONPATH=str(copy / "src"))  # the copy's ddpipe, not the editable install's


def stage_cmd(copy: Path, stage: str) -> str:
    """A stage's cmd from the copy's dvc.yaml, ``${...}`` resolved from its params.yaml."""
    cmd = yaml.safe_load((copy / "dvc.yaml").read_text())["stages"][stage]["cmd"]
    params = OmegaConf.load(copy / "params.yaml")
    return re.sub(r"\$\{([^}]+)\}", lambda m: str(OmegaConf.select(params, m.group(1))), cmd)


# ---------------------------------------------------------------------------------------------
# Sections


def section_a(opts: Options, ctx: Context) -> Section:
    n, epochs = (1024, 1) if opts.quick else (12800, 2)
    prepared = ensure_prepared(n, "prepared-1k" if opts.quick else "prepared-12k")
    seed = ["model.name=seed_cnn", "model.width=32", "train.batch_size_per_rank=128",
            f"num_epochs={epochs}", "mlflow.log_model=false"]
    ref_args = [f"--max-train-samples={n}", f"--epochs={epochs}"] + (["--max-test-samples=1000"] if opts.quick else [])
    variants = []
    for w in opts.world_sizes:
        ref = f"reference W={w}"
        variants += [
            Variant(ref, lambda w=w: reference(w, ref_args)),
            Variant(f"ddpipe W={w}", lambda w=w: ddpipe_train(w, prepared, seed), ref),
            Variant(f"ddpipe fp32, no channels_last W={w}", lambda w=w: ddpipe_train(
                w, prepared, [*seed, "train.precision=fp32", CHANNELS_LAST_OFF]), ref),
            Variant(f"lightning fp32 W={w}", lambda w=w: lightning(
                w, [f"--prepared={prepared}", f"--epochs={epochs}", "--batch-size=128"]), ref),
        ]
    notes = [f"{n} training samples, {epochs} epoch(s), SeedCNN width 32, batch 128 per rank, "
             f"cores // W threads per process; images/s of the last epoch (training loop only)"]
    return Section("a", "Loop throughput", variants, notes)


def section_b(opts: Options, ctx: Context) -> Section:
    prepared = ensure_prepared(1024, "prepared-1k") if opts.quick else REPO / "data" / "prepared"
    params = {"num_epochs": 1} if opts.quick else None

    def ddpipe_pipeline() -> Metrics:
        copy = repo_copy(prepared, params)
        try:
            env = copy_env(copy)
            train = run_timed(stage_cmd(copy, "train"), cwd=copy, env=env)
            evaluate = run_timed(stage_cmd(copy, "evaluate"), cwd=copy, env=env)
            acc = json.loads((copy / "metrics" / "test.json").read_text())["test"]["accuracy"]
            history = read_history(copy / "metrics" / "history.csv")
        finally:
            remove(copy)
        epoch_s = sorted(h["epoch_seconds"] for h in history)[len(history) // 2]
        ctx.default_epochs_s.append(epoch_s)
        ctx.default_epoch_source = "section b (median epoch of the default training)"
        return {"wall_s": train.seconds + evaluate.seconds, "train_s": train.seconds,
                "evaluate_s": evaluate.seconds, "test_accuracy": acc, "epoch_s": epoch_s,
                "images_per_s": history[-1]["images_per_s"]}

    ref_args = ["--quick"] if opts.quick else ["--epochs=5"]
    notes = ["ddpipe: `train` then `evaluate` commands of dvc.yaml in a fresh temp copy (params.yaml as it is"
             + (", num_epochs=1 on 1,024 samples" if opts.quick else "") + "), wall seconds of both",
             "reference: torchrun, 2 processes, " + ("--quick (1 epoch, 1,024 samples, 1,000 test images)"
                                                      if opts.quick else "5 epochs, the official train split")
             + "; test accuracy on the official test split"]
    return Section("b", "Time to accuracy", [
        Variant("reference W=2", lambda: reference(2, ref_args)),
        Variant("ddpipe dvc train+evaluate (defaults)", ddpipe_pipeline, "reference W=2"),
    ], notes)


def section_c(opts: Options, ctx: Context) -> Section:
    n, epochs = (1024, 1) if opts.quick else (12800, 2)
    prepared = ensure_prepared(n, "prepared-1k" if opts.quick else "prepared-12k")
    base = [f"num_epochs={epochs}", "mlflow.log_model=false"]
    c, half = cores(), max(1, cores() // 2)
    one = [*base, "train.batch_size_per_rank=256", f"distributed.threads_per_process={c}"]
    two = [*base, "train.batch_size_per_rank=128", f"distributed.threads_per_process={half}"]
    plain = f"python, 1 process x {c} threads (no DDP)"
    return Section("c", "DDP overhead", [
        Variant(plain, lambda: ddpipe_train(None, prepared, one)),
        Variant(f"torchrun W=1 x {c} threads", lambda: ddpipe_train(1, prepared, one), plain),
        Variant(f"torchrun W=2 x {half} thread(s), SyncBatchNorm", lambda: ddpipe_train(2, prepared, two), plain),
        Variant(f"torchrun W=2 x {half} thread(s), no SyncBatchNorm", lambda: ddpipe_train(
            2, prepared, [*two, "distributed.sync_batchnorm=false"]), plain),
    ], [f"ddpipe defaults (model, precision auto), {n} samples, {epochs} epoch(s), global batch 256"])


def wall(metrics: Metrics) -> Metrics:
    """Only the wall seconds (one step's images/s says nothing)."""
    return {"wall_s": metrics["wall_s"]}


def section_d(opts: Options, ctx: Context) -> Section:
    prepared = ensure_prepared(256, "prepared-256")
    tiny = ["num_epochs=1"]
    completed: dict[str, Path] = {}

    def import_time(module: str) -> Metrics:
        return {"wall_s": run_timed([PY, "-c", f"import {module}"]).seconds}

    def noop_repro() -> Metrics:
        if "copy" not in completed:  # one completed pipeline, made once, untimed
            params = {"num_epochs": 1, **({"data.max_train_samples": 256} if opts.quick else {})}
            copy = repo_copy(REPO / "data" / "prepared", params)
            run_timed("dvc repro -q", cwd=copy, env=copy_env(copy))
            completed["copy"] = copy
        done = run_timed("dvc repro", cwd=completed["copy"], env=copy_env(completed["copy"]))
        out = done.stdout + done.stderr
        if "Running stage" in out or "didn't change, skipping" not in out:
            raise BenchError(f"dvc repro was not a no-op:\n{out[-2000:]}")
        return {"wall_s": done.seconds}

    return Section("d", "Start-up", [
        Variant("python -c 'import torch'", lambda: import_time("torch")),
        Variant("python -c 'import ddpipe.training'", lambda: import_time("ddpipe.training")),
        Variant("python stages/train.py", lambda: wall(ddpipe_train(None, prepared, tiny))),
        Variant("python stages/train.py mlflow.log_model=false",
                lambda: wall(ddpipe_train(None, prepared, [*tiny, "mlflow.log_model=false"]))),
        Variant("torchrun --nproc-per-node=1 stages/train.py", lambda: wall(ddpipe_train(1, prepared, tiny))),
        Variant("dvc repro, no-op (temp copy)", noop_repro),
    ], ["train stage: 256 training samples, 1 epoch (one optimizer step at the default batch of 256), "
        "validation over the 6,000-image val split, checkpoint, history, model and MLflow included; "
        "wall seconds of the whole command",
        "dvc repro: a temp copy whose pipeline (num_epochs=1) completed once, untimed, before the reps"],
        cleanup=lambda: [remove(p) for p in completed.values()])


def default_epoch_seconds(opts: Options, ctx: Context) -> float:
    """Section b's default epoch if it ran; else one default epoch on a subset, scaled to the split."""
    if not ctx.default_epochs_s:
        n = 1024 if opts.quick else 12800
        prepared = ensure_prepared(n, "prepared-1k" if opts.quick else "prepared-12k")
        r = ddpipe_train(None, prepared, ["num_epochs=1", "mlflow.log_model=false"])
        full = json.loads((REPO / "data" / "prepared" / "meta.json").read_text())["sizes"]["train"]
        ctx.default_epochs_s.append(full / r["images_per_s"])
        ctx.default_epoch_source = (f"one default epoch on {n} samples ({r['images_per_s']:.0f} images/s) "
                                    f"scaled to {full} samples")
    return summary(ctx.default_epochs_s)[0]


def section_e(opts: Options, ctx: Context) -> Section:
    num_epochs = OmegaConf.load(REPO / "params.yaml").num_epochs
    notes = [f"training = num_epochs ({num_epochs}) x the default epoch (default_epoch_s); once per run = "
             "import mlflow + start (existing store) + log_model + finish",
             "start_new_store_s (a new mlflow.db: schema creation) is not in the shares: a "
             "repository's store exists after its first run"]

    def tracker_calls() -> Metrics:
        epoch_s = default_epoch_seconds(opts, ctx)
        source = f"default epoch from {ctx.default_epoch_source}"
        if source not in notes:
            notes.append(source)
        r = script_json("tracking_overhead.py", ["--quick"] if opts.quick else [])
        training_s = num_epochs * epoch_s
        once = r["import_mlflow_s"] + r["start_s"] + r["log_model_s"] + r["finish_s"]
        every_epoch = num_epochs * r["log_metrics_per_epoch_s"]
        return {**{k: v for k, v in r.items() if k.endswith("_s")},
                "default_epoch_s": epoch_s,
                "log_metrics_pct_of_epoch": 100 * r["log_metrics_per_epoch_s"] / epoch_s,
                "once_per_run_pct_of_training": 100 * once / training_s,
                "all_tracking_pct_of_training": 100 * (once + every_epoch) / training_s}

    return Section("e", "Tracking overhead", [Variant("MlflowTracker, local sqlite", tracker_calls)], notes)


def section_f(opts: Options, ctx: Context) -> Section:
    extra = ["--quick"] if opts.quick else []

    def data_path(variant: str) -> Metrics:
        r = script_json("data_path.py", [f"--variant={variant}", *extra])["results"][0]
        return {"images_per_s": r["images_per_s"]}

    return Section("f", "Data path alone", [
        Variant("reference per-sample ToTensor+Normalize", lambda: data_path("reference")),
        Variant("ddpipe loader + BatchTransform (crop, flip, channels_last)", lambda: data_path("ddpipe"),
                "reference per-sample ToTensor+Normalize"),
        Variant("ddpipe loader + BatchTransform, no augmentation", lambda: data_path("ddpipe-noaug"),
                "reference per-sample ToTensor+Normalize"),
    ], ["batch 128, no model, last of 2 epochs; reference over the official 60,000-image train split, "
        "ddpipe over the prepared train split"])


SECTIONS: dict[str, Callable[[Options, Context], Section]] = {
    "a": section_a, "b": section_b, "c": section_c, "d": section_d, "e": section_e, "f": section_f}


# ---------------------------------------------------------------------------------------------
# Repetitions and reporting


def run_section(section: Section, reps: int, match: str = "") -> tuple[Values, dict[str, str]]:
    """Interleaved repetitions: values[variant][metric] and the first error of each failed variant."""
    values: Values = {v.name: defaultdict(list) for v in section.variants if match.lower() in v.name.lower()}
    errors: dict[str, str] = {}
    for rep in range(reps):
        for v in section.variants:
            if v.name in errors or v.name not in values:
                continue
            try:
                metrics = v.run()
            except (BenchError, subprocess.SubprocessError, OSError, KeyError, ValueError) as exc:
                errors[v.name] = str(exc)
                print(f"[{section.key}] {v.name}: FAILED\n{exc}", file=sys.stderr, flush=True)
                continue
            shown = ", ".join(f"{k} {x:.4g}" for k, x in metrics.items())
            print(f"[{section.key}] rep {rep + 1}/{reps} {v.name}: {shown}", file=sys.stderr, flush=True)
            for k, x in metrics.items():
                values[v.name][k].append(x)
    return values, errors


def summarise(section: Section, values: Values, opts: Options) -> list[dict]:
    rows = []
    for v in section.variants:
        for metric, xs in values.get(v.name, {}).items():
            med, lo, hi = summary(xs)
            base = values.get(v.baseline or "", {}).get(metric)
            ratio = med / summary(base)[0] if base and summary(base)[0] else None
            rows.append({"bench": "run_all", "section": section.key, "title": section.title,
                         "variant": v.name, "metric": metric, "median": med, "min": lo, "max": hi,
                         "n": len(xs), "values": xs, "baseline": v.baseline, "ratio_to_baseline": ratio,
                         "quick": opts.quick})
    return rows


def print_section(section: Section, rows: list[dict], errors: dict[str, str]) -> None:
    print(f"\n### {section.key}. {section.title}\n")
    for note in section.notes:
        print(f"- {note}")
    print()
    print(markdown_table(
        ["variant", "metric", "median", "min", "max", "n", "x baseline (median)"],
        [[r["variant"], r["metric"], r["median"], r["min"], r["max"], r["n"],
          "-" if r["ratio_to_baseline"] is None else f"{r['ratio_to_baseline']:.2f}"] for r in rows]))
    for name, err in errors.items():
        print(f"\n**{name} failed:** {err.splitlines()[0] if err else ''}")
    sys.stdout.flush()


def parse_args(argv: list[str] | None = None) -> tuple[Options, list[str]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=None, help="repetitions (default 3; --quick: 1)")
    p.add_argument("--quick", action="store_true", help="tiny settings, seconds per run")
    p.add_argument("--only", default=",".join(SECTIONS), help="sections, e.g. a or a,c (default: all)")
    p.add_argument("--world-sizes", default=None, help="section a (default 1,2; --quick: 1)")
    p.add_argument("--match", default="", help="only the variants whose name contains this text")
    args = p.parse_args(argv)
    keys = [k.strip() for k in args.only.split(",") if k.strip()]
    unknown = [k for k in keys if k not in SECTIONS]
    if unknown:
        p.error(f"--only: unknown section(s) {unknown}; accepted: {', '.join(SECTIONS)}")
    sizes = args.world_sizes or ("1" if args.quick else "1,2")
    reps = args.reps or (1 if args.quick else 3)
    return Options(reps, args.quick, [int(w) for w in sizes.split(",")], args.match), keys


def main(argv: list[str] | None = None) -> int:
    opts, keys = parse_args(argv)
    ctx, failed = Context(), False
    for key in keys:
        section = SECTIONS[key](opts, ctx)
        try:
            values, errors = run_section(section, opts.reps, opts.match)
        finally:
            if section.cleanup:
                section.cleanup()
        rows = summarise(section, values, opts)
        print_section(section, rows, errors)
        append_jsonl("run_all", rows + [{"bench": "run_all", "section": key, "variant": name,
                                         "error": err, "quick": opts.quick} for name, err in errors.items()])
        failed = failed or bool(errors)
    with contextlib.suppress(OSError):
        (REPO / "bench" / "results" / "tmp").rmdir()  # only when empty: another run may be using it
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
