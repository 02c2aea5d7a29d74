"""How each kind of outbox record reaches MLflow (``ddpipe.tracking.outbox`` keeps them and says when): one sender per
record, each idempotent, consecutive metric records sent as one batch; a metrics record that describes the run's
logged model (``model_epoch``) is linked to that model as well (:func:`link_to_model`). MLflow is imported here, on
the first delivery, never by a training's import of the tracker.

A resumed training's metrics are idempotent too: its ``reopen`` reads the highest step of each metric key the run holds
in the store (whichever host resumes: the store knows, not an outbox) and keeps it beside the journal
(``<name>.steps.json``); until the attempt's ``end``, a metric at or below its key's kept step is dropped, not sent
twice (the steps re-run from the checkpoint, the checkpoint's last validation logged again:
``ddpipe.engine.loop``)."""

from __future__ import annotations

import json
import logging
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddpipe.core.errors import one_line
from ddpipe.core.files import atomic_write_json
from ddpipe.tracking.run_store import open_client

logger = logging.getLogger(__name__)

# MLflow's REST limits per log_batch request
MAX_METRICS, MAX_PARAMS = 1000, 100
# The store's answers that mean "not now" rather than "never": the records wait for it.
TRANSIENT_CODES = {"INTERNAL_ERROR", "TEMPORARILY_UNAVAILABLE", "REQUEST_LIMIT_EXCEEDED", "UNAUTHENTICATED",
                   "PERMISSION_DENIED", "DEADLINE_EXCEEDED", "ABORTED"}


@dataclass
class Delivery:
    """What one delivery did: records sent, records still waiting, and the error that stopped it."""

    sent: int
    waiting: int
    error: BaseException | None


# how SQLite's, PostgreSQL's and MySQL's drivers word a unique key already taken (MLflow passes their message on)
DUPLICATE_ROW = ("UNIQUE constraint failed", "duplicate key value violates unique constraint", "Duplicate entry")


class NoRunYet(RuntimeError):
    """A record of a run whose creation has not been delivered (another node's journal waits for the main one)."""


def is_transient(exc: BaseException) -> bool:
    """Whether the store may take this record later (unreachable, overloaded, locked, credentials refused: the
    records wait for a fix) rather than never (an invalid value, a deleted run)."""
    code = getattr(exc, "error_code", None)
    if code is None:  # not the store's word: a socket, a timeout, sqlite's lock
        return True
    status = exc.get_http_status_code() if hasattr(exc, "get_http_status_code") else 500
    return code in TRANSIENT_CODES or status >= 500


def send(journal: Any) -> Delivery:
    """Send ``journal``'s waiting records in order until one fails transiently (the caller holds its lock)."""
    import mlflow

    records = journal.waiting()
    try:
        mlflow.set_tracking_uri(journal.uri)
        client = open_client(journal.uri)  # one opener at a time: the first migrates a sqlite store
    except Exception as exc:  # a store that cannot be opened now (a file being migrated, a driver error): wait
        return Delivery(0, len(records), exc)
    sent, i, held = 0, 0, held_steps(journal)
    while i < len(records):
        j = _batch_end(records, i)
        try:  # the records' format before anything of them is sent
            for _, rec in records[i:j]:
                journal.format_of(rec)
        except ValueError as exc:  # newer than this code reads: it waits, not set aside, for the ddpipe that wrote it
            return Delivery(sent, len(records) - i, exc)
        op = records[i][1]["op"]
        try:
            run_id = journal.run_id
            if run_id is None and op != "create":
                raise NoRunYet(f"run {journal.key} has not been created in the store yet")
            if op == "metrics":
                _metrics(client, run_id, unheld([m for _, r in records[i:j] for m in r["metrics"]], held))
                for _, rec in records[i:j]:
                    if rec.get("model_epoch") is not None:
                        link_to_model(client, run_id, rec)
            else:
                SENDERS[op](client, journal, run_id, records[i][1])
                held = held_steps(journal) if op in ("reopen", "end") else held
        except Exception as exc:  # the store's answer decides: wait, or set the record aside
            if isinstance(exc, NoRunYet) or is_transient(exc):
                return Delivery(sent, len(records) - i, exc)
            journal.reject(records[i][1], exc)
            logger.warning(f"MLflow refused a {op!r} record of run {journal.key} for good ({one_line(exc, 300)}); kept "
                           f"in {journal.dir}")
            j = i + 1
        journal.mark_sent(records[j - 1][0])
        sent, i = sent + (j - i), j
    return Delivery(sent, 0, None)


def _batch_end(records: list[tuple[int, dict]], i: int) -> int:
    """The end of the run of consecutive metric records from ``i`` that fits one request (at least one)."""
    if records[i][1]["op"] != "metrics":
        return i + 1
    j, count = i, 0
    while j < len(records) and records[j][1]["op"] == "metrics" and \
            (j == i or count + len(records[j][1]["metrics"]) <= MAX_METRICS):
        count += len(records[j][1]["metrics"])
        j += 1
    return j


