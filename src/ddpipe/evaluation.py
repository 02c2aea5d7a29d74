"""The evaluate stage: test-split metrics, DVC metrics/plots files, images, and MLflow logging.

Writes ``paths.test_metrics`` (accuracy, loss, macro-F1, per-class precision/recall: DVC metrics),
``paths.confusion`` (one row per test image, for DVC's confusion template), and in
``paths.reports`` a confusion-matrix PNG and a grid of misclassified images; all of it is logged to
the MLflow run the train stage recorded in ``paths.run_info``.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import numpy as np
import torch

from ddpipe.config import Config
from ddpipe.data import BatchTransform, InMemoryDataset
from ddpipe.distributed import DistInfo, cpu_count
from ddpipe.fsutil import atomic_open, atomic_write_json, atomic_write_text
from ddpipe.tracking import MlflowTracker
from ddpipe.training import evaluate_split, load_model


def classification_metrics(labels: np.ndarray, preds: np.ndarray, classes: list[str]) -> dict:
    """Accuracy, macro-F1 and per-class precision/recall from true and predicted labels."""
    k = len(classes)
    cm = np.bincount(labels * k + preds, minlength=k * k).reshape(k, k)
    tp = np.diag(cm).astype(float)
    precision = np.divide(tp, cm.sum(0), out=np.zeros(k), where=cm.sum(0) > 0)
    recall = np.divide(tp, cm.sum(1), out=np.zeros(k), where=cm.sum(1) > 0)
    f1 = np.divide(2 * precision * recall, precision + recall, out=np.zeros(k), where=(precision + recall) > 0)
    return {
        "accuracy": float(tp.sum() / max(1, cm.sum())),
        "macro_f1": float(f1.mean()),
        "per_class": {c: {"precision": round(float(p), 6), "recall": round(float(r), 6)}
                      for c, p, r in zip(classes, precision, recall)},
        "confusion_matrix": cm,
    }


def evaluate(cfg: Config) -> dict:
    """Evaluate ``paths.model`` on the held-out test split and write every output."""
    torch.set_num_threads(cpu_count())
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    info = DistInfo(False, 0, 0, 1, 1, 1, device, None)
    model, payload = load_model(cfg.paths.model)
    model = model.to(device)
    test = InMemoryDataset.load(cfg.paths.prepared, "test")
    transform = BatchTransform(payload["mean"], payload["std"], 0, False, cfg.seed, device, False)
    loss, acc, logits = evaluate_split(model, test, transform, info, cfg.train.eval_batch_size_per_rank,
                                       contextlib.nullcontext, device.type == "cuda", keep_outputs=True)
    classes = payload["classes"]
    labels, preds = test.labels.numpy(), logits.argmax(1).numpy()
    m = classification_metrics(labels, preds, classes)
    assert abs(m["accuracy"] - acc) < 1e-9, "argmax accuracy disagrees with the evaluation loop"
    metrics = {"test": {"accuracy": m["accuracy"], "loss": loss, "macro_f1": m["macro_f1"],
                        "num_samples": int(len(labels)), "per_class": m["per_class"]}}
    atomic_write_json(cfg.paths.test_metrics, metrics)
    rows = ["actual,predicted"] + [f"{classes[a]},{classes[p]}" for a, p in zip(labels, preds)]
    atomic_write_text(cfg.paths.confusion, "\n".join(rows) + "\n")
    reports = Path(cfg.paths.reports)
    plot_confusion(m["confusion_matrix"], classes, reports / "confusion_matrix.png")
    plot_misclassified(test.images, labels, preds, classes, reports / "misclassified.png")
    _log_to_run(cfg, metrics["test"], reports)
    return metrics


def _log_to_run(cfg: Config, test: dict, reports: Path) -> None:
    run_info = Path(cfg.paths.run_info)
    run_id = json.loads(run_info.read_text()).get("run_id") if run_info.is_file() else ""
    if not run_id:
        print(f"note: no MLflow run recorded in {run_info}; test metrics are in {cfg.paths.test_metrics} only")
        return
    tracker = MlflowTracker(cfg.mlflow)
    tracker.resume(run_id)
    flat = {"test_accuracy": test["accuracy"], "test_loss": test["loss"], "test_macro_f1": test["macro_f1"]}
    for name, pc in test["per_class"].items():
        key = "".join(ch if ch.isalnum() else "_" for ch in name)
        flat[f"test_precision_{key}"] = pc["precision"]
        flat[f"test_recall_{key}"] = pc["recall"]
    tracker.log_metrics(flat)
    tracker.log_artifact(cfg.paths.test_metrics, "evaluation")
    for png in sorted(reports.glob("*.png")):
        tracker.log_artifact(png, "evaluation")
    tracker.finish()


def plot_confusion(cm: np.ndarray, classes: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 6))
    ax.imshow(cm, cmap="Blues")
    ax.set_xticks(range(len(classes)), classes, rotation=45, ha="right")
    ax.set_yticks(range(len(classes)), classes)
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    for (i, j), v in np.ndenumerate(cm):
        ax.text(j, i, str(v), ha="center", va="center", fontsize=7,
                color="white" if v > cm.max() / 2 else "black")
    ax.set_title(f"test accuracy {np.trace(cm) / max(1, cm.sum()):.4f}")
    _save_fig(fig, path)


def plot_misclassified(images: torch.Tensor, labels: np.ndarray, preds: np.ndarray, classes: list[str],
                       path: Path, count: int = 32) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    wrong = np.flatnonzero(labels != preds)[:count]
    cols = 8
    rows = max(1, -(-len(wrong) // cols))
    fig, axes = plt.subplots(rows, cols, figsize=(cols * 1.6, rows * 1.9), squeeze=False)
    for ax in axes.flat:
        ax.axis("off")
    for ax, i in zip(axes.flat, wrong):
        img = images[i].numpy()
        ax.imshow(img[0] if img.shape[0] == 1 else img.transpose(1, 2, 0), cmap="gray" if img.shape[0] == 1 else None)
        ax.set_title(f"true {classes[labels[i]]}\npred {classes[preds[i]]}", fontsize=6)
    fig.suptitle(f"{len(wrong)} of {int((labels != preds).sum())} misclassified test images")
    _save_fig(fig, path)


def _save_fig(fig, path: Path) -> None:
    import matplotlib.pyplot as plt

    with atomic_open(path, "wb") as f:
        fig.savefig(f, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
