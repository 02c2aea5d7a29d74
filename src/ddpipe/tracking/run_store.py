"""Where MLflow runs are stored and how ``mlflow ui`` shows them: the store's URI, the experiment (created with
the runs table's shared view), sweep parents, and the run's git tags and dataset digest.

Where runs go: ``MLFLOW_TRACKING_URI`` if set; else ``mlflow.tracking_uri``; else
``sqlite:///<repo root>/mlflow.db`` with artifacts in ``<repo root>/mlartifacts``, where the repo
root is ``$DVC_ROOT`` under DVC (so ``dvc exp run --queue/--temp`` runs, which execute in a copy,
land in the main repo's store and ``mlflow ui`` started there shows them).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from ddpipe.config.schema import MlflowConfig
from ddpipe.core.environment import REPO_ROOT_ENV
from ddpipe.core.metric_names import TEST_ACCURACY, TEST_MACRO_F1
from ddpipe.core.processes import named_host_lock

# Bounded cost when a tracking server is down or slow; the user's own MLFLOW_HTTP_* settings win.
HTTP_BOUNDS = {"MLFLOW_HTTP_REQUEST_TIMEOUT": "10", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1",
               "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1"}


def bound_http_requests() -> None:
    """Set :data:`HTTP_BOUNDS` where the environment does not (before the first request to a tracking server); where
    stderr is not a terminal (a log file), also MLflow's artifact progress bars off (carriage returns in a log)."""
    for key, value in HTTP_BOUNDS.items():
        os.environ.setdefault(key, value)
    if not sys.stderr.isatty():
        os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")


def repo_root() -> Path:
    """``$DDPIPE_REPO_ROOT`` (the user's repository, set by a ddpipe.launch.cluster job for the experiment it runs in a
    workspace of its own), else ``$DVC_ROOT`` under DVC, else the nearest directory upwards holding ``dvc.yaml``,
    else cwd."""
    if os.environ.get(REPO_ROOT_ENV):
        return Path(os.environ[REPO_ROOT_ENV]).resolve()
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
    """Where ``cfg``'s runs go (:func:`store_uri` of ``mlflow.tracking_uri``)."""
    return store_uri(cfg.tracking_uri)


def store_uri(configured: str | None) -> str:
    """The tracking-URI rule, here only: ``MLFLOW_TRACKING_URI`` if set, else ``configured``, else the repository's
    sqlite file (:func:`default_store`)."""
    return os.environ.get("MLFLOW_TRACKING_URI") or configured or default_store()


def open_client(uri: str) -> Any:
    """An ``MlflowClient`` of ``uri``, whose first opening in a process creates and migrates a sqlite file: one process
    of this host at a time does that (two trainings starting at once on a fresh clone, a search's first two trials,
    would each migrate it and leave it broken). MLflow keeps the opened store for the process's later clients."""
    import mlflow

    if not uri.startswith("sqlite:"):
        return mlflow.MlflowClient(uri)
    with named_host_lock("store", uri):
        return mlflow.MlflowClient(uri)


def redact(uri: str) -> str:
    """``uri`` without a ``user:password@`` part: what may be printed, logged or written."""
    head, sep, tail = uri.partition("://")
    host, slash, path = tail.partition("/")
    return f"{head}{sep}{host.rsplit('@', 1)[1]}{slash}{path}" if sep and "@" in host else uri


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
VIEW_COLUMNS = ("attributes.`Dataset`", f"metrics.`{TEST_ACCURACY}`", f"metrics.`{TEST_MACRO_F1}`",
                "params.`effective_lr`", "params.`world_size`")


def runs_view_url(experiment_id: str, host: str = "http://127.0.0.1:5000", charts: bool = False) -> str:
    """The experiment's runs table (``charts``: its metric charts) in ``mlflow ui``."""
    mode = "&compareRunsMode=CHART" if charts else ""
    return f"{host}/#/experiments/{experiment_id}/runs?workflowType=machine_learning&viewStateShareKey={VIEW_KEY}{mode}"


