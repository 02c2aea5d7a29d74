"""The export stage: graphs made, checked, and put in place together or not at all.

Every check that needs no work comes first (the opset, the model file, the prepared data and its calibration split).
The graphs are written into a staging directory beside ``paths.onnx``, scored (``ddpipe.export.check``) and timed;
only when every format passed its threshold do they replace the previous export's files, ``paths.export_host`` (what
this host measured) then ``paths.export_metrics`` (what the run's parameters determine, :func:`split`) last. A format
that fails raises :class:`ExportCheckFailed` saying which and by how much, and leaves the previous files as they were
(dvc.yaml declares them ``persist: true``: DVC would otherwise delete them before the stage runs). Passed or failed,
the result goes to the training's MLflow run and its registered version; the champion alias moves only after a pass
(``ddpipe.tracking.champion.record_export``).
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ddpipe.config.schema import Config, ConfigError
from ddpipe.core.devices import cpu_int8_kind
from ddpipe.core.files import atomic_write_json
from ddpipe.core.metric_names import MODEL_VAL_ACCURACY, VAL_SPLIT
from ddpipe.data.loaders import BatchKey, Splits
from ddpipe.data.store import PreparedDataError, load_meta
from ddpipe.distributed.host_leases import cpu_share
from ddpipe.engine.evaluation import TestSplit
from ddpipe.engine.resolved import eval_batch_size, int8_target
from ddpipe.export.check import HostLoad, latency, score
from ddpipe.export.graph import export_onnx
from ddpipe.export.int8 import CALIBRATION_BATCH, quantize
from ddpipe.models.onnx_served import OnnxClassifier
from ddpipe.models.served import ImageClassifier
from ddpipe.tracking.champion import split_digest
from ddpipe.tracking.outbox import read_run_info
from ddpipe.tracking.tracker import RunLogger

logger = logging.getLogger(__name__)

# What a run's parameters do not determine: this host's timings and load while timing, its kernels' rounding (the
# largest probability difference), its share of the cores, its CPU. In the DVC metrics they would make two runs of one
# model differ in `dvc exp show --only-changed` and `dvc metrics diff`; they go to paths.export_host instead.
HOST_FIGURES = ("max_prob_diff", "latency_ms")  # each format's
HOST_STATE = ("threads", "latency_host", "cpu_vnni")  # the export's


class ExportCheckFailed(RuntimeError):
    """A format's check fell below its threshold: nothing of this export was put in place."""


def check_before_work(cfg: Config) -> None:
    """What can be refused before any work: an opset the installed exporter does not write, a model file or prepared
    data that is missing, a calibration split with no images."""
    import onnx

    newest = onnx.defs.onnx_opset_version()
    if cfg.export.opset > newest:
        raise ConfigError(f"export.opset = {cfg.export.opset} is not accepted; the installed onnx "
                          f"{onnx.__version__} writes opsets 18 to {newest}")
    if not Path(cfg.paths.model).is_file():
        raise FileNotFoundError(f"{cfg.paths.model}: missing; run the train stage first (dvc repro train)")
    meta = load_meta(cfg.paths.prepared)
    if cfg.export.int8 and meta.sizes.get(cfg.export.calibration_split, 0) == 0:
        raise PreparedDataError(f"export.calibration_split = {cfg.export.calibration_split!r}: {cfg.paths.prepared} "
                                "holds no image of that split to calibrate the INT8 copy on")


def export(cfg: Config) -> dict:
    """Make, check and put in place every format of ``cfg.export``; its figures (``paths.export_metrics`` and
    ``paths.export_host`` merged: :func:`split`). Its CPU threads: its share of the host
    (:func:`ddpipe.distributed.host_leases.cpu_share`), recorded (``threads``)."""
    check_before_work(cfg)
    with cpu_share(cfg.distributed.threads_per_process) as threads:
        return _export(cfg, threads)


