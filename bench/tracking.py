"""What MLflow logging costs a training's critical path, per epoch, and what a store outage costs.

    python bench/tracking.py [--calls 200]

1. One epoch's metrics (8 values) as the training logs them, timed on the calling thread: before the outbox, a
   synchronous ``MlflowClient.log_batch`` (into the local sqlite store, and into a local ``mlflow server``);
   now, ``MlflowTracker.log_metrics`` (one line appended to the run's journal; the courier sends it).
2. A 2-epoch training (Fashion-MNIST, 2,048 images) with its store answering, and with the store down for the
   whole training (``http://127.0.0.1:9``): wall seconds of ``python stages/train_worker.py``, and how long the
   delivery takes afterwards (``ddpipe outbox deliver``).
3. ``--steps N``: instead, what the per-step figures cost params.yaml's training on this CPU (one plain process,
   the repository's data/prepared): an optimizer step's wall ms, the non-finite check every step pays (the global
   gradient norm and its host sync) and one step record (``train.log_every_n_steps``: the meter's sums, one journal
   line), each timed alone.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

from common import (
    REPO,
    clean_env,
    config,
    ensure_prepared,
    markdown_table,
    mlflow_server,
    print_machine,
    run_timed,
    temp_dir,
)

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


def step_costs(steps: int, tmp: Path) -> list[list[str]]:
    """Rows (what, ms, share of a step) for params.yaml's training: see the module's point 3."""
    import torch

    from ddpipe.distributed.group import init_distributed
    from ddpipe.engine.loop import Trainer
    from ddpipe.engine.meters import EpochMeter, EpochProgress, StepLog
    from ddpipe.engine.optimizer import grad_norm
    from ddpipe.engine.parts import build_parts
    from ddpipe.engine.resolved import resolve
    from ddpipe.launch.torchrun import this_device

    cfg = config(["train.log_every_n_steps=0", "train.progress_bar=false"])
    cfg.paths.prepared = str(REPO / cfg.paths.prepared)
    run = resolve(cfg, this_device())
    trainer = Trainer(build_parts(run, init_distributed(cfg.distributed, run.backend)))
    meter = EpochMeter(trainer.device, EpochProgress())
    trainer.model.train()
    batches = iter(trainer.data.train_batches(0, 0, trainer.steps_per_epoch))
    times = []
    for step in range(1, steps + 1):
        t = time.perf_counter()
        trainer.train_step([next(batches)], 0, step, meter)
        times.append((time.perf_counter() - t) * 1000)
    step_ms = statistics.median(times[2:])
    x, labels, targets = trainer.objective.inputs(next(batches), 0)  # gradients to measure the check on
    with trainer.compute.autocast():
        trainer.optim.backward(trainer.objective.loss(trainer.model(x), labels, targets))
    params = [p for p in trainer.module.parameters() if p.grad is not None]
    grads = [p.grad for p in params]
    check_ms = per_call_ms(lambda s: bool(torch.isfinite(grad_norm(params))), 50)  # as Optimization.step does
    tracker = MlflowTracker(MlflowConfig(experiment_name="bench", outbox=str(tmp / "outbox"),
                                         tracking_uri=f"sqlite:///{tmp}/steps.db"), DistInfo())
    tracker.start(Config(), {"seed": 0}, None, tmp, "seed_cnn")
    log, one = StepLog(1, trainer.steps_per_epoch, DistInfo()), torch.tensor([2.0, 1.0, 1.0], dtype=torch.float64)

    def record(s: int) -> None:  # a sample more each time (a microsecond's add), so that each call records
        meter.sums += one
        log.after(0, s + 1, meter, 0.1, grads[0].norm(), tracker)

    record_ms = per_call_ms(record, 200)
    tracker.finish()
    every = Config().train.log_every_n_steps
    print(f"{run.model_name}, global batch {run.global_batch_size(1)}, precision {trainer.compute.precision}, "
          f"{torch.get_num_threads()} threads: {step_ms:.1f} ms a step (median of {steps - 2})")
    return [["an optimizer step (forward, backward, update, the check included)", f"{step_ms:.2f}", "100%"],
            ["the non-finite check (gradient norm, host sync), every step", f"{check_ms:.3f}",
             f"{100 * check_ms / step_ms:.2f}%"],
            ["one step record", f"{record_ms:.3f}", f"{100 * record_ms / step_ms:.2f}%"],
            [f"step records at the default (every {every} steps), per step", f"{record_ms / every:.3f}",
             f"{100 * record_ms / every / step_ms:.2f}%"]]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--steps", type=int, default=0, help="measure the per-step figures' cost over this many steps")
    args = p.parse_args()
    print_machine()
    if args.steps:
        with temp_dir("ddpipe-bench-steps-") as tmp:
            print(markdown_table(["per step", "ms", "of a step"], step_costs(args.steps, tmp)))
        return
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
        seconds = run_timed(["python", "-m", "ddpipe", "outbox", "deliver", f"mlflow.outbox={d}/outbox"],
                           env=clean_env(MLFLOW_TRACKING_URI=f"sqlite:///{tmp}/later.db"))
        outage.append(["then: ddpipe outbox deliver", f"{seconds:.1f}"])
        print(markdown_table(["2-epoch training", "wall seconds"], outage))


if __name__ == "__main__":
    os.chdir(REPO)
    main()
