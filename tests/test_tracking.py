"""MLflow tracking against real stores (sqlite and a real `mlflow server`), never a mock; DVC
experiments end to end in a temporary clone; tracking down never stops training."""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from ddpipe.config.load import load_config
from ddpipe.config.schema import Config, DistributedConfig, MlflowConfig
from ddpipe.core.ranks import DistInfo
from ddpipe.launch.torchrun import torchrun_command
from ddpipe.tracking.run_store import dvc_hash, tracking_uri
from ddpipe.tracking.tracker import MlflowTracker, Tracker, make_tracker
from tests.conftest import (
    CLONE_ENV,
    CLONE_PARAMS,
    FASHION_DIR,
    PARAMS,
    ROOT,
    args_for,
    clone_repo,
    dead_pid,
    free_port,
    plain_mlflow_server,
    run,
    subprocess_env,
)


def _client(uri: str):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def _journal_of_a_new_run(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, experiment: str):
    """(client, run id, the run's outbox journal) of a new run of ``experiment`` in a sqlite store under tmp_path."""
    from ddpipe.tracking.outbox import Journal

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = _client(uri)
    run_id = client.create_run(client.create_experiment(experiment)).info.run_id
    return client, run_id, Journal(tmp_path / "outbox", run_id, uri)


def test_only_global_rank_zero_tracks() -> None:
    two_nodes = {"distributed": True, "world_size": 2, "num_nodes": 2, "backend": "gloo"}
    assert isinstance(make_tracker(MlflowConfig(), DistInfo(rank=0, **two_nodes)), MlflowTracker)
    other = make_tracker(MlflowConfig(), DistInfo(rank=1, **two_nodes))
    assert type(other) is Tracker and other.log_metrics({"x": 1.0}, step=0) is None
    # a true do-nothing twin: no process group exists here, and it needs none (the run id reaches the other
    # ranks through ddpipe.distributed, from the trainer)
    assert other.start(Config(), {}, None, Path("nowhere"), "seed_cnn") is None and other.run_id is None


