"""ddpipe against the DDP tutorials' reference loop, and what DDP costs ddpipe; repetitions interleaved.

    python bench/run_all.py                                    # every section, 3 repetitions (make bench)
    python bench/run_all.py --only time-to-accuracy --reps 5   # one section, or several, comma-separated
    python bench/run_all.py --quick        # 1,024 samples, 1 epoch, 1 repetition (~2 min a section)

Sections (``--only``): loop-throughput, time-to-accuracy, ddp-overhead; each one's function below says
what it measures, and its table is printed under that text. The tables give median, min and max per
variant and metric, and the ratio of medians to the section's baseline. ddpipe's outputs (paths.*, the
MLflow store) go to bench/results/tmp. Prints the machine and Markdown tables; appends to
bench/results/run_all.jsonl.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import shutil
import subprocess
import sys
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import yaml
from common import (
    REPO,
    BenchError,
    append_jsonl,
    clean_env,
    config,
    ensure_prepared,
    markdown_table,
    print_machine,
    run_timed,
    summary,
    temp_dir,
)
from omegaconf import OmegaConf

from ddpipe.config.load import load_config
from ddpipe.config.schema import Config
from ddpipe.core.devices import cpu_count, cpu_supports_bf16
from ddpipe.launch.torchrun import WORKER_MODULE, torchrun_command

PY = sys.executable
REFERENCE_LOOP = REPO / "bench" / "reference_loop.py"
Metrics = dict[str, float]
# Quoted: the override parser reads a bare `off` as YAML 1.1's false, which train.channels_last rejects.
CHANNELS_LAST_OFF = "train.channels_last='off'"
OUTPUTS = ("checkpoints", "model", "run_info", "train_metrics", "history", "test_metrics", "confusion", "reports")


@dataclass
class Variant:
    name: str
    run: Callable[[], Metrics]
    baseline: str | None = None  # the variant whose medians the ratios divide by


# ---------------------------------------------------------------------------------------------
# Running things


def ddpipe_train(nproc: int | None, prepared: Path, overrides: list[str]) -> Metrics:
    """stages/train_worker.py under torchrun (``nproc`` processes) or plain python (``None``), every output in a
    fresh temp dir; wall seconds and the last epoch's images/s and seconds from the history."""
    with temp_dir("ddpipe-") as tmp:
        args = [f"paths.{key}={tmp / key}" for key in OUTPUTS] + [
            f"paths.prepared={prepared}", f"mlflow.tracking_uri=sqlite:///{tmp / 'mlflow.db'}",
            "train.progress_bar=false", *overrides]
        seconds = run_timed(torchrun_command(config(args).distributed, nproc, args) if nproc
                            else [PY, "-m", WORKER_MODULE, *args])
        last = read_history(tmp / "history")[-1]
    return {"images_per_s": last["images_per_s"], "epoch_s": last["epoch_seconds"], "wall_s": seconds}


def read_history(path: Path) -> list[dict[str, float]]:
    return [{k: float(v) for k, v in row.items()} for row in csv.DictReader(path.read_text().splitlines())]


def reference(nproc: int, args: list[str]) -> Metrics:
    """bench/reference_loop.py under torchrun: its last epoch's images/s, test accuracy, and wall seconds."""
    with temp_dir("reference-") as tmp:
        script_args = [*args, "--json-out", str(tmp / "r.json")]
        seconds = run_timed(torchrun_command(config().distributed, nproc, script_args, script=REFERENCE_LOOP))
        r = json.loads((tmp / "r.json").read_text())
    return {"images_per_s": r["images_per_s"], "test_accuracy": r["test_accuracy"], "wall_s": seconds}


def repo_copy(copy: Path, prepared: Path, params: dict[str, object]) -> Config:
    """The repository's files (tracked, and untracked ones git does not ignore) in ``copy`` with
    ``git init``, data/raw and ``prepared`` copied in as real directories (DVC hashes them as usual),
    ``params`` (dotted keys) set in its params.yaml, and no training outputs (nothing to resume).
    Returns the copy's config."""
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=REPO,
                           capture_output=True, text=True, check=True).stdout.split("\0")
    for rel in (f for f in files if f and (REPO / f).is_file()):
        (copy / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / rel, copy / rel)
    subprocess.run(["git", "init", "-q"], cwd=copy, check=True)
    doc = OmegaConf.load(copy / "params.yaml")
    for key, value in params.items():
        OmegaConf.update(doc, key, value)
    OmegaConf.save(doc, copy / "params.yaml")
    cfg = load_config([], params_file=copy / "params.yaml")
    for key in OUTPUTS:
        out = copy / getattr(cfg.paths, key)
        shutil.rmtree(out) if out.is_dir() else out.unlink(missing_ok=True)
    shutil.copytree(REPO / cfg.paths.raw, copy / cfg.paths.raw)
    shutil.copytree(prepared, copy / cfg.paths.prepared)
    return cfg


