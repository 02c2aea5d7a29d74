"""The MLflow run of a training, on global rank 0, and a do-nothing tracker on every other rank.

One training is one MLflow run at any world size. The training loop calls the tracker unconditionally.
Tracking never kills or hangs training: every call is bounded (short HTTP timeouts, few retries), and after
the first failure the tracker warns once and turns itself off. It records; it writes none of the train
stage's outputs (``ddpipe.outputs`` does), and the other ranks learn its run id from the trainer, through
``ddpipe.distributed``.

A run's status says how it ended: FINISHED; FAILED (an exception) or KILLED (SIGINT, or preempted by
SIGTERM/SIGUSR1), with the reason in the tag ``ddpipe.end_reason``. A process killed outright
(SIGKILL, a lost node) leaves its run RUNNING and a marker file in ``paths.checkpoints``: the next
attempt reopens that run when it resumes the run's checkpoint, and otherwise closes it as FAILED,
saying why. Where runs are stored, and how ``mlflow ui`` shows them: ``ddpipe.runstore``.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import socket
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ddpipe import __version__
from ddpipe.config import Config, MlflowConfig
from ddpipe.data.store import load_meta
from ddpipe.distributed import DistInfo
from ddpipe.fsutil import atomic_write_json
from ddpipe.preemption import Preempted
from ddpipe.procs import alive
from ddpipe.runstore import (
    bound_http_requests,
    dvc_hash,
    experiment_id,
    git_tags,
    metric,
    repo_root,
    runs_view_url,
    sweep_parent,
    tracking_uri,
)


def end_reason(exc: BaseException) -> tuple[str, str]:
    """(MLflow status, the ``ddpipe.end_reason`` tag) for a training that ends by raising ``exc``."""
    if isinstance(exc, KeyboardInterrupt):
        return "KILLED", "interrupted by SIGINT (Ctrl-C)"
    if isinstance(exc, Preempted):
        return "KILLED", f"{exc} (a scheduler's stop, preemption or time limit, or torchrun forwarding one); " \
                         "the same command resumes from the checkpoint of that step, into this run"
    detail = (str(exc).strip().splitlines() or [""])[0][:400]
    return "FAILED", f"{type(exc).__name__}: {detail}" if detail else type(exc).__name__


def run_name(cfg: Config) -> str:
    return os.environ.get("DVC_EXP_NAME") or f"{cfg.model.name}-{time.strftime('%Y%m%d-%H%M%S')}"


class NullTracker:
    """The tracker on every rank but global rank 0: does nothing at all (no run, no collective)."""

    run_id: str | None = None
    uri = ""

    def start(self, cfg: Config, params: dict[str, Any], resume_run_id: str | None, markers: Path) -> str | None:
        return None

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None: ...
    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None: ...
    def log_model(self, model_path: Path, input_example: Any, cfg: Config) -> None: ...
    def print_link(self) -> None: ...
    def finish(self) -> None: ...
    def end_after(self, exc: BaseException) -> None: ...


class MlflowTracker(NullTracker):
    """MLflow behind a guard: the first failure warns once and turns tracking off."""

    def __init__(self, cfg: MlflowConfig, info: DistInfo | None = None) -> None:
        bound_http_requests()
        self.cfg, self.info = cfg, info
        self.uri = tracking_uri(cfg)
        self.enabled = True
        self.run_id: str | None = None
        self.experiment_id: str | None = None
        self.marker: Path | None = None

    def _call(self, what: str, fn: Callable[[], Any]) -> Any:
        if not self.enabled:
            return None
        for attempt in range(5):
            try:
                return fn()
            except Exception as exc:  # tracking must never take training down
                if "database is locked" in str(exc) and attempt < 4:
                    time.sleep(0.5 * 2 ** attempt)  # two experiments sharing one sqlite file
                    continue
                self.enabled = False
                warnings.warn(
                    f"MLflow tracking at {self.uri} failed during {what} ({type(exc).__name__}: "
                    f"{str(exc).splitlines()[0][:300] if str(exc) else ''}); training goes on without "
                    "tracking.", RuntimeWarning, stacklevel=2,
                )
                return None
        return None

    def _client(self) -> Any:
        import mlflow

        mlflow.set_tracking_uri(self.uri)
        return mlflow

    # -- the run's beginning -------------------------------------------------------------------

    def start(self, cfg: Config, params: dict[str, Any], resume_run_id: str | None, markers: Path) -> str | None:
        """Reopen ``resume_run_id`` (a resumed checkpoint's run) or start a new run with ``params`` (nested under
        the sweep's parent when ``mlflow.sweep`` is set); close runs that killed attempts left RUNNING. The
        run's id, or None if MLflow failed."""

        def go() -> str:
            mlflow = self._client()
            self.experiment_id = experiment_id(mlflow, self.cfg.experiment_name, self.uri)
            self._close_orphans(mlflow, markers, keep=resume_run_id)
            if resume_run_id:
                run = mlflow.start_run(run_id=resume_run_id, log_system_metrics=False)
                attempts = int(run.data.tags.get("ddpipe.attempts", "1")) + 1
                mlflow.set_tags({"ddpipe.attempts": str(attempts), "ddpipe.end_reason": "running"})
            else:
                tags = {**self._tags(), "ddpipe.attempts": "1", "ddpipe.end_reason": "running"}
                if self.cfg.sweep:
                    parent = sweep_parent(mlflow.MlflowClient(self.uri), self.uri, self.experiment_id, self.cfg.sweep)
                    tags.update({"mlflow.parentRunId": parent, "ddpipe.sweep": self.cfg.sweep})
                run = mlflow.start_run(experiment_id=self.experiment_id, run_name=run_name(cfg), tags=tags,
                                       log_system_metrics=False)  # each node's monitor: ddpipe.sysmetrics
                mlflow.log_params({k: "null" if v is None else v for k, v in params.items()})
                try:
                    self._log_dataset(mlflow, cfg)
                except Exception as exc:  # a run without its dataset input beats no run at all
                    warnings.warn(f"MLflow: the dataset input of {cfg.paths.prepared} was not logged "
                                  f"({type(exc).__name__}: {exc})", RuntimeWarning, stacklevel=2)
            self._write_marker(markers, run.info.run_id)
            return run.info.run_id

        self.run_id = self._call("start", go)
        return self.run_id

    def _tags(self) -> dict[str, str]:
        import torch

        info = self.info or DistInfo()
        device_name = torch.cuda.get_device_name(info.device) if info.device.type == "cuda" \
            else (platform.processor() or platform.machine())
        return {
            **git_tags(),
            "dvc_exp_name": os.environ.get("DVC_EXP_NAME", ""),
            "dvc_exp_baseline_rev": os.environ.get("DVC_EXP_BASELINE_REV", ""),
            "world_size": str(info.world_size), "num_nodes": str(info.num_nodes),
            "backend": info.backend or "none", "device_type": info.device.type,
            "device_name": device_name, "torch_version": torch.__version__,
            "ddpipe_version": __version__, "host": socket.gethostname(),
        }

    def _log_dataset(self, mlflow: Any, cfg: Config) -> None:
        """The prepared data as the run's dataset input: the DVC hash of ``paths.prepared`` as its digest."""
        from mlflow.data.meta_dataset import MetaDataset
        from mlflow.data.sources import LocalArtifactDatasetSource

        meta = load_meta(cfg.paths.prepared)
        sizes = meta.sizes
        dataset = MetaDataset(LocalArtifactDatasetSource(cfg.paths.prepared), name=meta.dataset,
                              digest=dvc_hash(cfg.paths.prepared))
        mlflow.log_input(dataset, context="training", tags={
            "dvc_path": cfg.paths.prepared, "train_samples": str(sizes["train"]),
            "val_samples": str(sizes["val"]), "test_samples": str(sizes["test"])})

    # -- markers of live attempts --------------------------------------------------------------

    def _write_marker(self, markers: Path, run_id: str) -> None:
        self.marker = Path(markers) / f"mlflow-run-{run_id}.json"
        atomic_write_json(self.marker, {"run_id": run_id, "tracking_uri": self.uri,
                                        "host": socket.gethostname(), "pid": os.getpid()})

    def _close_orphans(self, mlflow: Any, markers: Path, keep: str | None) -> None:
        """FAILED, with the reason, for each run a killed attempt left RUNNING (other than ``keep``)."""
        for path in sorted(Path(markers).glob("mlflow-run-*.json")):
            try:
                marker = json.loads(path.read_text())
            except (OSError, ValueError):
                path.unlink(missing_ok=True)
                continue
            if marker["run_id"] == keep:
                path.unlink(missing_ok=True)  # reopened below, with a marker of its own
                continue
            if marker.get("host") == socket.gethostname() and alive(int(marker.get("pid", 0))):
                continue  # a live training writing into the same directory: not ours to close
            client = mlflow.MlflowClient(marker.get("tracking_uri") or self.uri)
            with contextlib.suppress(Exception):  # a run deleted meanwhile, a store gone: nothing to close
                if client.get_run(marker["run_id"]).info.status == "RUNNING":
                    client.set_tag(marker["run_id"], "ddpipe.end_reason",
                                   "its process was killed (SIGKILL, out of memory or a lost node) and the next "
                                   f"attempt (run {self.run_id or 'new'}) did not resume it: it started fresh")
                    client.set_terminated(marker["run_id"], "FAILED")
                    print(f"MLflow run {marker['run_id']} was left RUNNING by a killed training; closed as FAILED",
                          flush=True)
            path.unlink(missing_ok=True)

    # -- during and after ----------------------------------------------------------------------

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self._call("log_metrics", lambda: self._client().MlflowClient(self.uri).log_batch(
            self.run_id, metrics=[metric(k, v, step) for k, v in metrics.items()]))

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        self._call("log_artifact", lambda: self._client().MlflowClient(self.uri).log_artifact(
            self.run_id, str(path), artifact_path))

    def log_model(self, model_path: Path, input_example: Any, cfg: Config) -> None:
        """``model_path`` into the run as the pyfunc model a client calls (``ddpipe.inference.log_model``)."""
        def go() -> None:
            from ddpipe.inference import log_model  # mlflow.pyfunc: imported only when a model is logged

            log_model(self._client(), self.run_id, model_path, input_example, cfg)

        self._call("log_model", go)

    def print_link(self) -> None:
        """Where to look: the run in ``mlflow ui``'s runs view (started in the repo root)."""
        if self.run_id and self.experiment_id:
            print(f"MLflow run {self.run_id}: run `mlflow ui` in {repo_root()} and open\n  "
                  f"{runs_view_url(self.experiment_id)}  (runs table)\n  "
                  f"{runs_view_url(self.experiment_id, charts=True)}  (charts)", flush=True)

    def _end(self, status: str, reason: str) -> None:
        def go() -> None:
            mlflow = self._client()
            if mlflow.active_run() is None and self.run_id:
                mlflow.start_run(run_id=self.run_id)
            mlflow.set_tag("ddpipe.end_reason", reason)
            mlflow.end_run(status=status)

        if self.run_id:
            self._call("finish", go)
        if self.marker is not None:
            self.marker.unlink(missing_ok=True)
            self.marker = None

    def finish(self) -> None:
        self._end("FINISHED", "completed")

    def end_after(self, exc: BaseException) -> None:
        """Close the run as FAILED or KILLED, saying why (``ddpipe.end_reason``)."""
        self._end(*end_reason(exc))


class RunLogger(MlflowTracker):
    """Logs into an existing run without reopening it (the evaluate stage: the run keeps its status)."""

    def __init__(self, cfg: MlflowConfig, run_id: str) -> None:
        super().__init__(cfg)
        self.run_id = run_id


def make_tracker(cfg: MlflowConfig, info: DistInfo) -> NullTracker:
    """MLflow on global rank 0, a do-nothing tracker on every other rank."""
    return MlflowTracker(cfg, info) if info.is_main else NullTracker()
