"""What rank 0 shows and records of a training: MLflow, the progress bar, the outputs a finished
training leaves (model file, DVC metrics and plots); twins that do nothing on every other rank.

One training is one MLflow run at any world size. The training loop calls the tracker and the progress
bar unconditionally. Tracking never kills or hangs training: every call is bounded (short HTTP timeouts,
few retries), and after the first failure the tracker warns once and turns itself off.

A run's status says how it ended: FINISHED; FAILED (an exception) or KILLED (SIGINT, or preempted by
SIGTERM/SIGUSR1), with the reason in the tag ``ddpipe.end_reason``. A process killed outright
(SIGKILL, a lost node) leaves its run RUNNING and a marker file in ``paths.checkpoints``: the next
attempt reopens that run when it resumes the run's checkpoint, and otherwise closes it as FAILED,
saying why.

Where runs go: ``MLFLOW_TRACKING_URI`` if set; else ``mlflow.tracking_uri``; else
``sqlite:///<repo root>/mlflow.db`` with artifacts in ``<repo root>/mlartifacts``, where the repo
root is ``$DVC_ROOT`` under DVC (so ``dvc exp run --queue/--temp`` runs, which execute in a copy,
land in the main repo's store and ``mlflow ui`` started there shows them).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import platform
import socket
import subprocess
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ddpipe import __version__
from ddpipe.config import Config, MlflowConfig, flatten
from ddpipe.data.store import Prepared, load_meta
from ddpipe.distributed import DistInfo, broadcast_object
from ddpipe.fsutil import atomic_write_json, atomic_write_text
from ddpipe.models.registry import code_paths
from ddpipe.models.saved import save_model
from ddpipe.preemption import Preempted

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


def is_server(uri: str) -> bool:
    """A tracking server (many hosts may write to it), not a file on this host (sqlite, ./mlruns)."""
    return uri.split(":", 1)[0] in ("http", "https", "databricks")


# The runs table a person compares runs in. MLflow 3.17's UI opens an experiment on its GenAI overview
# unless the URL says workflowType=machine_learning (or the browser remembers its sidebar toggle; the
# experiment tag mlflow.experimentKind, which ddpipe sets too, is not read by that build), and shows no
# metric columns unless a view is selected: the experiment tag mlflow.sharedViewState.<key>, opened with
# viewStateShareKey=<key>, selects the columns below and sorts by test accuracy.
VIEW_KEY = "ddpipe"
# (the UI orders params by name: more of them push world_size off a 1920-pixel screen)
VIEW_COLUMNS = ("attributes.`Dataset`", "metrics.`test_accuracy`", "metrics.`test_macro_f1`",
                "params.`effective_lr`", "params.`world_size`")


def runs_view_url(experiment_id: str, host: str = "http://127.0.0.1:5000", charts: bool = False) -> str:
    """The experiment's runs table (``charts``: its metric charts) in ``mlflow ui``."""
    mode = "&compareRunsMode=CHART" if charts else ""
    return f"{host}/#/experiments/{experiment_id}/runs?workflowType=machine_learning&viewStateShareKey={VIEW_KEY}{mode}"


def runs_view_tags() -> dict[str, str]:
    """Experiment tags that make the runs view useful at first sight (see VIEW_KEY)."""
    view = {"selectedColumns": list(VIEW_COLUMNS), "orderByKey": "metrics.`test_accuracy`", "orderByAsc": False}
    return {f"mlflow.sharedViewState.{VIEW_KEY}": json.dumps(view), "mlflow.experimentKind": "custom_model_development"}


def dvc_hash(directory: str | Path) -> str:
    """DVC's hash of a directory (``<md5>.dir``, as in dvc.lock), computed the way DVC does."""
    from dvc.fs import LocalFileSystem
    from dvc_data.hashfile.build import build
    from dvc_data.hashfile.db.local import LocalHashFileDB

    fs = LocalFileSystem()
    with tempfile.TemporaryDirectory() as scratch:
        _, _, obj = build(LocalHashFileDB(fs, scratch), str(directory), fs, "md5", dry_run=True)
    return obj.hash_info.value


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


@dataclass
class TrainingOutputs:
    """What a finished training leaves: the exported weights and the run's metrics and history."""

    weights: dict[str, Any]
    exported_epoch: int
    metrics: dict[str, float]
    history: list[dict[str, float]]
    data: Prepared
    example_images: Any  # a few validation images (uint8, N x C x H x W): the logged model's input example