def _export(cfg: Config, threads: int) -> dict:
    classifier = ImageClassifier.load(cfg.paths.model)
    targets = {"onnx": Path(cfg.paths.onnx), **({"int8": Path(cfg.paths.onnx_int8)} if cfg.export.int8 else {})}
    Path(cfg.paths.onnx).parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=Path(cfg.paths.onnx).parent, prefix=".export-") as tmp:
        staged = {name: Path(tmp) / path.name for name, path in targets.items()}
        export_onnx(classifier.model, classifier.saved, staged["onnx"], cfg.export.opset)
        logger.info(f"export: {cfg.paths.onnx} written ({staged['onnx'].stat().st_size / 1e6:.1f} MB); checking")
        cpu, here = int8_target(cfg.export.int8_cpu), cpu_int8_kind()
        if "int8" in staged:
            quantize(staged["onnx"], staged["int8"], calibration_batches(cfg, classifier), cpu)
            if cpu != here:
                logger.info(f"note: the INT8 copy is made for {cpu} CPUs (export.int8_cpu) and checked here on a "
                            f"{here} CPU: its figures are this CPU's answers")
        metrics = measure(cfg, classifier, staged, threads)
        metrics["export"]["cpu_vnni"] = here == "x86-vnni"
        if "int8" in staged:
            metrics["export"]["int8"]["made_for"] = cpu
        failures = verdict(cfg, metrics)
        _log_to_run(cfg, metrics, failures, staged)
        if failures:
            kept = ", ".join(str(p) for p in [*targets.values(), Path(cfg.paths.export_host),
                                           Path(cfg.paths.export_metrics)] if p.exists())
            raise ExportCheckFailed("; ".join(failures) + ". Nothing was written" +
                                    (f"; the previous export stays in place ({kept})" if kept else ""))
        for name, path in targets.items():
            os.replace(staged[name], path)
    if cfg.paths.onnx_int8 and not cfg.export.int8:
        Path(cfg.paths.onnx_int8).unlink(missing_ok=True)  # a stale copy of an earlier model must not linger
    compared, host = split(metrics)
    atomic_write_json(cfg.paths.export_host, host)
    atomic_write_json(cfg.paths.export_metrics, compared)
    return metrics


def split(figures: dict) -> tuple[dict, dict]:
    """:func:`export`'s figures as the DVC metrics (``paths.export_metrics``: each format's accuracy, agreement, size)
    and this host's (``paths.export_host``: :data:`HOST_FIGURES` and :data:`HOST_STATE`), each ``{"export": ...}``;
    :func:`merge` of the two gives them back."""
    compared, host = {}, {}
    for key, value in figures["export"].items():
        if key in HOST_STATE:
            host[key] = value
        elif isinstance(value, dict):  # a format's figures
            compared[key] = {k: v for k, v in value.items() if k not in HOST_FIGURES}
            host[key] = {k: v for k, v in value.items() if k in HOST_FIGURES}
        else:
            compared[key] = value
    return {"export": compared}, {"export": host}


def merge(compared: dict, host: dict) -> dict:
    """The two files of an export (:func:`split`) as its whole figures."""
    whole = {**host["export"], **compared["export"]}
    for key, value in compared["export"].items():
        if isinstance(value, dict):
            whole[key] = {**value, **host["export"].get(key, {})}
    return {"export": whole}


def calibration_batches(cfg: Config, classifier: ImageClassifier):  # noqa: ANN201
    """uint8 batches of ``export.calibration_images`` images of ``export.calibration_split`` (a seeded sample), in
    the evaluation's view (no augmentation), at the graph's input size."""
    meta = load_meta(cfg.paths.prepared)
    split = cfg.export.calibration_split
    n = meta.sizes[split]
    chosen = np.sort(np.random.default_rng(cfg.seed).choice(n, min(n, cfg.export.calibration_images), replace=False))
    splits = Splits(cfg.paths.prepared, meta, (split,), list(classifier.image_size), eval_crop=classifier.eval_crop)
    for a in range(0, len(chosen), CALIBRATION_BATCH):
        key = BatchKey(split, None, torch.as_tensor(chosen[a:a + CALIBRATION_BATCH], dtype=torch.long))
        yield splits.__getitems__(key)[0].numpy()


