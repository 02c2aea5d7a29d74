"""The export stage's figures for BENCHMARKS.md: accuracy, agreement, size and CPU latency of PyTorch eager, ONNX
Runtime fp32 and INT8, from an export run in a scratch directory.

    python bench/export.py fmnist  OUT   # the default network on Fashion-MNIST (a short training: see --help)
    python bench/export.py resnet18 OUT  # resnet18 on the generated 224 px folder (bench/imageset.py)
    python bench/export.py resnet18 OUT --images 3000 --classes 10 --epochs 4   # a resnet18 that has learnt

Each prints one Markdown row per format; the stage's own files are OUT/export.json (its DVC metrics) and
OUT/export_host.json (the latencies and the host's load).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("fetch", "prepare", "train_worker", "evaluate", "export")
sys.path.insert(0, str(ROOT))


def paths(out: Path) -> list[str]:
    from tests.conftest import tiny_overrides

    return [a for a in tiny_overrides(out) if not a.startswith(("num_epochs", "model.width", "train.batch_size",
                                                                "train.eval_batch", "train.model_epoch"))]


def rows(metrics: dict, label: str) -> str:
    m = metrics["export"]
    out = []
    for name, runtime in (("pytorch", "PyTorch eager"), ("onnx", "ONNX Runtime fp32"), ("int8", "ONNX Runtime INT8")):
        if name not in m:
            continue
        f, lat = m[name], m[name]["latency_ms"]
        size = f"{f['size_mb']:.1f}" if "size_mb" in f else "-"
        out.append(f"| {label} | {runtime} | {f['accuracy']:.4f} | {f['agreement']:.4f} | {size} | "
                   + " | ".join(f"{lat[b]['p50']:.1f} / {lat[b]['p99']:.1f}" for b in lat) + " |")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("case", choices=("fmnist", "resnet18"))
    parser.add_argument("out", type=Path)
    parser.add_argument("--epochs", type=int, default=None, help="training epochs (default: fmnist 2, resnet18 1)")
    parser.add_argument("--train-samples", type=int, default=8192, help="fmnist: training images (default 8192)")
    parser.add_argument("--images", type=int, default=600, help="resnet18: generated images in all (default 600)")
    parser.add_argument("--classes", type=int, default=3, help="resnet18: generated classes (default 3)")
    parser.add_argument("--stages", default=",".join(STAGES),
                        help="the stages to run, e.g. fetch,prepare,train_worker on a GPU host and "
                             "fetch,prepare,evaluate,export here with its OUT/model.pt (default: all)")
    parser.add_argument("--train", nargs="*", default=[], help="more key=value for every stage, e.g. "
                        "train.batch_size_per_rank=128")
    args = parser.parse_args()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    common = [*paths(out), "export.latency_runs=20", "mlflow.log_model=false"]
    if args.case == "fmnist":
        extra = ["data.source_dir=/usr/share/datasets/fashion-mnist", f"data.max_train_samples={args.train_samples}",
                 f"num_epochs={args.epochs or 2}"]
    else:
        from bench.imageset import generate

        folder = generate(out / "imgs", args.images, args.classes)
        extra = ["data.dataset=imagefolder", f"data.source_dir={folder}", "model.name=resnet18",
                 "export.max_int8_accuracy_drop=1.0", f"num_epochs={args.epochs or 1}", "train.batch_size_per_rank=32"]
    stages = args.stages.split(",")
    if unknown := [s for s in stages if s not in STAGES]:
        parser.error(f"--stages: {', '.join(unknown)} not among {', '.join(STAGES)}")
    for stage in stages:
        subprocess.run([sys.executable, f"stages/{stage}.py", *common, *extra, *args.train], cwd=ROOT, check=True)
    if "export" not in stages:
        return
    from ddpipe.export.stage import merge

    print(rows(merge(*(json.loads((out / name).read_text()) for name in ("export.json", "export_host.json"))),
               args.case))


if __name__ == "__main__":
    main()