class NullTracker:
    """The tracker on every rank but global rank 0: does nothing, but takes part in ``start``'s
    broadcast of the run id (a collective every rank must join). Rank 0 always has an
    :class:`MlflowTracker`, which writes the run's outputs even when MLflow itself fails."""

    run_id: str | None = None

    def __init__(self, info: DistInfo | None = None) -> None:
        self.info = info

    def start(self, cfg: Config, derived: dict[str, Any], resume_run_id: str | None, markers: Path) -> None:
        self.run_id = broadcast_object(None, self.info) if self.info else None

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None: ...
    def save_outputs(self, cfg: Config, outputs: TrainingOutputs) -> None: ...
    def finish(self) -> None: ...
    def end_after(self, exc: BaseException) -> None: ...


class SystemMetrics:
    """MLflow's system-metrics monitor for one node, logging into ``run_id`` under ``system/node<i>/``.
    MLflow's loop publishes once per sampling interval and drops the samples of the interval it is in
    when stopped; :meth:`stop` logs those too, so a node that ran for less than one interval is on record."""

    def __init__(self, run_id: str, node: str, uri: str, resumed: bool) -> None:
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        self.node = node
        self.monitor = SystemMetricsMonitor(run_id, node_id=node, tracking_uri=uri, resume_logging=resumed)
        self.monitor.start()

    def stop(self) -> None:
        self.monitor.finish()
        try:
            tail = self.monitor.aggregate_metrics()
            if tail:
                self.monitor.publish_metrics(tail)
                self.monitor.mlflow_logger.flush()
        except Exception as exc:  # a node's metrics are not worth a failed training
            warnings.warn(f"MLflow system metrics of {self.node}: the last samples were not logged "
                          f"({type(exc).__name__}: {exc})", RuntimeWarning, stacklevel=2)


def start_system_metrics(run_id: str | None, node: str, uri: str, resumed: bool) -> SystemMetrics | None:
    """This node's :class:`SystemMetrics` into ``run_id``, or None (no run, or the monitor would not start)."""
    if not run_id:
        return None
    try:
        return SystemMetrics(run_id, node, uri, resumed)
    except Exception as exc:  # a node's metrics are not worth a failed training
        warnings.warn(f"MLflow system metrics of {node} are off ({type(exc).__name__}: {exc})",
                      RuntimeWarning, stacklevel=2)
        return None


class NodeMetricsTracker(NullTracker):
    """Local rank 0 of a node other than rank 0's, when runs go to a tracking server: this node's
    system metrics into rank 0's run (:class:`SystemMetrics`)."""

    def __init__(self, cfg: MlflowConfig, info: DistInfo) -> None:
        super().__init__(info)
        self.uri, self.system = tracking_uri(cfg), None

    def start(self, cfg: Config, derived: dict[str, Any], resume_run_id: str | None, markers: Path) -> None:
        super().start(cfg, derived, resume_run_id, markers)
        self.system = start_system_metrics(self.run_id, node_id(self.info), self.uri, resume_run_id is not None)

    def finish(self) -> None:
        if self.system is not None:
            self.system.stop()
            self.system = None

    def end_after(self, exc: BaseException) -> None:
        self.finish()


def node_id(info: DistInfo) -> str:
    """``node<i>``: the node's index in the job (system metrics are filed under ``system/node<i>/``)."""
    return f"node{info.rank // max(1, info.local_world_size)}"


