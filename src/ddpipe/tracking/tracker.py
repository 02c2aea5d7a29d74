"""The MLflow run of a training, on global rank 0, and a do-nothing tracker on every other rank.

One training is one MLflow run at any world size. The training loop calls the tracker unconditionally.
Tracking never kills, hangs or slows training: every record goes first to the run's outbox on disk and a courier
thread delivers it in order (``ddpipe.tracking.outbox``), so a store that is down or slow delays records and loses none;
only the run's creation is asked of the store at once, bounded by short HTTP timeouts (a store that does not
answer then gets a pending key and the run is created later). A store that refuses for good (an invalid
experiment) turns tracking off with one warning. It records; it writes none of the train stage's outputs
(``ddpipe.engine.stage_outputs`` does); the other ranks learn its run id from the trainer (``ddpipe.distributed``).

A run's status says how it ended: FINISHED; FAILED (an exception) or KILLED (SIGINT, or preempted by SIGTERM/
SIGUSR1), with the reason in the tag ``ddpipe.end_reason``. A process killed outright (SIGKILL, a lost node) leaves
its run RUNNING and a marker file in ``paths.checkpoints``: the next attempt reopens that run when it resumes the
run's checkpoint, and otherwise closes it as FAILED, saying why. A reopened run gets each metric step once: what the
resumed attempt logs again (the steps re-run from its checkpoint, the checkpoint's last validation) is dropped at
delivery where the store holds that key's step already (``ddpipe.tracking.delivery``), whichever host resumes. Where
runs go: ``ddpipe.tracking.run_store``.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import socket
import time
import warnings
from pathlib import Path
from typing import Any

from ddpipe import __version__
from ddpipe.config.schema import Config, MlflowConfig
from ddpipe.core.environment import CLUSTER_JOB_ENV, CLUSTER_LOG_ENV
from ddpipe.core.errors import one_line
from ddpipe.core.exits import Preempted, StoreAway, TrialPruned
from ddpipe.core.files import atomic_write_json
from ddpipe.core.lockfile import environment_tags
from ddpipe.core.processes import alive_here, this_process
from ddpipe.core.ranks import DistInfo
from ddpipe.data.store import load_meta
from ddpipe.tracking.delivery import is_transient
from ddpipe.tracking.outbox import Courier, Journal, describe, finished, new_key, outbox_root, removal_lock
from ddpipe.tracking.run_store import (
    bound_http_requests,
    dvc_hash,
    experiment_id,
    git_tags,
    open_client,
    redact,
    repo_root,
    runs_view_url,
    sweep_parent,
    tracking_uri,
)

logger = logging.getLogger(__name__)

# A run of an experiment that ddpipe cluster sent to a scheduler: its job and the log a person reads
CLUSTER_TAGS = {"ddpipe.cluster.job": CLUSTER_JOB_ENV, "ddpipe.cluster.log": CLUSTER_LOG_ENV}


def end_reason(exc: BaseException) -> tuple[str, str]:
    """(MLflow status, the ``ddpipe.end_reason`` tag) for a training that ends by raising ``exc``."""
    if isinstance(exc, (KeyboardInterrupt, TrialPruned)):  # pruned: a search's pruner stopped it after an epoch
        return "KILLED", str(exc.code) if isinstance(exc, TrialPruned) else "interrupted by SIGINT (Ctrl-C)"
    if isinstance(exc, Preempted):
        return "KILLED", f"{exc} (a scheduler's stop, preemption or time limit, or torchrun forwarding one); " \
                         "the same command resumes from the checkpoint of that step, into this run"
    if isinstance(exc, StoreAway):  # a pause: the same command resumes from the store's newest checkpoint
        return "KILLED", f"stopped: {exc}; the same command resumes from that checkpoint, into this run"
    return "FAILED", one_line(exc, 400)


def run_name(model_name: str) -> str:
    return os.environ.get("DVC_EXP_NAME") or f"{model_name}-{time.strftime('%Y%m%d-%H%M%S')}"


class Tracker:
    """What the training loop logs to: this base does nothing at all (no run, no collective), and is what every rank
    but global rank 0 gets; :class:`MlflowTracker` records for real."""

    run_id: str | None = None
    uri = ""

    def start(self, cfg: Config, params: dict[str, Any], resume_run_id: str | None, markers: Path,
              model_name: str) -> str | None:
        return None

    def store_id(self) -> str | None:
        return self.run_id

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None: ...
    def log_model_metrics(self, metrics: dict[str, float], exported_epoch: int | None) -> None: ...
    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None: ...
    def log_model(self, model_path: Path, input_example: Any, model_name: str) -> None: ...
    def print_link(self) -> None: ...
    def finish(self) -> None: ...
    def end_after(self, exc: BaseException) -> None: ...


class MlflowTracker(Tracker):
    """MLflow through the run's outbox (``ddpipe.tracking.outbox``): every record is kept on disk and delivered in order
    by a courier thread, so logging never waits for the store and an unreachable store loses nothing."""

    def __init__(self, cfg: MlflowConfig, info: DistInfo | None = None) -> None:
        bound_http_requests()
        self.cfg, self.info = cfg, info
        self.uri = tracking_uri(cfg)
        self.enabled = True
        self.run_id: str | None = None  # the store's id, or a pending key until the store has the run
        self.experiment_id: str | None = None
        self.marker: Path | None = None
        self.journal: Journal | None = None
        self.courier: Courier | None = None

    def _warn_off(self, what: str, exc: BaseException) -> None:
        self.enabled = False
        warnings.warn(f"MLflow tracking at {redact(self.uri)} refused {what} ({describe(exc)}); training goes on "
                      "without tracking.", RuntimeWarning, stacklevel=3)

    def _open(self, key: str) -> None:
        self.journal = Journal(outbox_root(self.cfg.outbox), key, self.uri)
        self.courier = Courier(self.journal, others=True)

    def _append(self, op: str, **fields: Any) -> None:
        if self.enabled and self.journal is not None:
            self.journal.append(op, **fields)
            self.courier.poke()

    # -- the run's beginning -------------------------------------------------------------------

    def start(self, cfg: Config, params: dict[str, Any], resume_run_id: str | None, markers: Path,
              model_name: str) -> str | None:
        """Reopen ``resume_run_id`` (a resumed checkpoint's run) or start a new run with ``params`` (nested under
        the sweep's parent when ``mlflow.sweep`` is set), named after the network ``model_name``; close runs that
        killed attempts left RUNNING. The run's key: its id, or a pending key when the store did not answer (the
        run is created when it does)."""
        gone = resume_run_id and Journal(outbox_root(self.cfg.outbox), resume_run_id, self.uri, owner=False)
        if gone and not gone.resolvable():
            finished(gone)
            logger.warning(f"MLflow: the checkpoint's run {resume_run_id} was never created in the store and its "
                           f"records are gone from {outbox_root(self.cfg.outbox)}; this attempt starts a new run")
            resume_run_id = None
        if resume_run_id:
            self._open(resume_run_id)
            self._append("reopen", attempt=0)
        else:
            tags = {**self._tags(), "ddpipe.attempts": "1", "ddpipe.end_reason": "running"}
            if self.cfg.sweep:
                tags["ddpipe.sweep"] = self.cfg.sweep
            name = run_name(model_name)
            try:
                key = self._create_now(name, tags)
            except Exception as exc:  # the store's word decides: wait for it, or do without tracking
                if not is_transient(exc):
                    self._warn_off("the run's creation", exc)
                    return None
                key = new_key()
                self._open(key)
                self._append("create", experiment=self.cfg.experiment_name, run_name=name, tags=tags,
                             start_time=int(time.time() * 1000), sweep=self.cfg.sweep)
            else:
                self._open(key)
            self._append("params", params={k: "null" if v is None else v for k, v in params.items()})
            self._log_dataset(cfg)
        self.run_id = self.journal.key
        self._close_orphans(markers, keep=resume_run_id)
        self._write_marker(markers, self.run_id)
        return self.run_id

    def _create_now(self, name: str, tags: dict[str, str]) -> str:
        """The run, created in the store now (its id printed and checkpointed from the start)."""
        import mlflow

        mlflow.set_tracking_uri(self.uri)
        client = open_client(self.uri)
        self.experiment_id = experiment_id(mlflow, self.cfg.experiment_name, self.uri)
        if self.cfg.sweep:
            tags = {**tags, "mlflow.parentRunId": sweep_parent(client, self.uri, self.experiment_id, self.cfg.sweep)}
        return client.create_run(self.experiment_id, tags=tags, run_name=name).info.run_id

    def _tags(self) -> dict[str, str]:
        import torch

        info = self.info or DistInfo()
        device_name = torch.cuda.get_device_name(info.device) if info.device.type == "cuda" \
            else (platform.processor() or platform.machine())
        return {
            **git_tags(), **environment_tags(), "dvc_exp_name": os.environ.get("DVC_EXP_NAME", ""),
            "dvc_exp_baseline_rev": os.environ.get("DVC_EXP_BASELINE_REV", ""),
            **{tag: os.environ[var] for tag, var in CLUSTER_TAGS.items() if os.environ.get(var)},
            "world_size": str(info.world_size), "num_nodes": str(info.num_nodes),
            "backend": info.backend or "none", "device_type": info.device.type,
            "device_name": device_name, "torch_version": torch.__version__,
            "ddpipe_version": __version__, "host": socket.gethostname(),
        }

    def _log_dataset(self, cfg: Config) -> None:
        """The prepared data as the run's dataset input: the DVC hash of ``paths.prepared`` as its digest."""
        try:
            meta = load_meta(cfg.paths.prepared)
            digest = dvc_hash(cfg.paths.prepared)
        except Exception as exc:  # a run without its dataset input beats no run at all
            warnings.warn(f"MLflow: the dataset input of {cfg.paths.prepared} was not logged "
                          f"({type(exc).__name__}: {exc})", RuntimeWarning, stacklevel=2)
            return
        self._append("dataset", name=meta.dataset, digest=digest, source=cfg.paths.prepared, context="training",
                     tags={"dvc_path": cfg.paths.prepared, **{f"{split}_samples": str(meta.sizes[split])
                                                               for split in ("train", "val", "test")}})

    # -- markers of live attempts --------------------------------------------------------------

    def _write_marker(self, markers: Path, run_id: str) -> None:
        self.marker = Path(markers) / f"mlflow-run-{run_id}.json"
        atomic_write_json(self.marker, {"run_id": run_id, "tracking_uri": redact(self.uri), **this_process()})

    def _close_orphans(self, markers: Path, keep: str | None) -> None:
        """FAILED, with the reason, for each run a killed attempt left RUNNING (but ``keep``), after its outbox."""
        root = outbox_root(self.cfg.outbox)
        for path in sorted(Path(markers).glob("mlflow-run-*.json")):
            try:
                marker = json.loads(path.read_text())
            except (OSError, ValueError):
                path.unlink(missing_ok=True)
                continue
            if marker["run_id"] == keep:
                path.unlink(missing_ok=True)  # reopened, with a marker of its own
                continue
            if alive_here(marker):
                continue  # a live training writing into the same directory: not ours to close
            with removal_lock(root):  # not lost to a delivery of the orphan's journal that removes it meanwhile
                orphan = Journal(root, marker["run_id"], self.uri, owner=False)
                orphan.append("close_orphan", time=int(time.time() * 1000), reason=(
                    "its process was killed (SIGKILL, out of memory or a lost node) and the next "
                    f"attempt (run {self.run_id or 'new'}) did not resume it: it started fresh"))
            path.unlink(missing_ok=True)
        self.courier.poke()  # the orphans' journals go with the others (Courier(others=True))

    # -- during and after ----------------------------------------------------------------------

    def store_id(self) -> str | None:
        """The run's id in the store if known by now, else its pending key."""
        return (self.journal.run_id if self.journal is not None else None) or self.run_id

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        now = int(time.time() * 1000)
        self._append("metrics", metrics=[[k, float(v), now, step or 0] for k, v in metrics.items()])

    def log_model_metrics(self, metrics: dict[str, float], exported_epoch: int | None) -> None:
        """Figures that describe the run's logged model of ``exported_epoch`` (its validation figures, the evaluate
        stage's test figures): into the run at step 0, and at delivery linked to that model as well (its metrics in
        MLflow's Models tab: ``ddpipe.tracking.delivery.link_to_model``); the run's alone when it holds no such
        model (``mlflow.log_model`` off) or ``exported_epoch`` is None."""
        now = int(time.time() * 1000)
        link = {} if exported_epoch is None else {"model_epoch": int(exported_epoch)}
        self._append("metrics", metrics=[[k, float(v), now, 0] for k, v in metrics.items()], **link)

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        if self.enabled and self.journal is not None:
            self._append("artifact", path=self.journal.keep_file(path), artifact_path=artifact_path)

    def log_model(self, model_path: Path, input_example: Any, model_name: str) -> None:
        """``model_path`` (the network ``model_name``) into the run as the pyfunc model a client calls
        (``ddpipe.models.served.log_pyfunc``), from a copy kept in the outbox until the store has it."""
        if not (self.enabled and self.journal is not None):
            return
        import numpy as np
        example = Path(self.journal.keep_file(model_path)).with_name("input_example.npy")
        np.save(example, np.asarray(input_example))
        self._append("model", model=str(example.with_name(Path(model_path).name)), example=str(example),
                     model_name=model_name, registered_model_name=self.cfg.registered_model_name)

    def print_link(self) -> None:
        """Where to look: the run in ``mlflow ui``'s runs view (started in the repo root)."""
        if self.run_id and self.experiment_id:
            logger.info(f"MLflow run {self.run_id}: run `mlflow ui` in {repo_root()} and open\n  "
                        f"{runs_view_url(self.experiment_id)}  (runs table)\n  "
                        f"{runs_view_url(self.experiment_id, charts=True)}  (charts)")

    def _end(self, status: str, reason: str) -> None:
        if self.run_id:
            self._append("end", status=status, reason=reason, time=int(time.time() * 1000))
        self.close()
        if self.marker is not None:
            self.marker.unlink(missing_ok=True)
            self.marker = None

    def close(self) -> None:
        """Deliver what waits (bounded), say once what could not be, and stop the courier."""
        if self.courier is not None:
            self.courier.close()
            self.courier = None

    def finish(self) -> None:
        self._end("FINISHED", "completed")

    def end_after(self, exc: BaseException) -> None:
        """Close the run as FAILED or KILLED, saying why (``ddpipe.end_reason``)."""
        self._end(*end_reason(exc))


class RunLogger(MlflowTracker):
    """Logs into an existing run without reopening it (the evaluate stage: the run keeps its status), after what
    still waits of it and of other runs in the outbox; :meth:`close` delivers."""

    def __init__(self, cfg: MlflowConfig, run_id: str) -> None:
        super().__init__(cfg)
        self.run_id = run_id
        self._open(run_id)

    def log_champion(self, op: str = "champion", **fields: Any) -> None:
        """For this run's registered version (``ddpipe.tracking.champion``): a ``champion`` or ``export`` record."""
        if self.enabled and self.journal is not None and fields.get("graphs"):
            fields["graphs"] = {name: self.journal.keep_file(path) for name, path in fields["graphs"].items()}
        self._append(op, **fields)


def make_tracker(cfg: MlflowConfig, info: DistInfo) -> Tracker:
    """MLflow on global rank 0, a do-nothing tracker on every other rank, and on every rank with ``mlflow.enabled``
    false."""
    return MlflowTracker(cfg, info) if info.is_main and cfg.enabled else Tracker()
