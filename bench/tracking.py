"""What MLflow logging costs a training's critical path, per epoch, and what a store outage costs.

    python bench/tracking.py [--calls 200]

1. One epoch's metrics (8 values) as the training logs them, timed on the calling thread: before the outbox, a
   synchronous ``MlflowClient.log_batch`` (into the local sqlite store, and into a local ``mlflow server``);
   now, ``MlflowTracker.log_metrics`` (one line appended to the run's journal; the courier sends it).
2. A 2-epoch training (Fashion-MNIST, 2,048 images) with its store answering, and with the store down for the
   whole training (``http://127.0.0.1:9``): wall seconds of ``python stages/train_worker.py``, and how long the
   delivery takes afterwards (``python -m ddpipe.outbox deliver``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

from common import REPO, clean_env, ensure_prepared, markdown_table, mlflow_server, print_machine, run_timed, temp_dir

from ddpipe.config.schema import Config, MlflowConfig
from ddpipe.core.ranks import DistInfo
from ddpipe.tracking.tracker import MlflowTracker

EPOCH = {k: 0.5 for k in ("train_loss", "train_accuracy", "val_loss", "val_accuracy", "best_val_accuracy",
                          "epoch_seconds", "images_per_s", "lr")}


def per_call_ms(fn, calls: int) -> float:
    times = []
    for step in range(calls):
        t = time.perf_counter()
        fn(step)
        times.append((time.perf_counter() - t) * 1000)
    return statistics.median(times)


def logging_cost(uri: str, tmp: Path, calls: int) -> tuple[float, float]:
    """(ms per epoch's log_batch, synchronous; ms per epoch's log_metrics through the outbox)."""
    import mlflow
    from mlflow.entities import Metric

    os.environ["MLFLOW_TRACKING_URI"] = uri
    client = mlflow.MlflowClient(uri)
    exp = client.get_experiment_by_name("bench") or client.get_experiment(client.create_experiment("bench"))
    run_id = client.create_run(exp.experiment_id).info.run_id
    sync = per_call_ms(lambda s: client.log_batch(run_id, metrics=[
        Metric(k, v, int(time.time() * 1000), s) for k, v in EPOCH.items()]), calls)
    tracker = MlflowTracker(MlflowConfig(experiment_name="bench", outbox=str(tmp / "outbox")), DistInfo())
    tracker.start(Config(), {"seed": 0}, None, tmp, "seed_cnn")
    queued = per_call_ms(lambda s: tracker.log_metrics(EPOCH, step=s), calls)
    tracker.finish()
    return sync, queued


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--calls", type=int, default=200)
    args = p.parse_args()
    print_machine()
    rows = []
    with temp_dir("ddpipe-bench-tracking-") as tmp:
        sqlite = f"sqlite:///{tmp}/mlflow.db"
        rows.append(["local sqlite store", *logging_cost(sqlite, tmp / "a", args.calls)])
        with mlflow_server(f"sqlite:///{tmp}/server.db") as base:
            rows.append(["local mlflow server (HTTP)", *logging_cost(base, tmp / "b", args.calls)])
        print(markdown_table(["store", "synchronous log_batch, ms/epoch", "outbox log_metrics, ms/epoch"],
                             [[r[0], f"{r[1]:.2f}", f"{r[2]:.3f}"] for r in rows]))
        prepared = ensure_prepared(2048, "tracking")
        outage = []
        for label, uri in (("store answering", f"sqlite:///{tmp}/t.db"), ("store down all along", "http://127.0.0.1:9")):
            d = tmp / label.replace(" ", "-")
            cmd = ["python", "stages/train_worker.py", "num_epochs=2", f"paths.prepared={prepared}",
                   f"paths.checkpoints={d}/ckpt", f"paths.model={d}/model.pt", f"paths.run_info={d}/run.json",
                   f"paths.train_metrics={d}/train.json", f"paths.history={d}/history.csv",
                   f"mlflow.outbox={d}/outbox", "train.progress_bar=false"]
            seconds = run_timed(cmd, env=clean_env(MLFLOW_TRACKING_URI=uri))
            outage.append([label, f"{seconds:.1f}"])
        d = tmp / "store-down-all-along"
        seconds = run_timed(["python", "-m", "ddpipe.outbox", "deliver", f"mlflow.outbox={d}/outbox"],
                           env=clean_env(MLFLOW_TRACKING_URI=f"sqlite:///{tmp}/later.db"))
        outage.append(["then: python -m ddpipe.outbox deliver", f"{seconds:.1f}"])
        print(markdown_table(["2-epoch training", "wall seconds"], outage))


if __name__ == "__main__":
    os.chdir(REPO)
    main()