def measure(cfg: Config, classifier: ImageClassifier, graphs: dict[str, Path], threads: int) -> dict:
    """Each format's (and PyTorch's) accuracy, agreement, largest probability difference, size and latency."""
    test = TestSplit(cfg, classifier)
    try:
        batch = eval_batch_size(cfg.train, torch.device("cpu"), classifier.image_size[0])
        scores = score(lambda: test.batches(batch), classifier, graphs, threads)
        sample = next(iter(test.batches(max(cfg.export.latency_batch_sizes))))[0].numpy()
    finally:
        test.close()
    sizes, runs = list(cfg.export.latency_batch_sizes), cfg.export.latency_runs
    timed = {}
    if runs:  # 0: not timed (a check that reads no latency pays for none)
        with HostLoad() as load:
            scores["pytorch"].latency_ms = latency(classifier.probabilities, sample, sizes, runs)
            for name, path in graphs.items():
                scores[name].latency_ms = latency(OnnxClassifier(path, threads).probabilities, sample, sizes, runs)
        timed = {"latency_host": (host := load.figures())}
        if host.get("busy"):
            logger.info(f"note: the latencies were timed while other processes kept {host['others_busy_cores']} "
                        "core(s) busy: the host's, not the model's alone (marked busy in the metrics)")
    out = {name: scores[name].metrics(graphs.get(name)) for name in ("pytorch", *graphs)}
    out["pytorch"].update(agreement=1.0, max_prob_diff=0.0)
    return {"export": {**out, "num_samples": scores["pytorch"].count, "threads": threads, **timed}}


def verdict(cfg: Config, metrics: dict) -> list[str]:
    """What fell below its threshold, each in words with the figure and the threshold; empty when all passed."""
    m, failures = metrics["export"], []
    onnx_agree, least = m["onnx"]["agreement"], cfg.export.min_agreement
    if onnx_agree < least:
        failures.append(f"onnx: top-1 agrees with the PyTorch model on {onnx_agree:.2%} of {m['num_samples']} test "
                        f"images, below export.min_agreement = {least:.2%} ({(least - onnx_agree) * 100:.2f} points "
                        "short)")
    if "int8" in m:
        drop, most = m["pytorch"]["accuracy"] - m["int8"]["accuracy"], cfg.export.max_int8_accuracy_drop
        if drop > most:
            failures.append(f"int8: test accuracy {m['int8']['accuracy']:.2%} is {drop * 100:.2f} points below the "
                            f"PyTorch model's {m['pytorch']['accuracy']:.2%}, more than export.max_int8_accuracy_drop "
                            f"= {most * 100:.2f} points")
    return failures


def _log_to_run(cfg: Config, metrics: dict, failures: list[str], graphs: dict[str, Path]) -> None:
    """The check's figures (and, when it passed, the graphs) into the training's run and its registered version."""
    run_info = Path(cfg.paths.run_info)
    run_id = read_run_info(run_info).get("run_id") if run_info.is_file() else ""
    if not run_id:
        logger.info(f"note: no MLflow run recorded in {run_info}; the export's check is in {cfg.paths.export_metrics} "
                    "only")
        return
    m = metrics["export"]
    figures = {f"{name}_{key}": round(m[name][key], 6) for name in graphs for key in ("accuracy", "agreement")}
    tracker = RunLogger(cfg.mlflow, run_id)
    tracker.log_metrics({f"export_{key}": value for key, value in figures.items()})
    made_for = {"int8_made_for": m["int8"]["made_for"]} if "int8" in m else {}  # a tag of the version, not a metric
    registered = cfg.mlflow.registered_model_name if cfg.mlflow.log_model else None
    tracker.log_champion("export", graphs={} if failures else {k: str(v) for k, v in graphs.items()},
                         model_name=registered, alias=cfg.mlflow.champion_alias, passed=not failures,
                         log_model=cfg.mlflow.log_model,
                         why="; ".join(failures), figures={**figures, **made_for}, **_selection_figures(cfg))
    tracker.close()


def _selection_figures(cfg: Config) -> dict[str, Any]:
    """What the champion alias is decided by (ddpipe.tracking.champion.decide): the exported model's validation
    accuracy (the train stage's ``model_val_accuracy``), the validation split's digest, and the test's veto."""
    train = json.loads(Path(cfg.paths.train_metrics).read_text()).get("train", {}) \
        if Path(cfg.paths.train_metrics).is_file() else {}
    return {MODEL_VAL_ACCURACY: train.get(MODEL_VAL_ACCURACY), VAL_SPLIT: split_digest(cfg.paths.prepared, "val"),
            "max_test_drop": cfg.mlflow.champion_max_test_drop}
