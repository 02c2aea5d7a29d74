"""Experiment tracking: MLflow on global rank 0, a tracker that does nothing everywhere else.

One training is one MLflow run at any world size. The training loop calls the tracker
unconditionally. Tracking never kills or hangs training: every call is bounded (short HTTP timeouts,
few retries), and after the first failure the tracker warns once and turns itself off.

Where runs go: ``MLFLOW_TRACKING_URI`` if set; else ``mlflow.tracking_uri``; else
``sqlite:///<repo root>/mlflow.db`` with artifacts in ``<repo root>/mlartifacts``, where the repo
root is ``$DVC_ROOT`` under DVC (so ``dvc exp run --queue/--temp`` runs, which execute in a copy,
land in the main repo's store and ``mlflow ui`` started there shows them).
"""

from __future__ import annotations

import os
import platform
import socket
import subprocess
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ddpipe import __version__
from ddpipe.config import Config, MlflowConfig, flatten
from ddpipe.distributed import DistInfo

# Bounded cost when a tracking server is down or slow (the user's own settings win).
os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
os.environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")


def repo_root() -> Path:
    """``$DVC_ROOT`` under DVC, else the nearest directory upwards holding ``dvc.yaml``, else cwd."""
    if os.environ.get("DVC_ROOT"):
        return Path(os.environ["DVC_ROOT"]).resolve()
    here = Path.cwd().resolve()
    for d in (here, *here.parents):
        if (d / "dvc.yaml").is_file():
            return d
    return here


def default_store() -> str:
    return f"sqlite:///{repo_root() / 'mlflow.db'}"


def tracking_uri(cfg: MlflowConfig) -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or cfg.tracking_uri or default_store()


def run_name(cfg: Config) -> str:
    return os.environ.get("DVC_EXP_NAME") or f"{cfg.model.name}-{time.strftime('%Y%m%d-%H%M%S')}"


def git_tags() -> dict[str, str]:
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], capture_output=True, text=True, timeout=10,
                                  check=True).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    commit = git("rev-parse", "HEAD")
    tags = {"git_commit": commit or "unknown"}
    if commit:
        tags["git_dirty"] = str(bool(git("status", "--porcelain", "--untracked-files=no"))).lower()
    return tags


class NullTracker:
    """The tracker on every rank but global rank 0, and when tracking is off: does nothing."""

    run_id: str | None = None

    def start(self, cfg: Config, info: DistInfo, derived: dict[str, Any]) -> None: ...
    def resume(self, run_id: str) -> None: ...
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None: ...
    def log_params(self, params: dict[str, Any]) -> None: ...
    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None: ...
    def log_text(self, text: str, artifact_file: str) -> None: ...
    def log_model(self, model: Any, input_example: Any) -> None: ...
    def finish(self, status: str = "FINISHED") -> None: ...


class MlflowTracker(NullTracker):
    """MLflow behind a guard: the first failure warns once and turns tracking off."""

    def __init__(self, cfg: MlflowConfig) -> None:
        self.cfg = cfg
        self.uri = tracking_uri(cfg)
        self.enabled = True
        self.run_id = None

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

    def _experiment(self, mlflow: Any) -> str:
        exp = mlflow.get_experiment_by_name(self.cfg.experiment_name)
        if exp is not None:
            return exp.experiment_id
        location = None
        if self.uri == default_store():
            # Artifacts beside mlflow.db, not under the (possibly temporary) working directory.
            location = (repo_root() / "mlartifacts").as_uri()
        try:
            return mlflow.create_experiment(self.cfg.experiment_name, artifact_location=location)
        except Exception:  # created meanwhile by a parallel experiment
            return mlflow.get_experiment_by_name(self.cfg.experiment_name).experiment_id

    def start(self, cfg: Config, info: DistInfo, derived: dict[str, Any]) -> None:
        def go() -> str:
            mlflow = self._client()
            exp_id = self._experiment(mlflow)
            run = mlflow.start_run(experiment_id=exp_id, run_name=run_name(cfg), tags=self._tags(info))
            params = {**flatten(cfg), **derived}
            mlflow.log_params({k: "null" if v is None else v for k, v in params.items()})
            return run.info.run_id

        self.run_id = self._call("start", go)

    def resume(self, run_id: str) -> None:
        def go() -> str:
            mlflow = self._client()
            return mlflow.start_run(run_id=run_id).info.run_id

        self.run_id = self._call("resume", go)

    def _tags(self, info: DistInfo) -> dict[str, str]:
        import torch

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

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self._call("log_metrics", lambda: self._client().log_metrics(metrics, step=step))

    def log_params(self, params: dict[str, Any]) -> None:
        self._call("log_params", lambda: self._client().log_params(params))

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        self._call("log_artifact", lambda: self._client().log_artifact(str(path), artifact_path))

    def log_text(self, text: str, artifact_file: str) -> None:
        self._call("log_text", lambda: self._client().log_text(text, artifact_file))

    def _has_model(self, mlflow: Any) -> bool:
        """Whether this run already holds a completely logged ``model`` (a re-run of a finished
        training, e.g. ``dvc repro`` after a code-only change, rewrites its outputs from the last
        checkpoint and must not log a second copy)."""
        experiment_id = mlflow.get_run(self.run_id).info.experiment_id
        found = mlflow.search_logged_models(
            experiment_ids=[experiment_id], output_format="list",
            filter_string=f"source_run_id = '{self.run_id}' AND name = 'model'")
        return any(str(m.status).upper().endswith("READY") for m in found)

    def log_model(self, model: Any, input_example: Any) -> None:
        def go() -> None:
            import mlflow.pytorch
            import torch
            from mlflow.models import infer_signature

            if self._has_model(mlflow):
                print(f"MLflow run {self.run_id} already holds this model; not logging it again", flush=True)
                return
            with torch.no_grad():
                output = model(torch.from_numpy(input_example)).numpy()
            mlflow.pytorch.log_model(
                model, name="model", input_example=input_example,
                signature=infer_signature(input_example, output),
                serialization_format="pickle",  # runs on any batch size (pt2 fixes the example's)
                pip_requirements=[f"torch=={torch.__version__.split('+')[0]}", f"ddpipe=={__version__}"],
                code_paths=[str(Path(__file__).parent)],
            )

        self._call("log_model", go)

    def finish(self, status: str = "FINISHED") -> None:
        self._call("finish", lambda: self._client().end_run(status=status))


def make_tracker(cfg: MlflowConfig, info: DistInfo) -> NullTracker:
    """MLflow on global rank 0, a do-nothing tracker on every other rank."""
    return MlflowTracker(cfg) if info.is_main else NullTracker()




