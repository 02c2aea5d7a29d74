"""Fine-tuning from an earlier experiment's exported model against training the same network from scratch.

    python bench/finetune.py                        # source 3 epochs; targets of 1 and 3 epochs, 3 seeds each
    python bench/finetune.py --seeds 1 --source-epochs 1

The source experiment trains on Fashion-MNIST's first six classes (T-shirt/top ... Sandal, every training
image) and exports its model, copied into a pretrained/ folder as a user would. The target set is the other
four classes (Shirt, Sneaker, Bag, Ankle boot), 1,024 training images: classes the source never saw, so the
6-class head is replaced by a fresh 4-class one. Each target run is the train and evaluate stages with the
repository's params.yaml (model resnet_compact, the CPU default, pinned so both arms run the same network),
from scratch or with ``model.weights`` set (and ``train.body_lr_ratio``: params.yaml's 1.0 unless
``--body-lr-ratio``); test accuracy on the
target classes' 4,000 official test images. Prints the machine and a Markdown table; appends to
bench/results/finetune.jsonl.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
from pathlib import Path

from common import REPO, append_jsonl, markdown_table, print_machine, run_timed, temp_dir

SOURCE_CLASSES = 6
TARGET_CLASSES = "[Shirt,Sneaker,Bag,Ankle boot]"


def paths(tmp: Path) -> list[str]:
    return [f"paths.raw={REPO / 'data' / 'raw'}", f"paths.prepared={tmp}/prepared", f"paths.checkpoints={tmp}/ckpt",
            f"paths.model={tmp}/model.pt", f"paths.run_info={tmp}/run.json", f"paths.train_metrics={tmp}/train.json",
            f"paths.history={tmp}/history.csv", f"paths.test_metrics={tmp}/test.json",
            f"paths.per_class={tmp}/per_class.csv", f"paths.confusion={tmp}/confusion.csv",
            f"paths.reports={tmp}/reports", f"mlflow.tracking_uri=sqlite:///{tmp}/mlflow.db",
            "mlflow.log_model=false", "mlflow.log_system_metrics=false", "train.progress_bar=false",
            "model.name=resnet_compact"]


def stage(name: str, args: list[str]) -> float:
    return run_timed([sys.executable, f"stages/{name}.py", *args])


def source_model(tmp: Path, epochs: int) -> Path:
    """The source experiment: prepared, trained, its exported model copied to <tmp>/pretrained/."""
    args = [*paths(tmp / "source"), f"data.classes={SOURCE_CLASSES}", f"num_epochs={epochs}"]
    stage("prepare", args)
    seconds = stage("train", args)
    print(f"source experiment: {SOURCE_CLASSES} classes, {epochs} epoch(s) in {seconds:.1f} s", flush=True)
    (tmp / "pretrained").mkdir()
    return Path(shutil.copy(tmp / "source" / "model.pt", tmp / "pretrained" / "source-exp.pt"))


def target_run(tmp: Path, prepared: Path, epochs: int, seed: int, weights: Path | None, ratio: float) -> dict:
    name = f"{'finetuned' if weights else 'scratch'}-e{epochs}-s{seed}"
    args = [*paths(tmp / name), f"paths.prepared={prepared}", f"num_epochs={epochs}", f"seed={seed}"]
    if weights is not None:
        args += [f"paths.pretrained={weights.parent}", f"model.weights={weights}", f"train.body_lr_ratio={ratio}"]
    seconds = stage("train", args)
    stage("evaluate", args)
    test = json.loads((tmp / name / "test.json").read_text())["test"]
    return {"arm": "fine-tuned" if weights else "from scratch", "epochs": epochs, "seed": seed,
            "test_accuracy": test["accuracy"], "train_seconds": round(seconds, 1)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--source-epochs", type=int, default=3)
    parser.add_argument("--body-lr-ratio", type=float, default=1.0)
    args = parser.parse_args(argv)
    print_machine()
    with temp_dir("finetune-") as tmp:
        weights = source_model(tmp, args.source_epochs)
        target = tmp / "target"
        stage("prepare", [*paths(target), f"data.classes={TARGET_CLASSES}", "data.max_train_samples=1024"])
        records = [target_run(tmp, target / "prepared", epochs, seed, w, args.body_lr_ratio)
                   for epochs in (1, 3) for seed in range(args.seeds) for w in (None, weights)]
    for r in records:
        r.update(source_epochs=args.source_epochs, body_lr_ratio=args.body_lr_ratio)
    append_jsonl("finetune", records)
    rows = []
    for epochs in (1, 3):
        for arm in ("from scratch", "fine-tuned"):
            accs = [r["test_accuracy"] for r in records if r["epochs"] == epochs and r["arm"] == arm]
            rows.append([arm, epochs, f"{statistics.mean(accs):.4f}", f"{min(accs):.4f}-{max(accs):.4f}", len(accs)])
    print(markdown_table(["arm", "epochs", "test accuracy (mean)", "range", "seeds"], rows))


if __name__ == "__main__":
    main()