class MlflowTracker(NullTracker):
    """MLflow behind a guard: the first failure warns once and turns tracking off."""

    def __init__(self, cfg: MlflowConfig, info: DistInfo | None = None) -> None:
        super().__init__(info)
        self.cfg = cfg
        self.uri = tracking_uri(cfg)
        self.enabled = True
        self.run_id = None
        self.experiment_id: str | None = None
        self.marker: Path | None = None
        self.system: SystemMetrics | None = None

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
            if any(exp.tags.get(k) != v for k, v in runs_view_tags().items()):
                for key, value in runs_view_tags().items():
                    mlflow.MlflowClient(self.uri).set_experiment_tag(exp.experiment_id, key, value)
            return exp.experiment_id
        location = None
        if self.uri.startswith("sqlite:///"):
            # Artifacts beside the sqlite file (<repo root>/mlartifacts for the default store), not under
            # ./mlruns of whatever (possibly temporary) directory the process runs in.
            location = (Path(self.uri[len("sqlite:///"):]).resolve().parent / "mlartifacts").as_uri()
        try:
            return mlflow.create_experiment(self.cfg.experiment_name, artifact_location=location,
                                            tags=runs_view_tags())
        except Exception:  # created meanwhile by a parallel experiment
            return mlflow.get_experiment_by_name(self.cfg.experiment_name).experiment_id

    # -- the run's beginning -------------------------------------------------------------------

    def start(self, cfg: Config, derived: dict[str, Any], resume_run_id: str | None, markers: Path) -> None:
        """Reopen ``resume_run_id`` (a resumed checkpoint's run) or start a new run (nested under the
        sweep's parent when ``mlflow.sweep`` is set); close runs that killed attempts left RUNNING."""

        def go() -> str:
            mlflow = self._client()
            self.experiment_id = self._experiment(mlflow)
            self._close_orphans(mlflow, markers, keep=resume_run_id)
            if resume_run_id:
                run = mlflow.start_run(run_id=resume_run_id, log_system_metrics=False)
                attempts = int(run.data.tags.get("ddpipe.attempts", "1")) + 1
                mlflow.set_tags({"ddpipe.attempts": str(attempts), "ddpipe.end_reason": "running"})
            else:
                tags = {**self._tags(), "ddpipe.attempts": "1", "ddpipe.end_reason": "running"}
                if self.cfg.sweep:
                    tags.update({"mlflow.parentRunId": self._sweep_parent(mlflow), "ddpipe.sweep": self.cfg.sweep})
                run = mlflow.start_run(experiment_id=self.experiment_id, run_name=run_name(cfg), tags=tags,
                                       log_system_metrics=False)  # this node's monitor: SystemMetrics
                params = {**flatten(cfg), **derived}
                mlflow.log_params({k: "null" if v is None else v for k, v in params.items()})
                try:
                    self._log_dataset(mlflow, cfg)
                except Exception as exc:  # a run without its dataset input beats no run at all
                    warnings.warn(f"MLflow: the dataset input of {cfg.paths.prepared} was not logged "
                                  f"({type(exc).__name__}: {exc})", RuntimeWarning, stacklevel=2)
            self._write_marker(markers, run.info.run_id)
            return run.info.run_id

        self.run_id = self._call("start", go)
        if self.cfg.log_system_metrics and self.info is not None:
            self.system = start_system_metrics(self.run_id, node_id(self.info), self.uri, resume_run_id is not None)
        if self.info is not None:
            broadcast_object(self.run_id, self.info)  # the other nodes' system metrics go into this run

    def _tags(self) -> dict[str, str]:
        import torch

        info = self.info
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

    def _sweep_parent(self, mlflow: Any) -> str:
        """The parent run of ``mlflow.sweep`` in this experiment, created by the first child that starts.
        A lock on this host makes it one parent when children start together (``dvc queue start -j N``
        runs every child of a sweep on the host that queued them)."""
        name = self.cfg.sweep
        key = hashlib.sha256(f"{self.uri}|{self.experiment_id}|{name}".encode()).hexdigest()[:16]
        with _host_lock(Path(tempfile.gettempdir()) / f"ddpipe-sweep-{key}.lock"):
            found = find_sweep_parent(mlflow.MlflowClient(self.uri), self.experiment_id, name)
            if found is not None:
                return found.info.run_id
            client = mlflow.MlflowClient(self.uri)
            parent = client.create_run(self.experiment_id, run_name=name, tags={
                "ddpipe.sweep": name, "ddpipe.sweep_parent": "true", **git_tags(),
                "ddpipe.end_reason": "a sweep's parent: its children are the trainings"})
            client.set_terminated(parent.info.run_id, "FINISHED")
            return parent.info.run_id

    # -- markers of live attempts --------------------------------------------------------------

    def _write_marker(self, markers: Path, run_id: str) -> None:
        self.marker = Path(markers) / f"mlflow-run-{run_id}.json"
        atomic_write_json(self.marker, {"run_id": run_id, "tracking_uri": self.uri,
                                        "host": socket.gethostname(), "pid": os.getpid()})

    def _drop_marker(self) -> None:
        if self.marker is not None:
            self.marker.unlink(missing_ok=True)
            self.marker = None

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
            if marker.get("host") == socket.gethostname() and _alive(int(marker.get("pid", 0))):
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
            self.run_id, metrics=[_metric(k, v, step) for k, v in metrics.items()]))

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        self._call("log_artifact", lambda: self._client().MlflowClient(self.uri).log_artifact(
            self.run_id, str(path), artifact_path))

    def _has_model(self, mlflow: Any, exported_epoch: Any) -> bool:
        """Whether this run already holds a completely logged ``model`` of the same exported epoch (a
        re-run of a finished training, e.g. ``dvc repro`` after a code-only change, rewrites its outputs
        from the last checkpoint and must not log a second copy; one with train.export changed must)."""
        run = mlflow.get_run(self.run_id)
        if run.data.tags.get("ddpipe.logged_model_epoch") != str(exported_epoch):
            return False
        experiment_id = run.info.experiment_id
        found = mlflow.search_logged_models(
            experiment_ids=[experiment_id], output_format="list",
            filter_string=f"source_run_id = '{self.run_id}' AND name = 'model'")
        return any(str(m.status).upper().endswith("READY") for m in found)

    def log_model(self, model_path: Path, input_example: Any, cfg: Config) -> None:
        """``model_path`` (``paths.model``) as a pyfunc model that a client calls with plain images
        (:mod:`ddpipe.inference`); registered as a new version when ``mlflow.registered_model_name`` is set."""

        def go() -> None:
            import mlflow.pyfunc
            import torch
            import torchvision
            from mlflow.models import ModelSignature

            from ddpipe.inference import ImageClassifier, MlflowImageClassifier, prediction_schema

            classifier = ImageClassifier.load(model_path)
            if self._has_model(mlflow, classifier.exported_epoch):
                print(f"MLflow run {self.run_id} already holds this model; not logging it again", flush=True)
                return
            info = mlflow.pyfunc.log_model(
                name="model", python_model=MlflowImageClassifier(), artifacts={"weights": str(model_path)},
                # no input schema: N x H x W and N x C x H x W, integers or [0, 1] floats are all accepted
                signature=ModelSignature(outputs=prediction_schema()), input_example=input_example,
                # ddpipe itself, and a network of the user's (model.name module:Class) with its file or package
                code_paths=[str(Path(__file__).parent), *code_paths(cfg.model.name)],
                pip_requirements=[f"torch=={torch.__version__.split('+')[0]}",
                                  f"torchvision=={torchvision.__version__.split('+')[0]}",
                                  "omegaconf", "numpy", "pandas"],
                metadata={"classes": classifier.classes, "image_size": list(classifier.image_size),
                          "num_channels": classifier.num_channels, "exported_epoch": classifier.exported_epoch,
                          "input": "uint8 pixels (N x H x W or N x C x H x W) or floats in [0, 1]",
                          "output": "label, class_index, probability, probabilities (class order)"},
                registered_model_name=cfg.mlflow.registered_model_name,
            )
            mlflow.set_tag("ddpipe.logged_model_epoch", str(classifier.exported_epoch))
            if cfg.mlflow.registered_model_name and info.registered_model_version:
                client = mlflow.MlflowClient(self.uri)
                for key, value in {"dvc_exp_name": os.environ.get("DVC_EXP_NAME", ""),
                                   "git_commit": git_tags()["git_commit"], "run_id": self.run_id}.items():
                    client.set_model_version_tag(cfg.mlflow.registered_model_name,
                                                 str(info.registered_model_version), key, value)

        self._call("log_model", go)

    def save_outputs(self, cfg: Config, outputs: TrainingOutputs) -> None:
        """Write ``paths.model``, the DVC metrics and plots files and ``paths.run_info``, then log the model."""
        paths = cfg.paths
        save_model(outputs.weights, cfg.model, asdict(outputs.data), paths.model,
                   extra={"exported_epoch": outputs.exported_epoch})
        atomic_write_json(paths.train_metrics, {"train": outputs.metrics})
        atomic_write_text(paths.history, history_csv(outputs.history))
        atomic_write_json(paths.run_info, {"run_id": self.run_id or "", "tracking_uri": self.uri})
        self.log_metrics({"best_epoch": outputs.metrics["best_epoch"], "exported_epoch": outputs.exported_epoch})
        if cfg.mlflow.log_model:
            example = outputs.example_images.numpy()  # as a client has them: uint8, N x H x W for grey
            self.log_model(Path(paths.model), example[:, 0] if example.shape[1] == 1 else example, cfg)
        self.print_link()

    def print_link(self) -> None:
        """Where to look: the run in ``mlflow ui``'s runs view (started in the repo root)."""
        if self.run_id and self.experiment_id:
            print(f"MLflow run {self.run_id}: run `mlflow ui` in {repo_root()} and open\n  "
                  f"{runs_view_url(self.experiment_id)}  (runs table)\n  "
                  f"{runs_view_url(self.experiment_id, charts=True)}  (charts)", flush=True)

    def _end(self, status: str, reason: str) -> None:
        if self.system is not None:
            self.system.stop()
            self.system = None

        def go() -> None:
            mlflow = self._client()
            if mlflow.active_run() is None and self.run_id:
                mlflow.start_run(run_id=self.run_id)
            mlflow.set_tag("ddpipe.end_reason", reason)
            mlflow.end_run(status=status)

        if self.run_id:
            self._call("finish", go)
        self._drop_marker()

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