def in_copy(copy: Path, cmd: str) -> float:
    """``cmd`` in the copy, with the copy's ddpipe (not the editable install's)."""
    return run_timed(cmd, cwd=copy, env=clean_env(PYTHONPATH=str(copy / "src")))


# ---------------------------------------------------------------------------------------------
# Sections


def loop_throughput(opts: argparse.Namespace) -> list[Variant]:
    """Images/s of the last epoch (the training loop only) at world sizes 1 and 2 on 12,800 samples, 2
    epochs, SeedCNN width 32, batch 128 per rank, cores // W threads per process: the reference loop
    (baseline), ddpipe's defaults (precision and channels_last auto), ddpipe in fp32 without channels_last."""
    n, epochs = (1024, 1) if opts.quick else (12800, 2)
    prepared = ensure_prepared(n, f"prepared-{n}")
    seed = ["model.name=seed_cnn", "model.width=32", "train.batch_size_per_rank=128", f"num_epochs={epochs}",
            "mlflow.log_model=false"]
    ref_args = [f"--max-train-samples={n}", f"--epochs={epochs}", *(["--max-test-samples=1000"] * opts.quick)]
    variants = []
    for w in opts.world_sizes:
        ref = f"reference W={w}"
        variants += [
            Variant(ref, lambda w=w: reference(w, ref_args)),
            Variant(f"ddpipe W={w}", lambda w=w: ddpipe_train(w, prepared, seed), ref),
            Variant(f"ddpipe fp32, no channels_last W={w}", lambda w=w: ddpipe_train(
                w, prepared, [*seed, "train.precision=fp32", CHANNELS_LAST_OFF]), ref),
        ]
    return variants


def time_to_accuracy(opts: argparse.Namespace) -> list[Variant]:
    """Wall seconds and test accuracy: the reference loop, 2 processes x 5 epochs on the official split
    (baseline), against dvc.yaml's train then evaluate commands with params.yaml's defaults, run in a
    temporary copy of the repository; where `precision: auto` is bf16 (AVX512-BF16 or AMX), the same
    again in fp32, as on a CPU without them."""
    prepared = ensure_prepared(1024, "prepared-1024") if opts.quick else REPO / config().paths.prepared

    def pipeline(params: dict[str, object]) -> Metrics:
        with temp_dir("repo-") as copy:
            paths = repo_copy(copy, prepared, {**params, **({"num_epochs": 1} if opts.quick else {})}).paths
            stages = yaml.safe_load((copy / "dvc.yaml").read_text())["stages"]
            train_s = in_copy(copy, stages["train"]["cmd"])
            evaluate_s = in_copy(copy, stages["evaluate"]["cmd"])
            acc = json.loads((copy / paths.test_metrics).read_text())["test"]["accuracy"]
            history = read_history(copy / paths.history)
        return {"wall_s": train_s + evaluate_s, "train_s": train_s, "evaluate_s": evaluate_s, "test_accuracy": acc,
                "epoch_s": summary([h["epoch_seconds"] for h in history])[0],
                "images_per_s": history[-1]["images_per_s"]}

    variants = [Variant("reference W=2", lambda: reference(2, ["--quick"] if opts.quick else ["--epochs=5"])),
                Variant("ddpipe dvc train+evaluate (defaults)", lambda: pipeline({}), "reference W=2")]
    if cpu_supports_bf16():
        variants.append(Variant("ddpipe dvc train+evaluate, train.precision=fp32",
                                lambda: pipeline({"train.precision": "fp32"}), "reference W=2"))
    for extra in opts.variant:  # --variant 'key=value key=value': the defaults with those set, beside them
        params = {k: yaml.safe_load(v) for k, v in (kv.split("=", 1) for kv in extra.split())}
        variants.append(Variant(f"ddpipe dvc train+evaluate, {extra}", lambda p=params: pipeline(p), "reference W=2"))
    return variants