def runs_view_tags() -> dict[str, str]:
    """Experiment tags that make the runs view useful at first sight (see VIEW_KEY)."""
    view = {"selectedColumns": list(VIEW_COLUMNS), "orderByKey": f"metrics.`{TEST_ACCURACY}`", "orderByAsc": False}
    return {f"mlflow.sharedViewState.{VIEW_KEY}": json.dumps(view), "mlflow.experimentKind": "custom_model_development"}


def experiment_id(mlflow: Any, name: str, uri: str) -> str:
    """The id of experiment ``name``, created with the runs view's tags (and, for a sqlite store, its artifacts
    beside the database) if it does not exist; an existing one gets the view's tags if it lacks them."""
    exp = mlflow.get_experiment_by_name(name)
    if exp is not None:
        if any(exp.tags.get(k) != v for k, v in runs_view_tags().items()):
            for key, value in runs_view_tags().items():
                mlflow.MlflowClient(uri).set_experiment_tag(exp.experiment_id, key, value)
        return exp.experiment_id
    location = None
    if uri.startswith("sqlite:///"):
        # Artifacts beside the sqlite file (<repo root>/mlartifacts for the default store), not under
        # ./mlruns of whatever (possibly temporary) directory the process runs in.
        location = (Path(uri[len("sqlite:///"):]).resolve().parent / "mlartifacts").as_uri()
    try:
        return mlflow.create_experiment(name, artifact_location=location, tags=runs_view_tags())
    except Exception:  # created meanwhile by a parallel experiment
        return mlflow.get_experiment_by_name(name).experiment_id


def find_sweep_parent(client: Any, experiment: str, name: str) -> Any:
    """The parent run of sweep ``name`` (the oldest, if a race ever made two), or None."""
    runs = client.search_runs([experiment], filter_string=f"tags.`ddpipe.sweep_parent` = 'true' AND "
                              f"tags.`ddpipe.sweep` = '{name}'", order_by=["attributes.start_time ASC"])
    return runs[0] if runs else None


def sweep_parent(client: Any, uri: str, experiment: str, name: str) -> str:
    """The parent run of sweep ``name`` in ``experiment``, created by the first child that starts. A lock on this
    host makes it one parent when children start together (``dvc queue start -j N`` runs every child of a sweep
    on the host that queued them).

    Written to the store directly, as part of creating the child's run: the tracker calls this when it creates the
    run at once, and the outbox's delivery when it sends a run's pending ``create`` record (a store that does not
    answer leaves that record waiting, and the parent is made when it goes). It is no outbox record of its own
    because the child needs the parent's id before the child exists."""
    with named_host_lock("sweep", uri, experiment, name):
        found = find_sweep_parent(client, experiment, name)
        if found is not None:
            return found.info.run_id
        parent = client.create_run(experiment, run_name=name, tags={
            "ddpipe.sweep": name, "ddpipe.sweep_parent": "true", **git_tags(),
            "ddpipe.end_reason": "a sweep's parent: its children are the trainings"})
        client.set_terminated(parent.info.run_id, "FINISHED")
        return parent.info.run_id


def git_tags() -> dict[str, str]:
    """The checkout's commit and whether tracked files differ from it."""
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


def dvc_hash(directory: str | Path) -> str:
    """DVC's hash of a directory (``<md5>.dir``, as in dvc.lock), computed the way DVC does."""
    from dvc.fs import LocalFileSystem
    from dvc_data.hashfile.build import build
    from dvc_data.hashfile.db.local import LocalHashFileDB

    fs = LocalFileSystem()
    with tempfile.TemporaryDirectory() as scratch:
        _, _, obj = build(LocalHashFileDB(fs, scratch), str(directory), fs, "md5", dry_run=True)
    return obj.hash_info.value
