"""The pinned bit-check of a redesign (not a benchmark): a few short trainings that between them take every
path of the train and evaluate stages, recorded to one JSON file, so the code before and after a change that
should not change behaviour can be compared bit for bit.

    python bench/bitcheck.py record OUT.json         # in the checkout to record (run before and after)
    python bench/bitcheck.py compare BEFORE.json AFTER.json    # prints ALL EQUAL, or each difference

Each run goes through the stages' own commands (``python -m ddpipe.launch``, ``stages/evaluate.py``), its files in
the checkout's bench/results/bitcheck-work (two checkouts record at once, one thread per process). Recorded: the
sha256 of every tensor of the exported model and its other fields, the MLflow params and metrics of the run (all
but clocks, hosts and code versions), the history and train metrics (all but seconds and images/s), the test
metrics and the per-class report, the names of the checkpoints (each holds the run's fingerprint), and the
fingerprint of params.yaml's defaults.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
WORK = Path("bench/results/bitcheck-work")  # in the checkout (git-ignored); removed after each recording
sys.path.insert(0, str(REPO))

from bench.imageset import generate  # noqa: E402

# (name, processes, overrides): default auto choices; 2 ranks through shared memory with SyncBatchNorm; exact
# mode at 1 and 2; fine-tuning the first run's export (weights, normalisation, frozen body, accumulation, SGD,
# mid-epoch checkpoints); an encoded image folder (workers, random-resized crops, resize at evaluation)
RUNS: list[tuple[str, int, list[str]]] = [
    ("auto-1", 1, []),
    ("shm-2", 2, []),
    ("exact-1", 1, ["distributed.exact=true"]),
    ("exact-2", 2, ["distributed.exact=true"]),
    ("finetune-1", 1, ["model.weights={tmp}/pretrained/auto-1.pt", "train.freeze_body_epochs=1",
                       "train.body_lr_ratio=0.1", "train.grad_accum_steps=2", "train.optimizer=sgd",
                       "train.checkpoint_every_steps=3", "train.model_epoch=last"]),
    ("folder-1", 1, ["data.dataset=imagefolder", "data.source_dir={tmp}/images", "data.image_size=32",
                     "paths.prepared={tmp}/folder-prepared", "model.name=resnet_small",
                     # its 243 training images: below the batch auto picks on some CPUs (256 where AMX is)
                     "train.batch_size_per_rank=32"]),
]
# weights_sha256: the digest of the fine-tuning's weights file, the first run's model.pt, whose bytes carry the saved
# model's format version; its tensors are compared bit for bit under that run's "model"
VOLATILE = ("seconds", "images_per_s", "time", "host", "pid", "git", "version", "threads", "system/", "run_id",
            "outbox", "tracking_uri", "paths.", "weights_source", "weights_sha256", "data.source_dir", "model.weights",
            "python")


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def _stable(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in sorted(d.items()) if not any(w in k for w in VOLATILE)}


def _common(tmp: Path, out: Path) -> list[str]:
    return [f"paths.raw={tmp}/raw", f"paths.prepared={tmp}/prepared", f"paths.checkpoints={out}/ckpt",
            f"paths.model={out}/model.pt", f"paths.run_info={out}/run.json", f"paths.train_metrics={out}/train.json",
            f"paths.history={out}/history.csv", f"paths.test_metrics={out}/test.json",
            f"paths.confusion={out}/confusion.csv", f"paths.per_class={out}/per_class.csv",
            f"paths.reports={out}/reports", f"mlflow.tracking_uri=sqlite:///{tmp}/mlflow.db",
            f"mlflow.outbox={tmp}/outbox", f"paths.pretrained={tmp}/pretrained", "train.progress_bar=false",
            "num_epochs=2", "model.width=8", "data.max_train_samples=3000",
            # one thread per process, whatever else runs on the host: a recording's float sums never depend on it
            "distributed.threads_per_process=1"]


def _run(cmd: list[str]) -> None:
    done = subprocess.run([sys.executable, *cmd], cwd=REPO, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")


def _model(path: Path) -> dict[str, Any]:
    import torch

    payload = torch.load(path, map_location="cpu", weights_only=True)
    state = payload.pop("state_dict")
    payload.pop("format_version", None)  # a file's format is no behaviour: a recording from before it compares equal
    return {"tensors": {k: _sha(v.contiguous().numpy().tobytes()) for k, v in sorted(state.items())},
            "fields": json.loads(json.dumps(payload, default=str, sort_keys=True))}


def _mlflow(tmp: Path, out: Path) -> dict[str, Any]:
    from mlflow.tracking import MlflowClient

    run = MlflowClient(f"sqlite:///{tmp}/mlflow.db").get_run(json.loads((out / "run.json").read_text())["run_id"])
    return {"params": _stable(run.data.params), "metrics": _stable(run.data.metrics), "status": run.info.status}


def _rows(path: Path) -> list[dict[str, Any]]:
    with path.open() as f:
        return [_stable(row) for row in csv.DictReader(f)]


def _golden() -> str:
    from ddpipe.engine.checkpoint import run_fingerprint

    try:
        from ddpipe.config.keys import trajectory
        from ddpipe.config.load import load_config
    except ImportError:  # a checkout from before config/ was a package
        from ddpipe.config import load_config, trajectory  # type: ignore[attr-defined,no-redef]

    return run_fingerprint(trajectory(load_config([], params_file=REPO / "params.yaml")), 256, 0.003, {"sizes": [1]})


def record(out_json: Path) -> None:
    results: dict[str, Any] = {"golden_fingerprint": _golden()}
    # the runs' files lie in the checkout, named by paths relative to it (the stages run there): a path a run records
    # (model.weights, data.source_dir, which its fingerprint covers) reads the same in any checkout
    tmp, work = WORK, REPO / WORK
    shutil.rmtree(work, ignore_errors=True)
    try:
        generate(work / "images", 300, classes=4, seed=0)
        for run_name, nproc, extra in RUNS:
            out = tmp / run_name
            args = _common(tmp, out) + [x.format(tmp=tmp) for x in extra]
            prepared = next(a.split("=", 1)[1] for a in args[::-1] if a.startswith("paths.prepared="))
            if not (REPO / prepared / "meta.json").is_file():
                _run(["stages/fetch.py", *args])
                _run(["stages/prepare.py", *args])
            _run(["-m", "ddpipe.launch", *args, f"distributed.nproc_per_node={nproc}"])
            _run(["stages/evaluate.py", *args])
            out = REPO / out
            (work / "pretrained").mkdir(exist_ok=True)
            shutil.copy(out / "model.pt", work / "pretrained" / f"{run_name}.pt")
            results[run_name] = {
                "model": _model(out / "model.pt"), "mlflow": _mlflow(work, out), "history": _rows(out / "history.csv"),
                "train": _stable(json.loads((out / "train.json").read_text())["train"]),
                "test": json.loads((out / "test.json").read_text()), "per_class": _rows(out / "per_class.csv"),
                # each checkpoint is named after the run's fingerprint and its position
                "checkpoints": sorted(p.name for p in (out / "ckpt").glob("ckpt-*.pt"))}
            print(f"{run_name}: test accuracy {results[run_name]['test']['test']['accuracy']:.4f}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out_json.write_text(json.dumps(results, indent=1, sort_keys=True))


def _diff(a: Any, b: Any, where: str) -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(set(a) | set(b)) for d in _diff(a.get(k, "<absent>"), b.get(k, "<absent>"),
                                                                   f"{where}.{k}")]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _diff(x, y, f"{where}[{i}]")]
    return [] if a == b else [f"{where}: {a!r} != {b!r}"]


def _new_names(recorded: Any) -> Any:
    """A recording with renamed parameters (ddpipe.config.keys.RENAMED_KEYS) under their new names, so a recording
    made before a rename compares with one made after it: the value is what must stay equal, not the name."""
    from ddpipe.config.keys import RENAMED_KEYS

    if isinstance(recorded, dict):
        return {RENAMED_KEYS.get(k, k): _new_names(v) for k, v in recorded.items()}
    return [_new_names(v) for v in recorded] if isinstance(recorded, list) else recorded


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("record").add_argument("out", type=Path)
    cmp = sub.add_parser("compare")
    cmp.add_argument("before", type=Path)
    cmp.add_argument("after", type=Path)
    args = parser.parse_args()
    if args.command == "record":
        record(args.out)
        return
    before, after = (_new_names(json.loads(recorded.read_text())) for recorded in (args.before, args.after))
    diffs = _diff(before, after, "")
    print("\n".join(diffs) if diffs else "ALL EQUAL")
    sys.exit(1 if diffs else 0)


if __name__ == "__main__":
    main()