def ddp_overhead(opts: argparse.Namespace) -> list[Variant]:
    """ddpipe's defaults on 12,800 samples, 2 epochs, global batch 256: plain `python stages/train_worker.py`
    (no process group; baseline) against torchrun with 1 process x all cores, and 2 processes x half of
    them with and without SyncBatchNorm, and with SyncBatchNorm's and DDP's sums over gloo's sockets
    instead of shared memory (``distributed.shared_memory=false``)."""
    n, epochs = (1024, 1) if opts.quick else (12800, 2)
    prepared = ensure_prepared(n, f"prepared-{n}")
    base = [f"num_epochs={epochs}", "mlflow.log_model=false"]
    c, half = cpu_count(), max(1, cpu_count() // 2)
    one = [*base, "train.batch_size_per_rank=256", f"distributed.threads_per_process={c}"]
    two = [*base, "train.batch_size_per_rank=128", f"distributed.threads_per_process={half}"]
    plain = f"python, 1 process x {c} threads (no DDP)"
    return [
        Variant(plain, lambda: ddpipe_train(None, prepared, one)),
        Variant(f"torchrun W=1 x {c} threads", lambda: ddpipe_train(1, prepared, one), plain),
        Variant(f"torchrun W=2 x {half} thread(s), SyncBatchNorm", lambda: ddpipe_train(2, prepared, two), plain),
        Variant(f"torchrun W=2 x {half} thread(s), no SyncBatchNorm", lambda: ddpipe_train(
            2, prepared, [*two, "distributed.sync_batchnorm=false"]), plain),
        Variant(f"torchrun W=2 x {half} thread(s), SyncBatchNorm, sums over gloo only", lambda: ddpipe_train(
            2, prepared, [*two, "distributed.shared_memory=false"]), plain),
    ]


SECTIONS: dict[str, Callable[[argparse.Namespace], list[Variant]]] = {
    "loop-throughput": loop_throughput, "time-to-accuracy": time_to_accuracy, "ddp-overhead": ddp_overhead}


# ---------------------------------------------------------------------------------------------
# Repetitions and reporting


def run_section(key: str, variants: list[Variant], opts: argparse.Namespace) -> list[dict]:
    """Interleaved repetitions; one row per variant and metric (median, min, max, ratio), or its error."""
    values = {v.name: defaultdict(list) for v in variants if opts.match.lower() in v.name.lower()}
    errors: dict[str, str] = {}
    for rep in range(opts.reps):
        for v in (v for v in variants if v.name in values and v.name not in errors):
            try:
                metrics = v.run()
            except (BenchError, subprocess.SubprocessError, OSError, KeyError, ValueError) as exc:
                errors[v.name] = str(exc)
                print(f"[{key}] {v.name}: FAILED\n{exc}", file=sys.stderr, flush=True)
                continue
            shown = ", ".join(f"{k} {x:.4g}" for k, x in metrics.items())
            print(f"[{key}] rep {rep + 1}/{opts.reps} {v.name}: {shown}", file=sys.stderr, flush=True)
            for k, x in metrics.items():
                values[v.name][k].append(x)
    rows = []
    for v in variants:
        for metric, xs in values.get(v.name, {}).items():
            base = values.get(v.baseline or "", {}).get(metric)
            ratio = summary(xs)[0] / summary(base)[0] if base and summary(base)[0] else None
            rows.append({"bench": "run_all", "section": key, "variant": v.name, "metric": metric,
                         **dict(zip(("median", "min", "max"), summary(xs))), "n": len(xs), "values": xs,
                         "baseline": v.baseline, "ratio_to_baseline": ratio, "quick": opts.quick})
    return rows + [{"bench": "run_all", "section": key, "variant": name, "error": err, "quick": opts.quick}
                   for name, err in errors.items()]


def print_section(key: str, rows: list[dict], quick: bool) -> None:
    what = " ".join(SECTIONS[key].__doc__.split())
    print(f"\n### `--only {key}`{' --quick' if quick else ''}\n\n{what}\n")
    print(markdown_table(
        ["variant", "metric", "median", "min", "max", "n", "x baseline (median)"],
        [[r["variant"], r["metric"], r["median"], r["min"], r["max"], r["n"],
          "-" if r["ratio_to_baseline"] is None else f"{r['ratio_to_baseline']:.2f}"] for r in rows if "median" in r]))
    for r in (r for r in rows if "error" in r):
        print(f"\n**{r['variant']} failed:** {r['error'].splitlines()[0] if r['error'] else ''}")
    sys.stdout.flush()


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=None, help="repetitions (default 3; --quick: 1)")
    p.add_argument("--quick", action="store_true", help="1,024 samples, 1 epoch, 1 repetition")
    p.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated, of: {', '.join(SECTIONS)}")
    p.add_argument("--world-sizes", default=None, help="loop-throughput's (default 1,2; --quick: 1)")
    p.add_argument("--match", default="", help="only the variants whose name contains this text")
    p.add_argument("--variant", action="append", default=[], metavar="'KEY=VALUE ...'",
                   help="time-to-accuracy: one more variant, params.yaml's defaults with these set (repeatable)")
    opts = p.parse_args(argv)
    keys = [k.strip() for k in opts.only.split(",") if k.strip()]
    if unknown := [k for k in keys if k not in SECTIONS]:
        p.error(f"--only: unknown section(s) {unknown}; accepted: {', '.join(SECTIONS)}")
    opts.world_sizes = [int(w) for w in (opts.world_sizes or ("1" if opts.quick else "1,2")).split(",")]
    opts.reps = opts.reps or (1 if opts.quick else 3)
    return opts, keys


def main(argv: list[str] | None = None) -> int:
    opts, keys = parse_args(argv)
    print_machine()
    failed = False
    for key in keys:
        rows = run_section(key, SECTIONS[key](opts), opts)
        print_section(key, rows, opts.quick)
        append_jsonl("run_all", rows)
        failed = failed or any("error" in r for r in rows)
    with contextlib.suppress(OSError):
        (REPO / "bench" / "results" / "tmp").rmdir()  # only when empty: another run may be using it
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