def _metrics(client: Any, run_id: str, rows: list[list]) -> None:
    from mlflow.entities import Metric

    metrics = [Metric(k, float(v), int(ts), int(step)) for k, v, ts, step in rows]
    for a in range(0, len(metrics), MAX_METRICS):
        client.log_batch(run_id, metrics=metrics[a:a + MAX_METRICS])


def link_to_model(client: Any, run_id: str, rec: dict) -> None:
    """The figures of a metrics record that carries ``model_epoch`` (``MlflowTracker.log_model_metrics``) linked to
    the run's logged model of that exported epoch (``ddpipe.models.served.logged_model``): logged with its model id,
    so MLflow's Models tab and ``mlflow.get_logged_model(id).metrics`` show them. Each once: a figure the model holds
    already (the same key, step and value: a record sent again, a re-run of the same training or evaluation) is not
    sent again, and the run's own copy carries the record's timestamp, which the store keeps once. Nothing when the
    run holds no such model (``mlflow.log_model`` off, its logging refused): the run has the figures."""
    from mlflow.entities import Metric

    from ddpipe.models.served import logged_model

    model = logged_model(client, run_id, rec["model_epoch"])
    if model is None:
        return
    held = {(m.key, int(m.step), float(m.value)) for m in client.get_logged_model(model.model_id).metrics or []}
    linked = [Metric(k, float(v), int(ts), int(step), model_id=model.model_id) for k, v, ts, step in rec["metrics"]
              if (k, int(step), float(v)) not in held]
    if linked:
        client.log_batch(run_id, metrics=linked)


def _create(client: Any, journal: Any, run_id: str | None, rec: dict) -> None:
    """The run of a pending key (found by its ``ddpipe.run_key`` tag if an earlier delivery made it)."""
    import mlflow

    from ddpipe.tracking.run_store import experiment_id, sweep_parent

    exp = experiment_id(mlflow, rec["experiment"], journal.uri)
    found = client.search_runs([exp], filter_string=f"tags.`ddpipe.run_key` = '{journal.key}'", max_results=1)
    if found:
        journal.set_run_id(found[0].info.run_id)
        return
    tags = {**rec["tags"], "ddpipe.run_key": journal.key}
    if rec.get("sweep"):
        tags["mlflow.parentRunId"] = sweep_parent(client, journal.uri, exp, rec["sweep"])
    run = client.create_run(exp, start_time=rec["start_time"], tags=tags, run_name=rec["run_name"])
    journal.set_run_id(run.info.run_id)


def _params(client: Any, journal: Any, run_id: str, rec: dict) -> None:
    from mlflow.entities import Param

    params = [Param(k, str(v)) for k, v in rec["params"].items()]
    for a in range(0, len(params), MAX_PARAMS):
        client.log_batch(run_id, params=params[a:a + MAX_PARAMS])


def _tags(client: Any, journal: Any, run_id: str, rec: dict) -> None:
    from mlflow.entities import RunTag

    client.log_batch(run_id, tags=[RunTag(k, str(v)) for k, v in rec["tags"].items()])


def _dataset(client: Any, journal: Any, run_id: str, rec: dict) -> None:
    from mlflow.data.meta_dataset import MetaDataset
    from mlflow.data.sources import LocalArtifactDatasetSource
    from mlflow.entities import DatasetInput, InputTag

    dataset = MetaDataset(LocalArtifactDatasetSource(rec["source"]), name=rec["name"], digest=rec["digest"])
    tags = [InputTag("mlflow.data.context", rec["context"]), *(InputTag(k, v) for k, v in rec["tags"].items())]
    inputs = [DatasetInput(dataset._to_mlflow_entity(), tags=tags)]
    try:
        client.log_inputs(run_id, datasets=inputs)
    except Exception as exc:  # noqa: BLE001 - only a lost race is retried, anything else goes on up
        # The store looks for the experiment's dataset, then inserts it: two runs of one experiment that log one
        # dataset at once (a sweep's children) both insert it, and the second hits the unique key. The dataset is
        # there now, so a second try links this run to it.
        if not any(word in str(exc) for word in DUPLICATE_ROW):
            raise
        client.log_inputs(run_id, datasets=inputs)


def _artifact(client: Any, journal: Any, run_id: str, rec: dict) -> None:
    client.log_artifact(run_id, rec["path"], rec.get("artifact_path"))


def _model(client: Any, journal: Any, run_id: str, rec: dict) -> None:
    """The pyfunc model (``ddpipe.models.served.log_pyfunc``), logged into ``run_id``."""
    import mlflow
    import numpy as np

    from ddpipe.models.served import log_pyfunc
    from ddpipe.tracking.run_store import git_tags

    model_name, registered = model_names(rec, journal.format_of(rec))
    # the commit tags a registered version only: no git subprocess for a model that is not registered
    log_pyfunc(mlflow, run_id, Path(rec["model"]), np.load(rec["example"]), model_name, registered,
               git_tags()["git_commit"] if registered else "")


