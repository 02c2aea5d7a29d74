"""The evaluate stage: test-split metrics, DVC metrics/plots files, images, and MLflow logging.

Writes ``paths.test_metrics`` (accuracy, macro-F1, loss: the DVC metrics ``dvc exp show`` lists),
``paths.per_class`` (precision, recall and F1 per class: a DVC plot, out of the metrics table),
``paths.confusion`` (one row per test image, for DVC's confusion template), and in
``paths.reports`` a confusion-matrix PNG and a grid of misclassified images; all of it is logged to
the MLflow run the train stage recorded in ``paths.run_info``, and the registered version gets its test
accuracy (the export stage, after it, moves the champion alias).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ddpipe.config.schema import Config
from ddpipe.core.devices import cpu_count
from ddpipe.core.files import atomic_open, atomic_write_json, atomic_write_text
from ddpipe.core.metric_names import TEST_ACCURACY, TEST_LOSS, TEST_MACRO_F1
from ddpipe.data.loaders import BatchKey, Loader, Splits
from ddpipe.data.store import PreparedDataError, load_meta
from ddpipe.distributed.host_leases import cpu_share
from ddpipe.engine.resolved import eval_batch_size, loader_workers
from ddpipe.models.served import ImageClassifier
from ddpipe.tracking.champion import split_digest
from ddpipe.tracking.outbox import read_run_info
from ddpipe.tracking.tracker import RunLogger

logger = logging.getLogger(__name__)


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
        "per_class": {c: {"precision": round(float(p), 6), "recall": round(float(r), 6), "f1": round(float(f), 6)}
                      for c, p, r, f in zip(classes, precision, recall, f1)},
        "confusion_matrix": cm,
    }


def evaluate(cfg: Config) -> dict:
    """Evaluate ``paths.model`` on the held-out test split and write every output.

    Predictions come from :class:`ImageClassifier` on the CPU, the code path of the logged MLflow
    model, so a served model answers exactly what is measured here. Its CPU threads: its share of the host
    (:func:`ddpipe.distributed.host_leases.cpu_share`)."""
    with cpu_share(cfg.distributed.threads_per_process):
        return _evaluate(cfg)


def _evaluate(cfg: Config) -> dict:
    classifier = ImageClassifier.load(cfg.paths.model)
    test = TestSplit(cfg, classifier)
    batch = eval_batch_size(cfg.train, torch.device("cpu"), classifier.image_size[0])  # it runs there
    labels, preds, loss = test.predict(classifier, batch)
    classes = classifier.classes
    m = classification_metrics(labels, preds, classes)
    metrics = {"test": {"accuracy": m["accuracy"], "macro_f1": m["macro_f1"], "loss": loss,
                        "num_samples": int(len(labels))}}
    if classifier.exported_epoch is not None:
        metrics["test"]["model_epoch"] = int(classifier.exported_epoch)
    atomic_write_json(cfg.paths.test_metrics, metrics)
    atomic_write_text(cfg.paths.per_class, per_class_csv(m["per_class"]))
    rows = ["actual,predicted"] + [f"{classes[a]},{classes[p]}" for a, p in zip(labels, preds)]
    atomic_write_text(cfg.paths.confusion, "\n".join(rows) + "\n")
    reports = Path(cfg.paths.reports)
    plot_confusion(m["confusion_matrix"], classes, reports / "confusion_matrix.png")
    plot_misclassified(test.images, labels, preds, classes, reports / "misclassified.png")
    test.close()
    _log_to_run(cfg, metrics["test"], m["per_class"], reports)
    return {**metrics, "per_class": m["per_class"]}


class TestSplit:
    """The prepared test split as the saved model takes it (its input size; encoded images centre-cropped
    in the loader's workers, as in validation)."""

    def __init__(self, cfg: Config, classifier: ImageClassifier) -> None:
        meta = load_meta(cfg.paths.prepared)
        if meta.classes != classifier.classes:
            raise PreparedDataError(f"{cfg.paths.model} predicts classes {classifier.classes[:5]}..., but "
                             f"{cfg.paths.prepared} holds {meta.classes[:5]}...: train the model on this data first")
        self.splits = Splits(cfg.paths.prepared, meta, ("test",), list(classifier.image_size),
                             eval_crop=classifier.eval_crop)
        workers = loader_workers(cfg.data.num_workers, meta.encoding, torch.device("cpu"), cpu_count())
        self.loader = Loader(self.splits, workers, pin_memory=False)
        self.n = meta.sizes["test"]

    def batches(self, size: int):  # noqa: ANN201
        keys = [BatchKey("test", None, torch.arange(a, min(a + size, self.n))) for a in range(0, self.n, size)]
        return self.loader.serve(keys)

    def predict(self, classifier: ImageClassifier, batch_size: int) -> tuple[np.ndarray, np.ndarray, float]:
        """(labels, predicted labels, mean loss) over the split; held per sample as two integers, not logits."""
        labels, preds = np.zeros(self.n, dtype=np.int64), np.zeros(self.n, dtype=np.int64)
        loss_sum = 0.0
        for images, y, idx in self.batches(batch_size):
            logits = classifier.logits(images)
            loss_sum += F.cross_entropy(logits, y, reduction="none").double().sum().item()
            labels[idx.numpy()], preds[idx.numpy()] = y.numpy(), logits.argmax(1).numpy()
        return labels, preds, loss_sum / max(1, self.n)

    def images(self, indices: np.ndarray) -> torch.Tensor:
        """These samples as the model saw them (uint8), for the report."""
        return self.splits.__getitems__(BatchKey("test", None, torch.as_tensor(indices, dtype=torch.long)))[0]

    def close(self) -> None:
        self.loader.close()


def per_class_csv(per_class: dict[str, dict[str, float]]) -> str:
    """One row per class (precision, recall, F1): DVC plots it; ``dvc exp show`` keeps to the headline."""
    rows = ["class,precision,recall,f1"] + [f"{name},{v['precision']:.6f},{v['recall']:.6f},{v['f1']:.6f}"
                                            for name, v in per_class.items()]
    return "\n".join(rows) + "\n"


def _log_to_run(cfg: Config, test: dict, per_class: dict, reports: Path) -> None:
    run_info = Path(cfg.paths.run_info)
    run_id = read_run_info(run_info).get("run_id") if run_info.is_file() else ""
    if not run_id:
        logger.info(f"note: no MLflow run recorded in {run_info}; test metrics are in {cfg.paths.test_metrics} only")
        return
    tracker = RunLogger(cfg.mlflow, run_id)  # the run keeps the status the training gave it
    # the headline figures are linked to the logged model they measured as well (MLflow's Models tab)
    tracker.log_model_metrics({TEST_ACCURACY: test["accuracy"], TEST_LOSS: test["loss"],
                               TEST_MACRO_F1: test["macro_f1"]}, test.get("model_epoch"))
    flat = {}
    for name, pc in per_class.items():
        key = "".join(ch if ch.isalnum() else "_" for ch in name)
        flat[f"test_precision_{key}"] = pc["precision"]
        flat[f"test_recall_{key}"] = pc["recall"]
    tracker.log_metrics(flat)
    tracker.log_artifact(cfg.paths.test_metrics, "evaluation")
    tracker.log_artifact(cfg.paths.per_class, "evaluation")
    for png in sorted(reports.glob("*.png")):
        tracker.log_artifact(png, "evaluation")
    if cfg.mlflow.registered_model_name and cfg.mlflow.log_model:  # the alias is the export stage's to move
        tracker.log_champion(model_name=cfg.mlflow.registered_model_name, alias=None,
                             test_accuracy=test["accuracy"], split=split_digest(cfg.paths.prepared, "test"))
    tracker.close()  # delivered now, or said once where the records wait


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


def plot_misclassified(images: Callable[[np.ndarray], torch.Tensor], labels: np.ndarray, preds: np.ndarray,
                       classes: list[str], path: Path, count: int = 32) -> None:
    """A grid of the first ``count`` misclassified samples; ``images(indices)`` gives their pixels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    wrong = np.flatnonzero(labels != preds)[:count]
    shown = images(wrong) if len(wrong) else None
    cols = 8
    rows = max(1, -(-len(wrong) // cols))
    fig, axes = plt.subplots(rows, cols, figsize=(cols * 1.6, rows * 1.9), squeeze=False)
    for ax in axes.flat:
        ax.axis("off")
    for k, (ax, i) in enumerate(zip(axes.flat, wrong)):
        img = shown[k].numpy()
        ax.imshow(img[0] if img.shape[0] == 1 else img.transpose(1, 2, 0), cmap="gray" if img.shape[0] == 1 else None)
        ax.set_title(f"true {classes[labels[i]]}\npred {classes[preds[i]]}", fontsize=6)
    fig.suptitle(f"{len(wrong)} of {int((labels != preds).sum())} misclassified test images")
    _save_fig(fig, path)


def _save_fig(fig, path: Path) -> None:
    import matplotlib.pyplot as plt

    with atomic_open(path, "wb") as f:
        fig.savefig(f, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
