"""What ddpipe's MLflow tracker costs, call by call, on a fresh local sqlite store.

    python bench/tracking_overhead.py            # params.yaml's num_epochs of per-epoch metrics
    python bench/tracking_overhead.py --quick    # smoke run (2 epochs of metrics)

Times ``import mlflow``, ``MlflowTracker.start`` on a new store (schema creation included) and on
the existing one (a second run), ``log_metrics`` for every epoch with the metrics the Trainer logs
(EpochStats less ``epoch``), ``log_model`` of the default model (params.yaml's ``model``) with a
4-image input example, and ``finish``. Each call must leave the tracker enabled (a failure would
otherwise be a silent, cheap no-op). ``MLFLOW_TRACKING_URI`` is ignored: the store is a temp
directory under bench/results/tmp, removed afterwards. Prints a Markdown table and appends the run to
``bench/results/tracking_overhead.jsonl``. bench/run_all.py section e relates these to an epoch.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from common import REPO, append_jsonl, markdown_table, remove, temp_dir, write_json

from ddpipe.config import Config, load_config
from ddpipe.distributed import DistInfo
from ddpipe.models import build_model, save_model
from ddpipe.tracking import MlflowTracker
from ddpipe.training import EpochStats

os.environ.pop("MLFLOW_TRACKING_URI", None)  # it would win over the temp store


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=None, help="epochs of metrics (default: num_epochs)")
    p.add_argument("--quick", action="store_true", help="2 epochs of metrics")
    p.add_argument("--json-out", default=None, help="also write the result as JSON here")
    args = p.parse_args(argv)
    if args.quick:
        args.epochs = 2
    return args


def timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def checked(tracker: MlflowTracker, what: str) -> None:
    if not tracker.enabled:
        sys.exit(f"tracking failed during {what} (see the warning above); no timing to report")


def derived(cfg: Config, num_parameters: int) -> dict[str, Any]:
    """Values shaped like Trainer.derived() for one CPU process."""
    return {"world_size": 1, "effective_lr": cfg.train.base_lr, "steps_per_epoch": 0,
            "global_batch_size": cfg.train.batch_size_per_rank, "resolved_precision": "n/a",
            "channels_last": True, "num_parameters": num_parameters}


def epoch_metrics(epoch: int) -> dict[str, float]:
    stats = EpochStats(epoch, 0.5, 0.8, 0.45, 0.82, 1e-3, 5000.0, 10.0)
    return {k: float(v) + epoch * 1e-3 for k, v in dataclasses.asdict(stats).items() if k != "epoch"}


def measure(cfg: Config, epochs: int) -> dict[str, float]:
    info = DistInfo(False, 0, 0, 1, 1, 1, torch.device("cpu"), None)
    model = build_model(cfg.model, 1, 10).eval()
    model_path = Path(cfg.paths.checkpoints) / "model.pt"
    meta = {"num_channels": 1, "classes": [str(i) for i in range(10)], "mean": [0.5], "std": [0.25],
            "image_size": [28, 28]}
    save_model(model.state_dict(), cfg.model, meta, model_path)
    example = torch.randint(0, 256, (4, 28, 28), dtype=torch.uint8).numpy()
    extra = derived(cfg, sum(p.numel() for p in model.parameters()))
    markers = Path(cfg.paths.checkpoints)
    out: dict[str, float] = {"import_mlflow_s": timed(lambda: __import__("mlflow"))}

    first = MlflowTracker(cfg.mlflow, info)
    out["start_new_store_s"] = timed(lambda: first.start(cfg, extra, None, markers))
    checked(first, "start (new store)")
    first.finish()

    tracker = MlflowTracker(cfg.mlflow, info)
    out["start_s"] = timed(lambda: tracker.start(cfg, extra, None, markers))
    checked(tracker, "start")
    metrics_s = timed(lambda: [tracker.log_metrics(epoch_metrics(e), step=e) for e in range(epochs)])
    checked(tracker, "log_metrics")
    out["log_metrics_per_epoch_s"] = metrics_s / epochs
    out["log_model_s"] = timed(lambda: tracker.log_model(model_path, example, cfg))
    checked(tracker, "log_model")
    out["finish_s"] = timed(tracker.finish)
    checked(tracker, "finish")
    return out


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    tmp = temp_dir("tracking-")
    try:
        cfg = load_config([f"mlflow.tracking_uri=sqlite:///{tmp / 'mlflow.db'}", f"paths.checkpoints={tmp}"],
                          params_file=REPO / "params.yaml")
        epochs = args.epochs or cfg.num_epochs
        result = measure(cfg, epochs)
    finally:
        remove(tmp)
    n_metrics = len(epoch_metrics(0))
    print(markdown_table(["call", "seconds"], list(result.items())))
    print(f"\n{epochs} epochs x {n_metrics} metrics; model {cfg.model.name} width {cfg.model.width}")
    record = {"bench": "tracking_overhead", "epochs": epochs, "metrics_per_epoch": n_metrics,
              "model": dataclasses.asdict(cfg.model), "quick": args.quick, **result}
    append_jsonl("tracking_overhead", [record])
    write_json(args.json_out, record)


if __name__ == "__main__":
    main()