def history_csv(history: list[dict[str, float]]) -> str:
    """The per-epoch history as CSV (``paths.history``, DVC's plots)."""
    keys = list(history[0])
    lines = [",".join(keys)] + [",".join(f"{h[k]:.6g}" for k in keys) for h in history]
    return "\n".join(lines) + "\n"


def _metric(key: str, value: float, step: int | None) -> Any:
    from mlflow.entities import Metric

    return Metric(key, float(value), int(time.time() * 1000), step or 0)


def find_sweep_parent(client: Any, experiment_id: str, name: str) -> Any:
    """The parent run of sweep ``name`` (the oldest, if a race ever made two), or None."""
    runs = client.search_runs([experiment_id], filter_string=f"tags.`ddpipe.sweep_parent` = 'true' AND "
                              f"tags.`ddpipe.sweep` = '{name}'", order_by=["attributes.start_time ASC"])
    return runs[0] if runs else None


@contextlib.contextmanager
def _host_lock(path: Path) -> Iterator[None]:
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# ---------------------------------------------------------------------------------------------
# The progress bar


class NullProgress:
    """The progress bar off rank 0, and when ``train.progress_bar`` is off: does nothing."""

    def step(self, step: int, sums: Any, seconds: float) -> None: ...
    def close(self) -> None: ...


