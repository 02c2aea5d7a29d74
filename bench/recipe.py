"""The recipe's ablation, as torchvision's "how to train state-of-the-art models" blog measured it: each step added
to the one before (or with ``--alone``, each step alone on the first row, then the best ones together), its
test accuracy at the same wall time, mean ± std over seeds; and class weights on an imbalanced folder.

    python bench/recipe.py folder [--alone] [--images 3000] [--seeds 3] [--epochs 30]  # generated folder, 64 px
    python bench/recipe.py fashion [--alone] [--seeds 3] [--epochs 10]                 # Fashion-MNIST, the default
    python bench/recipe.py imbalance [--images 3000] [--seeds 3] [--epochs 30]         # one class 10x each other

Same wall time: the first row (the folder: ImageNet's views; Fashion-MNIST: the defaults) trains ``--epochs``
epochs; every row's seconds per epoch are measured first (twice, the faster kept, after the loader's warm-up),
and each row then trains as many epochs as fit in the first row's time (at least one). Each run is the train and
evaluate stages with the repository's params.yaml plus the row's keys; test accuracy from the evaluate stage.
Prints the machine and Markdown tables; appends every run to bench/results/recipe.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

from common import RESULTS, append_jsonl, markdown_table, print_machine, run_timed, temp_dir
from imageset import generate

# The encoded images' views before the recipe's preset (ddpipe.engine.resolved.RECIPE_PRESETS): ImageNet's
IMAGENET_VIEWS = ["data.eval_crop_ratio=0.875", "train.min_crop_scale=0.08", "data.eval_image_size=null"]
# (row, its keys): each row adds its keys to those of the rows above it
FOLDER_ROWS = [
    ("ImageNet's views", IMAGENET_VIEWS),
    ("+ no weight decay on norms and biases", ["train.wd_norm_bias=false"]),
    ("+ EMA of the weights (0.99)", ["train.ema_decay=0.99"]),
    ("+ TrivialAugmentWide", ["train.auto_augment=trivialaugment"]),
    ("+ MixUp 0.2 / CutMix 1.0", ["train.mixup_alpha=0.2", "train.cutmix_alpha=1.0"]),
    ("+ RandomErasing 0.25", ["train.random_erasing=0.25"]),
    ("+ FixRes: evaluated at 72 px", ["data.eval_image_size=72"]),
]
# (row, its keys), each alone on ImageNet's views; the last row: the steps that measured better, together, which
# are today's defaults (the encoded images' preset)
FOLDER_ALONE = [
    ("ImageNet's views", IMAGENET_VIEWS),
    ("EMA of the weights (0.99)", [*IMAGENET_VIEWS, "train.ema_decay=0.99"]),
    ("FixRes: evaluated at 72 px", [*IMAGENET_VIEWS, "data.eval_image_size=72"]),
    ("evaluation crop: the whole shorter side", [*IMAGENET_VIEWS, "data.eval_crop_ratio=1.0"]),
    ("training crop: min_crop_scale 0.35", [*IMAGENET_VIEWS, "train.min_crop_scale=0.35"]),
    ("the three above together: today's defaults", []),
]
FASHION_ROWS = [
    ("today's defaults", []),
    ("+ no weight decay on norms and biases", ["train.wd_norm_bias=false"]),
    ("+ EMA of the weights (0.999)", ["train.ema_decay=0.999"]),
    ("+ MixUp 0.2 / CutMix 1.0", ["train.mixup_alpha=0.2", "train.cutmix_alpha=1.0"]),
]
FASHION_ALONE = [
    ("today's defaults", []),
    ("EMA of the weights (0.999)", ["train.ema_decay=0.999"]),
    ("MixUp 0.2 / CutMix 1.0", ["train.mixup_alpha=0.2", "train.cutmix_alpha=1.0"]),
]
FOLDER_KEYS = ["data.dataset=imagefolder", "data.image_size=64", "data.val_fraction=0.1", "data.test_fraction=0.2"]


def paths(tmp: Path) -> list[str]:
    return [f"paths.checkpoints={tmp}/ckpt", f"paths.model={tmp}/model.pt", f"paths.run_info={tmp}/run.json",
            f"paths.train_metrics={tmp}/train.json", f"paths.history={tmp}/history.csv",
            f"paths.test_metrics={tmp}/test.json", f"paths.per_class={tmp}/per_class.csv",
            f"paths.confusion={tmp}/confusion.csv", f"paths.reports={tmp}/reports",
            f"mlflow.tracking_uri=sqlite:///{tmp}/mlflow.db", f"mlflow.outbox={tmp}/outbox", "mlflow.log_model=false",
            "mlflow.log_system_metrics=false", "train.progress_bar=false"]


def stage(name: str, args: list[str]) -> float:
    if name == "train":  # what dvc.yaml runs: the launcher and its torchrun
        return run_timed([sys.executable, "-m", "ddpipe.launch", *args])
    return run_timed([sys.executable, f"stages/{name}.py", *args])


def prepared_folder(name: str, images: int, keep: dict[int, float] | None = None) -> tuple[Path, list[str]]:
    """The generated folder (bench/imageset.py; with ``keep``, each class's share kept), prepared once into
    bench/results/<name>; its data keys."""
    root = RESULTS / name
    source = root / "images"
    if not (root / "prepared" / "meta.json").is_file():
        full = RESULTS / f"imageset-{images}"
        if not (full / "class_09").is_dir():
            generate(full, images)
        if keep is None:
            source = full
        else:  # hard links: the same files, fewer of them in some classes
            for folder in sorted(full.glob("class_*")):
                files = sorted(folder.glob("img_*"))
                share = keep.get(int(folder.name[-2:]), 1.0)
                (source / folder.name).mkdir(parents=True, exist_ok=True)
                for f in files[:max(1, round(len(files) * share))]:
                    if not (source / folder.name / f.name).exists():
                        os.link(f, source / folder.name / f.name)
        stage("prepare", [*FOLDER_KEYS, f"data.source_dir={source}", f"paths.prepared={root / 'prepared'}",
                          f"paths.raw={root / 'raw'}"])
    if keep is None:
        source = RESULTS / f"imageset-{images}"
    return root / "prepared", [*FOLDER_KEYS, f"data.source_dir={source}"]


def one_run(tmp: Path, data: list[str], keys: list[str], epochs: int, seed: int) -> dict:
    args = [*paths(tmp), *data, *keys, f"num_epochs={epochs}", f"seed={seed}"]
    seconds = stage("train", args)
    seconds += stage("evaluate", args)
    test = json.loads((tmp / "test.json").read_text())["test"]
    train = json.loads((tmp / "train.json").read_text())["train"]
    per_class = (tmp / "per_class.csv").read_text().splitlines()
    return {"epochs": epochs, "seed": seed, "test_accuracy": test["accuracy"], "seconds": round(seconds, 1),
            "train_seconds": round(train["train_seconds"], 1), "exported_ema": train.get("exported_ema"),
            "per_class": per_class}


def epoch_seconds(tmp: Path, data: list[str], keys: list[str]) -> float:
    """A row's seconds per epoch: the faster of its second and third epochs (the first includes the loader's
    start; the faster, as another process's moment on a 2-core machine only ever slows one)."""
    one_run(tmp, data, keys, 3, 0)
    header, *rows = (tmp / "history.csv").read_text().splitlines()
    column = header.split(",").index("epoch_seconds")
    return min(float(row.split(",")[column]) for row in rows[1:])


def ablation(kind: str, rows: list[tuple[str, list[str]]], data: list[str], epochs: int, seeds: int,
             alone: bool = False) -> list[dict]:
    cumulative, records = [], []
    with temp_dir(f"recipe-{kind}-") as tmp:
        steps = []
        for name, keys in rows:
            cumulative = keys if alone else [*cumulative, *keys]
            steps.append((name, cumulative, epoch_seconds(tmp / f"calibrate-{len(steps)}", data, cumulative)))
        # a second pass, each row's faster kept: one pass measured a row 17% slow while another process ended
        for i, (name, keys, first) in enumerate(steps):
            again = epoch_seconds(tmp / f"calibrate-{i}-again", data, keys)
            steps[i] = (name, keys, min(first, again))
            print(f"{name}: {first:.2f} then {again:.2f} s/epoch", flush=True)
        budget = epochs * steps[0][2]
        for i, (name, keys, per_epoch) in enumerate(steps):
            row_epochs = max(1, round(budget / per_epoch))
            for seed in range(seeds):
                r = one_run(tmp / f"row{i}-s{seed}", data, keys, row_epochs, seed)
                r.update(kind=kind, row=name, keys=keys, seconds_per_epoch=per_epoch, budget_s=round(budget, 1),
                         alone=alone)
                records.append(r)
                print(f"{name} seed {seed}: {row_epochs} epochs, test accuracy {r['test_accuracy']:.4f}, "
                      f"train {r['train_seconds']:.0f} s", flush=True)
    append_jsonl("recipe", records)
    return records


def table(records: list[dict], alone: bool = False) -> str:
    rows = []
    for name in dict.fromkeys(r["row"] for r in records):
        mine = [r for r in records if r["row"] == name]
        accs = [r["test_accuracy"] for r in mine]
        std = statistics.stdev(accs) if len(accs) > 1 else 0.0
        rows.append([name, f"{mine[0]['seconds_per_epoch']:.2f}", mine[0]["epochs"],
                     f"{statistics.mean(r['train_seconds'] for r in mine):.0f}",
                     f"{statistics.mean(accs):.4f} ± {std:.4f}",
                     " ".join(f"{a:.4f}" for a in accs)])
    return markdown_table([f"step ({'alone' if alone else 'cumulative'})", "s/epoch", "epochs", "train s (mean)",
                           "test accuracy (mean ± std)", "each seed"], rows)


def recall(record: dict) -> dict[str, float]:
    header, *lines = record["per_class"]
    cols = header.split(",")
    return {row[0]: float(row[cols.index("recall")]) for row in (line.split(",") for line in lines)}


def imbalance(images: int, epochs: int, seeds: int) -> None:
    """class_00 whole, every other class a tenth: no weights against ``balanced`` class weights, and the
    balanced sampler."""
    prepared, data = prepared_folder(f"recipe-imbalanced-{images}", images, {c: 0.1 for c in range(1, 10)})
    records = []
    with temp_dir("recipe-imbalance-") as tmp:
        for arm, keys in (("none", []), ("class_weights balanced", ["train.class_weights=balanced"]),
                          ("sampler balanced", ["train.sampler=balanced"])):
            for seed in range(seeds):
                r = one_run(tmp / f"{len(records)}", [*data, f"paths.prepared={prepared}"], keys, epochs, seed)
                r.update(kind="imbalance", row=arm, keys=keys)
                records.append(r)
                rare = [v for k, v in recall(r).items() if k != "class_00"]
                print(f"{arm} seed {seed}: test accuracy {r['test_accuracy']:.4f}, rare classes' recall "
                      f"{statistics.mean(rare):.4f}, class_00's {recall(r)['class_00']:.4f}", flush=True)
    append_jsonl("recipe", records)
    rows = []
    for arm in dict.fromkeys(r["row"] for r in records):
        mine = [recall(r) for r in records if r["row"] == arm]
        rare = [statistics.mean(v for k, v in m.items() if k != "class_00") for m in mine]
        rows.append([arm, f"{statistics.mean(rare):.4f}", f"{min(rare):.4f}-{max(rare):.4f}",
                     f"{statistics.mean(m['class_00'] for m in mine):.4f}",
                     f"{statistics.mean(r['test_accuracy'] for r in records if r['row'] == arm):.4f}"])
    print(markdown_table(["loss / order", "rare classes' recall (mean)", "range", "class_00 recall",
                          "test accuracy"], rows))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kind", choices=("folder", "fashion", "imbalance"))
    parser.add_argument("--images", type=int, default=3000)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=None, help="the first row's epochs (folder 30, fashion 10)")
    parser.add_argument("--alone", action="store_true", help="each step alone on the defaults")
    args = parser.parse_args(argv)
    print_machine()
    if args.kind == "imbalance":
        imbalance(args.images, args.epochs or 30, args.seeds)
        return
    if args.kind == "folder":
        prepared, data = prepared_folder(f"recipe-folder-{args.images}", args.images)
        records = ablation("folder", FOLDER_ALONE if args.alone else FOLDER_ROWS,
                           [*data, f"paths.prepared={prepared}"], args.epochs or 30, args.seeds, args.alone)
    else:
        records = ablation("fashion", FASHION_ALONE if args.alone else FASHION_ROWS, [], args.epochs or 10,
                           args.seeds, args.alone)
    print(table(records, args.alone))


if __name__ == "__main__":
    main()