def model_names(rec: dict, version: int) -> tuple[str, str | None]:
    """(the network's name, the registered model's or None) of a ``model`` record of format ``version``
    (``ddpipe.tracking.outbox.RECORD_FORMAT``)."""
    if version < 1 and "config" in rec:
        # Format 0, written before format versions existed (in an outbox that waited for its store across the
        # upgrade): a record from before the names were kept holds the run's whole config instead. Such a record
        # does not say which it is, so here, and only here, the key tells.
        from ddpipe.config.load import load_config

        with tempfile.TemporaryDirectory() as tmp:
            params = Path(tmp) / "params.yaml"
            params.write_text(rec["config"])
            cfg = load_config(params_file=params)
        return cfg.model.name, cfg.mlflow.registered_model_name
    return rec["model_name"], rec["registered_model_name"]


def steps_file(journal: Any) -> Path:
    """Where a reopened run's highest step per metric key is kept while its attempt lasts (beside its journal)."""
    return journal.dir / f"{journal.name}.steps.json"


def held_steps(journal: Any) -> dict[str, int]:
    """{metric key: the highest step the run held when its attempt reopened it}; empty outside a resumed attempt."""
    try:
        return json.loads(steps_file(journal).read_text())["highest_steps"]
    except FileNotFoundError:
        return {}


def unheld(rows: list[list], held: dict[str, int]) -> list[list]:
    """The metric rows ``[key, value, timestamp, step]`` above the step their key held (:func:`held_steps`)."""
    return [row for row in rows if row[0] not in held or int(row[3]) > held[row[0]]]


def highest_steps(run: Any) -> dict[str, int]:
    """The highest step of each metric key of ``run`` (the store's): a key's latest metric, which MLflow's stores keep
    as the one of the highest (step, timestamp, value) (SqlAlchemyStore._update_latest_metrics_if_necessary,
    FileStore._get_metric_from_file), so one get_run says it for every key, whatever the run's length."""
    return {m.key: int(m.step) for m in run.data.to_proto().metrics}


def _reopen(client: Any, journal: Any, run_id: str, rec: dict) -> None:
    """The run RUNNING again, its attempts counted, and what it holds of each metric kept (:func:`held_steps`)."""
    from mlflow.entities import RunStatus

    run = client.get_run(run_id)
    atomic_write_json(steps_file(journal), {"run_id": run_id, "highest_steps": highest_steps(run)})
    attempts = max(int(run.data.tags.get("ddpipe.attempts", "1")), int(rec.get("attempt", 0)) - 1) + 1
    client.update_run(run_id, status=RunStatus.to_string(RunStatus.RUNNING))
    client.set_tag(run_id, "ddpipe.attempts", str(attempts))
    client.set_tag(run_id, "ddpipe.end_reason", "running")


def _end(client: Any, journal: Any, run_id: str, rec: dict) -> None:
    client.set_tag(run_id, "ddpipe.end_reason", rec["reason"])
    client.set_terminated(run_id, rec["status"], end_time=rec["time"])
    steps_file(journal).unlink(missing_ok=True)  # what follows (the evaluate stage's) is no resumed attempt's


def _close_orphan(client: Any, journal: Any, run_id: str, rec: dict) -> None:
    """FAILED, with the reason, for a run a killed attempt left RUNNING (nothing if it ended meanwhile)."""
    if client.get_run(run_id).info.status == "RUNNING":
        client.set_tag(run_id, "ddpipe.end_reason", rec["reason"])
        client.set_terminated(run_id, "FAILED", end_time=rec["time"])
        logger.info(f"MLflow run {run_id} was left RUNNING by a killed training; closed as FAILED")


def _champion(client: Any, journal: Any, run_id: str, rec: dict) -> None:
    from ddpipe.tracking.champion import record_test

    record_test(client, run_id, rec)


def _export(client: Any, journal: Any, run_id: str, rec: dict) -> None:
    """The export stage's record: graphs that passed their check into the run (files under ``export/``, and with
    ``mlflow.log_model`` the fp32 one as the pyfunc model ``model_onnx`` that runs ONNX Runtime), then the
    registered version's tags and the alias (``ddpipe.tracking.champion.record_export``)."""
    import mlflow

    from ddpipe.models.onnx_served import log_onnx_pyfunc
    from ddpipe.tracking.champion import record_export

    uris = {}
    if rec.get("graphs"):
        for path in rec["graphs"].values():
            client.log_artifact(run_id, path, "export")
        if rec.get("log_model", True):  # mlflow.log_model (a record from before it was kept: logged, as then)
            uris["onnx_model"] = log_onnx_pyfunc(mlflow, run_id, "model_onnx", Path(rec["graphs"]["onnx"])).model_uri
    if rec.get("model_name"):
        record_export(client, run_id, rec, uris)


SENDERS: dict[str, Callable[[Any, Any, Any, dict], None]] = {
    "create": _create, "params": _params, "tags": _tags, "dataset": _dataset, "artifact": _artifact,
    "model": _model, "reopen": _reopen, "end": _end, "close_orphan": _close_orphan, "champion": _champion,
    "export": _export,
}