class Progress(NullProgress):
    """tqdm over an epoch's optimizer steps, with the running loss and images/s every 10 steps."""

    def __init__(self, desc: str, total: int, initial: int, world_size: int) -> None:
        import sys

        from tqdm import tqdm

        # In a log file (DVC, CI, a cluster) every refresh is a line: refresh rarely there.
        interval = 2.0 if sys.stderr.isatty() else 30.0
        self.world_size = world_size
        self.bar = tqdm(total=total, initial=initial, desc=desc, unit="step", mininterval=interval, leave=False,
                        dynamic_ncols=True)

    def step(self, step: int, sums: Any, seconds: float) -> None:
        """``sums``: this rank's [loss sum, correct, count] so far in the epoch."""
        self.bar.update(1)
        if step % 10 == 0:
            rate = sums[2].item() * self.world_size / seconds
            self.bar.set_postfix(loss=f"{sums[0].item() / sums[2].item():.4f}", img_s=f"{rate:.0f}")

    def close(self) -> None:
        self.bar.close()


def make_progress(info: DistInfo, enabled: bool, desc: str, total: int, initial: int) -> NullProgress:
    """A progress bar of ``total`` steps starting at ``initial`` on global rank 0, a do-nothing one elsewhere."""
    return Progress(desc, total, initial, info.world_size) if enabled and info.is_main else NullProgress()


def make_tracker(cfg: MlflowConfig, info: DistInfo) -> NullTracker:
    """MLflow on global rank 0; on local rank 0 of the other nodes MLflow's system-metrics monitor when
    runs go to a tracking server (a local sqlite file must not be written from several hosts); a
    do-nothing tracker on every other rank."""
    if info.is_main:
        return MlflowTracker(cfg, info)
    if info.local_rank == 0 and cfg.log_system_metrics and is_server(tracking_uri(cfg)):
        return NodeMetricsTracker(cfg, info)
    return NullTracker(info)