def test_tracking_uri_precedence(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("DVC_ROOT", str(tmp_path))
    assert tracking_uri(MlflowConfig()) == f"sqlite:///{tmp_path.resolve()}/mlflow.db"
    assert tracking_uri(MlflowConfig(tracking_uri="http://a:1")) == "http://a:1"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://b:2")
    assert tracking_uri(MlflowConfig(tracking_uri="http://a:1")) == "http://b:2"


@pytest.mark.slow
def test_training_and_evaluation_make_one_complete_run(tmp_path: Path, prepared: Path) -> None:
    args = args_for(tmp_path, prepared, "mlflow.experiment_name=unit", "train.model_epoch=best",
                    "mlflow.log_model=true")
    trained = run(["python", "stages/train_worker.py", *args],
                  env={"DVC_EXP_NAME": "my-exp", "MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL": "1"})
    run(["python", "stages/evaluate.py", *args])
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = _client(uri)
    cfg = load_config(args, params_file=PARAMS)
    exp = client.get_experiment_by_name("unit")
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 1
    r = runs[0]
    assert r.info.run_name == "my-exp" and r.info.status == "FINISHED"
    assert r.data.tags["ddpipe.end_reason"] == "completed"
    assert f"#/experiments/{exp.experiment_id}/runs?workflowType=machine_learning&viewStateShareKey=ddpipe" \
        in trained.stderr
    assert "test_accuracy" in exp.tags["mlflow.sharedViewState.ddpipe"]
    assert r.data.params["num_epochs"] == "2" and r.data.params["train.base_lr"] == str(cfg.train.base_lr)
    assert r.data.params["world_size"] == "1" and "effective_lr" in r.data.params
    for tag in ("git_commit", "git_dirty", "world_size", "backend", "device_type", "torch_version", "host"):
        assert tag in r.data.tags, tag
    history = client.get_metric_history(r.info.run_id, "val_accuracy")
    assert [m.step for m in history] == [1, 2]  # epochs counted from 1, as in DVC's history
    assert "test_accuracy" in r.data.metrics and "test_macro_f1" in r.data.metrics
    # every train.log_every_n_steps (10) steps, at the global step: the loss so far, the lr, the norm, images/s
    per_epoch, every = int(r.data.params["steps_per_epoch"]), cfg.train.log_every_n_steps
    steps = [e * per_epoch + s for e in range(2) for s in range(every, per_epoch + 1, every)]
    for key in ("train_loss_step", "lr_step", "grad_norm", "images_per_s_step"):
        points = client.get_metric_history(r.info.run_id, key)
        assert sorted(m.step for m in points) == steps and all(m.value > 0 for m in points), key
    losses = [m.value for m in sorted(client.get_metric_history(r.info.run_id, "train_loss_step"),
                                      key=lambda m: m.step)]
    assert losses[-1] < losses[0]  # it learns: the epoch's figure, seen as it goes
    artifacts = {a.path for a in client.list_artifacts(r.info.run_id, "evaluation")}
    assert {"evaluation/confusion_matrix.png", "evaluation/misclassified.png"} <= artifacts

    # MLflow's system metrics, filed under this node; the prepared data as the run's dataset input
    assert any(k.startswith("system/node0/") for k in r.data.metrics), sorted(r.data.metrics)
    (dataset_input,) = client.get_run(r.info.run_id).inputs.dataset_inputs
    assert dataset_input.dataset.name == "mnist" and dataset_input.dataset.digest == dvc_hash(prepared)
    # the exported epoch is the best validation epoch (train.model_epoch: best)
    history = {h.step: h.value for h in client.get_metric_history(r.info.run_id, "val_accuracy")}
    assert r.data.metrics["exported_epoch"] == r.data.metrics["best_epoch"] == max(history, key=history.get)

    import mlflow.pyfunc

    mlflow.set_tracking_uri(uri)
    model = mlflow.pyfunc.load_model(f"runs:/{r.info.run_id}/model")
    assert model.metadata.metadata["classes"] == [str(i) for i in range(10)]
    for batch in (1, 7):
        out = model.predict(np.zeros((batch, 28, 28), dtype=np.uint8))
        assert list(out.columns) == ["label", "class_index", "probability", "probabilities"] and len(out) == batch
        assert np.allclose([sum(p) for p in out["probabilities"]], 1.0)
    run_info = json.loads((tmp_path / "run.json").read_text())
    assert run_info["run_id"] == r.info.run_id

    # Training again with nothing left to train (e.g. `dvc repro` after a code-only change) rewrites
    # the outputs from the last checkpoint into the same run, without a second copy of the model.
    again = run(["python", "stages/train_worker.py", *args])
    assert "already holds this model" in again.stderr
    assert [x.info.run_id for x in client.search_runs([exp.experiment_id])] == [r.info.run_id]
    models = mlflow.search_logged_models(experiment_ids=[exp.experiment_id], output_format="list",
                                         filter_string=f"source_run_id = '{r.info.run_id}'")
    assert len(models) == 1 and str(models[0].status).upper().endswith("READY")
    # the run lists it among its outputs (MLflow's run page, "Logged models"); no run was made active to log it
    assert [o.model_id for o in client.get_run(r.info.run_id).outputs.model_outputs] == [models[0].model_id]
    # MLflow's Models tab: the figures that describe the model, linked through its id, each once after the training
    # and the evaluation ran again, equal to the run's; not each epoch's
    run(["python", "stages/evaluate.py", *args])
    linked = mlflow.get_logged_model(models[0].model_id).metrics
    keys = ["model_val_accuracy", "model_val_loss", "test_accuracy", "test_loss", "test_macro_f1"]
    assert sorted(m.key for m in linked) == keys
    assert {m.key: m.value for m in linked} == {key: r.data.metrics[key] for key in keys}


@pytest.mark.slow
def test_real_mlflow_server_gets_system_metrics_from_every_node(tmp_path: Path, prepared: Path) -> None:
    """Two torchrun agents (two "nodes" on one host, c10d rendezvous) log to a real `mlflow server`:
    one run, with MLflow's system metrics from node0 (rank 0) and node1 (the other agent's local rank 0).
    The sampling interval is longer than the run: each node's samples are logged when it stops (MLflow's
    own loop would drop a node that ran for less than one interval)."""
    with plain_mlflow_server(tmp_path) as uri:
        rdzv = free_port()
        env = subprocess_env({"MLFLOW_TRACKING_URI": uri, "MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL": "600"})
        two_nodes = DistributedConfig(nnodes="2", rdzv_endpoint=f"127.0.0.1:{rdzv}", rdzv_id="sysmetrics")
        cmd = torchrun_command(two_nodes, 1, args_for(tmp_path, prepared, "num_epochs=2"),
                               script=ROOT / "stages" / "train_worker.py")
        agents = [subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                  for _ in range(2)]
        for agent in agents:
            out, _ = agent.communicate(timeout=600)
            assert agent.returncode == 0, out[-4000:]
        client = _client(uri)
        (r,) = client.search_runs([client.get_experiment_by_name("ddpipe").experiment_id])
        assert r.info.status == "FINISHED" and len(client.get_metric_history(r.info.run_id, "val_loss")) == 2
        for node in ("node0", "node1"):
            assert f"system/{node}/cpu_utilization_percentage" in r.data.metrics, sorted(r.data.metrics)


@pytest.mark.slow
def test_a_store_down_for_the_whole_training_loses_nothing(tmp_path: Path, prepared: Path) -> None:
    """The training completes; what it logged waits in the outbox, said once with the command that sends it;
    that command delivers it all, once, into the store when it answers."""
    result = run(["python", "stages/train_worker.py", *args_for(tmp_path, prepared, "num_epochs=2",
                                                                "mlflow.log_model=true")],
                 env={"MLFLOW_TRACKING_URI": "http://127.0.0.1:9"}, timeout=300)
    assert result.stderr.count("does not answer") == 1 and result.stderr.count("ddpipe outbox deliver") == 1
    assert (tmp_path / "model.pt").is_file() and (tmp_path / "train.json").is_file()
    key = json.loads((tmp_path / "run.json").read_text())["run_id"]
    assert key.startswith("pending-") and (tmp_path / "outbox" / key / "main.jsonl").is_file()
    uri = f"sqlite:///{tmp_path}/later.db"
    sent = run(["ddpipe", "outbox", "deliver", f"mlflow.outbox={tmp_path}/outbox"],
               env={"MLFLOW_TRACKING_URI": uri}, timeout=300)
    assert "0 still waiting" in sent.stdout, sent.stdout + sent.stderr
    assert not (tmp_path / "outbox" / key).exists()  # delivered whole: removed
    client = _client(uri)
    (r,) = client.search_runs([client.get_experiment_by_name("ddpipe").experiment_id])
    assert r.info.status == "FINISHED" and r.data.tags["ddpipe.run_key"] == key
    history = client.get_metric_history(r.info.run_id, "val_accuracy")
    assert sorted(m.step for m in history) == [1, 2]  # every epoch, each once
    assert r.data.params["num_epochs"] == "2"
    assert any(k.startswith("system/node0/") for k in r.data.metrics)
    assert [m.name for m in client.search_logged_models([r.info.experiment_id])] == ["model"]


def test_records_wait_in_the_outbox_when_the_store_does_not_answer(monkeypatch: pytest.MonkeyPatch,
                                                                   tmp_path: Path) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    cfg = MlflowConfig(tracking_uri="http://127.0.0.1:9", outbox=str(tmp_path / "outbox"))  # nothing listens there
    tracker = MlflowTracker(cfg, DistInfo())
    key = tracker.start(Config(), {"seed": 1}, None, tmp_path, "seed_cnn")
    assert key.startswith("pending-") and tracker.enabled
    tracker.log_metrics({"x": 1.0}, step=3)
    ops = [json.loads(line)["op"] for line in (tmp_path / "outbox" / key / "main.jsonl").read_text().splitlines()]
    assert ops[:2] == ["create", "params"] and ops[-1] == "metrics"
    tracker.courier.close(timeout_s=1)


def test_a_store_that_cannot_be_opened_never_takes_training_down(monkeypatch: pytest.MonkeyPatch,
                                                                  tmp_path: Path) -> None:
    """A sqlite file that is no database (a half-written one, say): the run waits in the outbox, nothing raises."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    (tmp_path / "broken.db").write_bytes(b"not a database" * 100)
    cfg = MlflowConfig(tracking_uri=f"sqlite:///{tmp_path}/broken.db", outbox=str(tmp_path / "outbox"))
    tracker = MlflowTracker(cfg, DistInfo())
    key = tracker.start(Config(), {"seed": 1}, None, tmp_path, "seed_cnn")
    tracker.log_metrics({"x": 1.0}, step=1)
    tracker.finish()  # the last delivery fails, is said, and returns
    assert key.startswith("pending-") and (tmp_path / "outbox" / key / "main.jsonl").is_file()
    ops = [json.loads(line)["op"] for line in (tmp_path / "outbox" / key / "main.jsonl").read_text().splitlines()]
    assert ops[0] == "create" and ops[-1] == "end"


@pytest.mark.parametrize("failures", [1, 2])
def test_one_failed_delivery_is_a_blip_two_in_a_row_an_outage_said_once(monkeypatch: pytest.MonkeyPatch,
                                                                        tmp_path: Path, failures: int) -> None:
    """A delivery that fails once and goes through a second later (a restarted server's stale pooled connection, one
    slow answer) is not announced; failing twice in a row is an outage: said once, and once when the store answers."""
    from ddpipe.tracking.delivery import Delivery
    from ddpipe.tracking.outbox import Courier

    client, run_id, journal = _journal_of_a_new_run(monkeypatch, tmp_path, f"blip{failures}")
    journal.append("params", params={"seed": 1})
    deliver, attempts = journal.deliver, []

    def failing_first(wait: bool = False) -> Delivery:
        attempts.append(wait)
        if len(attempts) <= failures:
            return Delivery(0, 1, ConnectionError("connection refused"))
        return deliver(wait)

    monkeypatch.setattr(journal, "deliver", failing_first)
    said: list[str] = []
    result = Courier(journal, say=said.append).close()  # its last delivery, tried again after 1 s and 2 s
    assert result.error is None and len(attempts) == failures + 1
    assert client.get_run(run_id).data.params == {"seed": "1"}
    if failures == 1:
        assert said == []
    else:
        assert [re.sub(r"after \d+ s", "after N s", line.split(";")[0]) for line in said] == [
            f"MLflow: the store at sqlite:///{tmp_path}/mlflow.db does not answer "
            "(ConnectionError: connection refused)",
            "MLflow: the store answers again after N s"], said  # N: from the first failure, 3 s on an idle host


def test_a_journal_sent_twice_stores_each_record_once(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A crash between a delivery and the note of its offset sends the same lines again: nothing is doubled."""

    client, run_id, journal = _journal_of_a_new_run(monkeypatch, tmp_path, "resend")
    journal.append("params", params={"seed": 1})
    for epoch in (1, 2, 3):
        journal.append("metrics", metrics=[["val_accuracy", 0.5 + epoch / 10, 1_700_000_000_000 + epoch, epoch]])
    journal.append("end", status="FINISHED", reason="completed", time=1_700_000_009_000)
    assert journal.deliver(wait=True).sent == 5
    journal.mark_sent(0)  # as if the delivery's offset had never been written
    assert journal.deliver(wait=True).sent == 5
    history = client.get_metric_history(run_id, "val_accuracy")
    assert sorted(m.step for m in history) == [1, 2, 3]
    run_ = client.get_run(run_id)
    assert run_.data.params == {"seed": "1"} and run_.info.status == "FINISHED"


def test_the_logged_models_figures_are_linked_to_it_each_once(monkeypatch: pytest.MonkeyPatch,
                                                               tmp_path: Path) -> None:
    """MLflow's Models tab shows a logged model's figures: the records that describe the run's model of an exported
    epoch (its validation figures, the test's) are linked to it, each once however often they are sent or logged
    again; each epoch's figures, another epoch's and a run without that model's stay on the run alone."""
    import mlflow
    from mlflow.entities import LoggedModelStatus

    client, run_id, journal = _journal_of_a_new_run(monkeypatch, tmp_path, "linked")
    mlflow.set_tracking_uri(journal.uri)
    t0 = 1_700_000_000_000
    journal.append("metrics", metrics=[["model_val_accuracy", 0.7, t0, 0]], model_epoch=2)  # no model yet
    assert journal.deliver(wait=True).error is None
    first = journal.sent_offset()
    model = mlflow.initialize_logged_model(name="model", source_run_id=run_id,
                                           experiment_id=client.get_run(run_id).info.experiment_id)
    client.finalize_logged_model(model.model_id, LoggedModelStatus.READY)
    client.set_tag(run_id, "ddpipe.logged_model_epoch", "2")  # as ddpipe.models.served.log_pyfunc leaves it
    journal.append("metrics", metrics=[["val_accuracy", 0.5, t0 + 1, 1], ["val_accuracy", 0.6, t0 + 2, 2]])
    journal.append("metrics", metrics=[["model_val_accuracy", 0.6, t0 + 3, 0], ["model_val_loss", 0.9, t0 + 3, 0]],
                   model_epoch=2)
    journal.append("metrics", metrics=[["test_accuracy", 0.55, t0 + 4, 0]], model_epoch=2)
    journal.append("metrics", metrics=[["test_accuracy", 0.4, t0 + 5, 0]], model_epoch=1)  # another epoch's model
    assert journal.deliver(wait=True).error is None
    journal.mark_sent(first)  # as if the delivery's offset had never been written
    journal.append("metrics", metrics=[["test_accuracy", 0.55, t0 + 6, 0]], model_epoch=2)  # an evaluation re-run
    assert journal.deliver(wait=True).error is None

    linked = sorted((m.key, m.value, m.step) for m in mlflow.get_logged_model(model.model_id).metrics)
    assert linked == [("model_val_accuracy", 0.6, 0), ("model_val_loss", 0.9, 0), ("test_accuracy", 0.55, 0)]
    found = mlflow.search_logged_models(filter_string="metrics.test_accuracy > 0.5", output_format="list",
                                        experiment_ids=[client.get_run(run_id).info.experiment_id])
    assert [m.model_id for m in found] == [model.model_id]  # what the Models tab filters and sorts by
    # the run holds each record's figures once (the link sends them with the record's own timestamp)
    assert sorted((m.value, m.timestamp) for m in client.get_metric_history(run_id, "model_val_accuracy")) == \
        [(0.6, t0 + 3), (0.7, t0)]
    assert sorted(m.step for m in client.get_metric_history(run_id, "val_accuracy")) == [1, 2]


def test_a_resumed_attempt_on_another_host_logs_each_step_once(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A resume re-runs the steps after its checkpoint and logs its last validation again, from a host whose outbox
    knows nothing of the run: what the store holds of each key's steps is sent once; the new steps all go; after
    the attempt's end, the evaluate stage's figures go whatever the run held (a re-run evaluation replaces them)."""
    from ddpipe.tracking.outbox import Journal

    client, run_id, first = _journal_of_a_new_run(monkeypatch, tmp_path, "resumed")
    t0 = 1_700_000_000_000
    first.append("metrics", metrics=[[key, step / 10, t0 + step, step] for step in (1, 2, 3)
                                     for key in ("val_accuracy", "train_loss_step")])
    first.append("metrics", metrics=[["test_accuracy", 0.5, t0, 0]])  # an earlier evaluation
    first.append("end", status="KILLED", reason="stopped by SIGTERM", time=t0 + 9)
    assert first.deliver(wait=True).error is None

    other_host = Journal(tmp_path / "outbox-of-another-host", run_id, first.uri)
    other_host.append("reopen", attempt=0)
    for step in (2, 3, 4):  # again, with other values and timestamps (a non-exact re-run), then a new step
        other_host.append("metrics", metrics=[["val_accuracy", 0.9, t0 + 100 + step, step],
                                              ["train_loss_step", 0.9, t0 + 100 + step, step]])
    other_host.append("end", status="FINISHED", reason="completed", time=t0 + 200)
    other_host.append("metrics", metrics=[["test_accuracy", 0.8, t0 + 300, 0]])  # the evaluate stage's
    assert other_host.deliver(wait=True).error is None
    for key in ("val_accuracy", "train_loss_step"):
        history = sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))
        assert history == [(1, 0.1), (2, 0.2), (3, pytest.approx(0.3)), (4, 0.9)], key
    assert client.get_run(run_id).data.metrics["test_accuracy"] == 0.8
    assert [m.step for m in client.get_metric_history(run_id, "test_accuracy")] == [0, 0]


def test_two_runs_that_log_one_dataset_at_once_both_get_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The store looks for the experiment's dataset, then inserts it; a sweep's children that start together both
    insert it, and the later one hits the unique key (seen on SLURM: 'UNIQUE constraint failed: datasets...'). That
    record is retried, so the run still names its dataset: one dataset, an input of both runs."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    client, run_id, journal = _journal_of_a_new_run(monkeypatch, tmp_path, "race")
    sibling = client.create_run(client.get_run(run_id).info.experiment_id).info.run_id
    real, raced = MlflowClient.log_inputs, []

    def log_inputs(self, run_id_, datasets=None, models=None):  # noqa: ANN001, ANN202 - MlflowClient's own
        if not raced:  # the sibling inserts the dataset between this run's look and its insert
            raced.append(real(self, sibling, datasets=datasets))
            raise MlflowException("(sqlite3.IntegrityError) UNIQUE constraint failed: datasets.experiment_id, "
                                  "datasets.name, datasets.digest")
        return real(self, run_id_, datasets=datasets, models=models)

    monkeypatch.setattr(MlflowClient, "log_inputs", log_inputs)
    journal.append("dataset", name="fashion_mnist", digest="0123abcd", source=str(tmp_path), context="training",
                   tags={})
    journal.append("end", status="FINISHED", reason="completed", time=1_700_000_009_000)
    assert journal.deliver(wait=True).sent == 2 and raced
    inputs = [client.get_run(r).inputs.dataset_inputs for r in (run_id, sibling)]
    assert [[(d.dataset.name, d.dataset.digest) for d in i] for i in inputs] == [[("fashion_mnist", "0123abcd")]] * 2
    assert client.get_run(run_id).info.status == "FINISHED"


def test_a_store_that_refuses_for_good_turns_tracking_off(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE

    def refuse(*args: object) -> str:
        raise MlflowException("bad experiment name", error_code=INVALID_PARAMETER_VALUE)

    monkeypatch.setattr(MlflowTracker, "_create_now", refuse)
    tracker = MlflowTracker(MlflowConfig(outbox=str(tmp_path / "outbox")), DistInfo())
    with pytest.warns(RuntimeWarning, match="training goes on without tracking"):
        tracker.start(Config(), {}, None, tmp_path, "seed_cnn")
    assert tracker.run_id is None and not tracker.enabled
    tracker.log_metrics({"x": 1.0}, step=0)  # silently off from now on
    assert not (tmp_path / "outbox").exists()


# ---------------------------------------------------------------------------------------------
# DVC experiments in a temporary clone

# the clone's shrunk params, the model logged (this test loads it)
EXP_PARAMS = [arg for key, value in {**CLONE_PARAMS, "mlflow.log_model": True}.items()
              for arg in ("-S", f"{key}={str(value).lower()}")]



def _runs_by_name(repo: Path) -> dict:
    client = _client(f"sqlite:///{repo}/mlflow.db")
    exp = client.get_experiment_by_name("ddpipe")
    return {r.info.run_name: r for r in client.search_runs([exp.experiment_id])}


@pytest.mark.slow
def test_dvc_exp_run_is_one_named_mlflow_run(tmp_path: Path) -> None:
    """In a fresh clone: `dvc exp run -n NAME -S num_epochs=2 ...` is exactly one MLflow run NAME in
    <repo>/mlflow.db, with params, per-epoch metrics, test metrics, a git tag and a loadable model."""
    if not FASHION_DIR.is_dir():
        pytest.skip("Debian's dataset-fashion-mnist is not installed")
    clone = clone_repo(tmp_path / "repo")
    env = CLONE_ENV
    run(["dvc", "exp", "run", "-n", "tiny-exp", *EXP_PARAMS], cwd=clone, env=env, timeout=900)
    runs = _runs_by_name(clone)
    assert list(runs) == ["tiny-exp"]
    r = runs["tiny-exp"]
    client = _client(f"sqlite:///{clone}/mlflow.db")
    assert r.data.params["num_epochs"] == "2"
    assert len(client.get_metric_history(r.info.run_id, "val_accuracy")) == 2
    assert "test_accuracy" in client.get_run(r.info.run_id).data.metrics
    assert len(r.data.tags["git_commit"]) == 40
    shown = json.loads(run(["dvc", "exp", "show", "--json"], cwd=clone).stdout)
    text = json.dumps(shown)
    assert "tiny-exp" in text and '"accuracy"' in text
    import mlflow.pyfunc

    mlflow.set_tracking_uri(f"sqlite:///{clone}/mlflow.db")
    model = mlflow.pyfunc.load_model(f"runs:/{r.info.run_id}/model")
    assert len(model.predict(np.zeros((3, 1, 28, 28), dtype=np.uint8))) == 3


# ---------------------------------------------------------------------------------------------
# How a run ends: FINISHED, FAILED, KILLED, and runs that a killed process left RUNNING


def _runs(tmp: Path, experiment: str = "ddpipe") -> list:
    client = _client(f"sqlite:///{tmp}/mlflow.db")
    return client.search_runs([client.get_experiment_by_name(experiment).experiment_id],
                              order_by=["attributes.start_time ASC"])


def test_end_reasons_name_the_cause() -> None:
    from ddpipe.core.exits import Preempted, StoreAway
    from ddpipe.tracking.tracker import end_reason

    assert end_reason(KeyboardInterrupt()) == ("KILLED", "interrupted by SIGINT (Ctrl-C)")
    status, why = end_reason(Preempted(15, 1, 7))
    assert status == "KILLED" and why.startswith("stopped by SIGTERM at epoch 2, step 7")
    status, why = end_reason(StoreAway("the store of paths.checkpoints (s3://b/p, endpoint E) has been away for 301 s"))
    assert status == "KILLED" and why.startswith("stopped: the store of paths.checkpoints (s3://b/p, endpoint E) has")
    assert end_reason(ValueError("bad value\nmore")) == ("FAILED", "ValueError: bad value")


@pytest.mark.slow
def test_a_training_that_raises_ends_failed(tmp_path: Path, prepared: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ddpipe.engine.loop import Trainer, train
    from ddpipe.engine.resolved import resolve
    from ddpipe.launch.torchrun import this_device

    real = Trainer.train_epoch

    def second_epoch_breaks(self, epoch: int, *args):
        if epoch == 1:
            raise RuntimeError("disk full while writing activations")
        return real(self, epoch, *args)

    monkeypatch.setattr(Trainer, "train_epoch", second_epoch_breaks)
    # mlflow.set_tracking_uri exports MLFLOW_TRACKING_URI to this process; monkeypatch restores it after
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    with pytest.raises(RuntimeError, match="disk full"):
        train(resolve(load_config(args_for(tmp_path, prepared), params_file=PARAMS), this_device()))
    (r,) = _runs(tmp_path)
    assert r.info.status == "FAILED"
    assert r.data.tags["ddpipe.end_reason"] == "RuntimeError: disk full while writing activations"


def _wait_for_first_checkpoint(directory: Path, proc: subprocess.Popen) -> None:
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if list(directory.glob("ckpt-*.pt")):
            return
        time.sleep(0.05)
    raise AssertionError(f"no checkpoint appeared while the run was alive (exit {proc.poll()})")


@pytest.mark.slow
def test_sigterm_ends_killed_and_the_resumed_attempt_reopens_the_same_run(tmp_path: Path, prepared: Path) -> None:
    """SIGTERM to torchrun (as a scheduler sends it) reaches the worker: it stops at a step and its run
    ends KILLED, saying so. The next attempt resumes the checkpoint into the same run, which
    ends FINISHED with every epoch logged once."""
    from tests.conftest import torchrun

    args = args_for(tmp_path, prepared, "num_epochs=4")
    proc = subprocess.Popen(torchrun(1, *args), cwd=ROOT, env=subprocess_env(CLONE_ENV),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    _wait_for_first_checkpoint(tmp_path / "ckpt", proc)
    proc.send_signal(15)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode != 0, out[-3000:]
    assert "training stopped by SIGTERM at epoch" in out
    (killed,) = _runs(tmp_path)
    assert killed.info.status == "KILLED" and "SIGTERM" in killed.data.tags["ddpipe.end_reason"]

    resumed = run(torchrun(1, *args), env=CLONE_ENV)
    assert "resuming from" in resumed.stderr
    (r,) = _runs(tmp_path)
    assert r.info.run_id == killed.info.run_id and r.info.status == "FINISHED"
    assert r.data.tags["ddpipe.attempts"] == "2" and r.data.tags["ddpipe.end_reason"] == "completed"
    client = _client(f"sqlite:///{tmp_path}/mlflow.db")
    for key in ("val_loss", "val_accuracy"):
        assert sorted(m.step for m in client.get_metric_history(r.info.run_id, key)) == [1, 2, 3, 4], key
    logged = [m.step for m in client.get_metric_history(r.info.run_id, "train_loss_step")]
    assert sorted(logged) == sorted(set(logged)), logged  # each step once, the stop's included
    assert not list((tmp_path / "ckpt").glob("mlflow-run-*.json"))  # no live attempt left behind


@pytest.mark.slow
def test_a_run_left_running_by_sigkill_is_closed_failed_by_a_fresh_start(tmp_path: Path, prepared: Path) -> None:
    args = args_for(tmp_path, prepared, "num_epochs=4")
    proc = subprocess.Popen(["python", "stages/train_worker.py", *args], cwd=ROOT, env=subprocess_env(CLONE_ENV),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _wait_for_first_checkpoint(tmp_path / "ckpt", proc)
    proc.kill()
    proc.wait(timeout=30)
    (orphan,) = _runs(tmp_path)
    assert orphan.info.status == "RUNNING"  # nothing could close it

    run(["python", "stages/train_worker.py", *args, "seed=7", "num_epochs=1"], env=CLONE_ENV)  # a fresh start
    closed, new = _runs(tmp_path)
    assert closed.info.run_id == orphan.info.run_id and closed.info.status == "FAILED"
    assert "was killed" in closed.data.tags["ddpipe.end_reason"]
    assert new.info.status == "FINISHED"


def test_a_close_added_between_a_delivery_and_the_removal_of_a_killed_runs_journal_is_delivered_next(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A fresh start's courier delivers a killed attempt's journal and removes it once the store has it whole, while
    the fresh start adds that run's close to it: a close added between the delivery and the removal keeps the journal
    (it once went with it, and the run stayed RUNNING: CI of 324cd4d) and goes with the next delivery."""
    import socket
    import types

    from ddpipe.tracking import outbox

    client, run_id, journal = _journal_of_a_new_run(monkeypatch, tmp_path, "late-close")
    journal.append("metrics", metrics=[["loss", 1.0, 1_700_000_000_000, 1]])
    dead = dead_pid()
    (journal.dir / "main.owner").write_text(json.dumps({"host": socket.gethostname(), "pid": dead}))
    markers = tmp_path / "markers"
    markers.mkdir()
    (markers / f"mlflow-run-{run_id}.json").write_text(json.dumps({"run_id": run_id, "host": socket.gethostname(),
                                                                   "pid": dead}))
    fresh = MlflowTracker(MlflowConfig(tracking_uri=journal.uri, outbox=str(tmp_path / "outbox")))
    fresh.courier = types.SimpleNamespace(poke=lambda: None)
    delivered = outbox.Journal.deliver

    def deliver_then_close(self: outbox.Journal, wait: bool = False) -> outbox.Delivery:
        result = delivered(self, wait)
        fresh._close_orphans(markers, keep=None)  # the fresh start, right after this delivery
        return result

    monkeypatch.setattr(outbox.Journal, "deliver", deliver_then_close)
    assert outbox.deliver_all(tmp_path / "outbox") == (1, 0)
    assert [r["op"] for _, r in journal.waiting()] == ["close_orphan"] and client.get_run(run_id).info.status == \
        "RUNNING"
    monkeypatch.setattr(outbox.Journal, "deliver", delivered)
    assert outbox.deliver_all(tmp_path / "outbox") == (1, 0)
    closed = client.get_run(run_id)
    assert closed.info.status == "FAILED" and "was killed" in closed.data.tags["ddpipe.end_reason"]
    assert not journal.dir.exists()


def test_a_model_record_names_the_network_also_when_written_before_the_names_were_kept() -> None:
    """An outbox that waited for its store across an upgrade still delivers: a record of format 0 (written before
    format versions) from before the names were kept holds the run's whole config instead of the names."""
    from ddpipe.config.load import to_yaml
    from ddpipe.tracking.delivery import model_names
    from ddpipe.tracking.outbox import RECORD_FORMAT

    names = {"model_name": "resnet_compact", "registered_model_name": None}
    assert model_names(names, RECORD_FORMAT) == model_names(names, 0) == ("resnet_compact", None)
    old = load_config(["model.name=seed_cnn", "mlflow.registered_model_name=fashion"], params_file=None)
    assert model_names({"config": to_yaml(old)}, 0) == ("seed_cnn", "fashion")


def test_a_journal_written_before_format_versions_is_delivered(monkeypatch: pytest.MonkeyPatch,
                                                               tmp_path: Path) -> None:
    """Records of format 0, lines as Journal.append wrote them before records carried their format ("v"), waiting
    in an outbox across the upgrade: delivered as they were, in order, beside today's."""
    from ddpipe.tracking.outbox import FORMAT_KEY, RECORD_FORMAT

    client, run_id, journal = _journal_of_a_new_run(monkeypatch, tmp_path, "old-journal")
    old = [{"op": "params", "params": {"seed": 1}},
           {"op": "metrics", "metrics": [["val_accuracy", 0.6, 1_700_000_000_001, 1]]},
           {"op": "tags", "tags": {"ddpipe.note": "old"}}]
    with open(journal.path, "a") as f:
        f.writelines(json.dumps(r, separators=(",", ":")) + "\n" for r in old)
    journal.append("metrics", metrics=[["val_accuracy", 0.7, 1_700_000_000_002, 2]])
    journal.append("end", status="FINISHED", reason="completed", time=1_700_000_009_000)
    formats = [journal.format_of(r) for _, r in journal.waiting()]
    assert formats == [0, 0, 0, RECORD_FORMAT, RECORD_FORMAT]
    assert json.loads(journal.path.read_text().splitlines()[-1])[FORMAT_KEY] == RECORD_FORMAT
    assert journal.deliver(wait=True).sent == 5
    history = client.get_metric_history(run_id, "val_accuracy")
    assert sorted((m.step, m.value) for m in history) == [(1, 0.6), (2, 0.7)]
    run_ = client.get_run(run_id)
    assert run_.data.params == {"seed": "1"} and run_.data.tags["ddpipe.note"] == "old"
    assert run_.info.status == "FINISHED"


def test_a_record_newer_than_this_code_waits_for_the_ddpipe_that_wrote_it(monkeypatch: pytest.MonkeyPatch,
                                                                         tmp_path: Path) -> None:
    """Delivered up to it; it and what follows wait, neither sent nor set aside, and the delivery says why."""
    from ddpipe.tracking.outbox import FORMAT_KEY, RECORD_FORMAT

    client, run_id, journal = _journal_of_a_new_run(monkeypatch, tmp_path, "newer")
    journal.append("params", params={"seed": 1})
    newer = {FORMAT_KEY: RECORD_FORMAT + 1, "op": "tags", "tags": {"a": "b"}}
    with open(journal.path, "a") as f:
        f.write(json.dumps(newer) + "\n")
    journal.append("end", status="FINISHED", reason="completed", time=1_700_000_009_000)
    result = journal.deliver(wait=True)
    assert (result.sent, result.waiting) == (1, 2) and isinstance(result.error, ValueError)
    assert str(result.error) == (f"{journal.path}: a record of format {RECORD_FORMAT + 1}, newer than this ddpipe "
                                 f"reads (formats up to {RECORD_FORMAT}); it waits for the ddpipe that wrote it")
    assert len(journal.waiting()) == 2 and not list(journal.dir.glob("*.rejected.jsonl"))
    run_ = client.get_run(run_id)
    assert run_.data.params == {"seed": "1"} and "a" not in run_.data.tags and run_.info.status == "RUNNING"


def test_run_info_records_its_format_and_one_written_before_still_names_the_run(tmp_path: Path) -> None:
    """paths.run_info as the train stage wrote it before format versions (run_id and tracking_uri: format 1, as
    today) still names the run; one of a newer format is refused, naming the file and both formats."""
    from ddpipe.tracking.outbox import RUN_INFO_FORMAT, read_run_info, write_run_info

    old = tmp_path / "old.json"
    old.write_text(json.dumps({"run_id": "abc123", "tracking_uri": "sqlite:///mlflow.db"}))
    assert read_run_info(old)["run_id"] == "abc123"
    today = tmp_path / "run.json"
    write_run_info(today, "abc123", "http://user:secret@host:5000")
    written = json.loads(today.read_text())
    assert written["format_version"] == RUN_INFO_FORMAT and "secret" not in written["tracking_uri"]
    assert read_run_info(today)["run_id"] == "abc123"
    today.write_text(json.dumps({**written, "format_version": RUN_INFO_FORMAT + 1}))
    said = f"{today}: run-info format {RUN_INFO_FORMAT + 1} is newer than this ddpipe reads (formats up to " \
        f"{RUN_INFO_FORMAT})"
    with pytest.raises(ValueError, match=re.escape(said)):
        read_run_info(today)


_OPEN_AT_ONCE = """
import sys, time
from ddpipe.tracking.run_store import open_client
start = float(sys.argv[2])
time.sleep(max(0.0, start - time.time()))  # every process opens the new store at the same moment
open_client(sys.argv[1]).search_experiments()
"""


def test_two_processes_opening_a_new_sqlite_store_at_once_leave_it_whole(tmp_path: Path) -> None:
    """Three processes open one sqlite store that does not exist yet at the same moment (a search's first trials on a
    fresh clone): one creates and migrates it while the others wait, every one succeeds, and no half-done migration
    (alembic's ``_alembic_tmp_*`` tables) is left."""
    import sqlite3
    import sys

    db = tmp_path / "mlflow.db"
    start = str(time.time() + 3.0)  # after the three interpreters have imported MLflow
    procs = [subprocess.Popen([sys.executable, "-c", _OPEN_AT_ONCE, f"sqlite:///{db}", start], cwd=tmp_path,
                              env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for _ in range(3)]
    outs = [p.communicate(timeout=180)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], "\n".join(o[-1500:] for o in outs)
    tables = {name for (name,) in sqlite3.connect(db).execute("SELECT name FROM sqlite_master WHERE type='table'")}
    assert "experiments" in tables and not {t for t in tables if t.startswith("_alembic_tmp")}, sorted(tables)
