"""Registered models by alias (MLflow's successor to registry stages). Each version carries the figures that decide
the alias: the validation accuracy of its exported model (``model_val_accuracy``, the train stage's, of the epoch and
weights it exported: ``ddpipe.engine.meters.EpochStats.of_weights``, the same figure a search's trial is scored by)
and the digest of the validation split it was measured on; its test accuracy and that split's digest (the evaluate
stage); and whether its exports passed their check (the export stage). The alias (``mlflow.champion_alias``, e.g.
``champion``) goes to the version with the best validation figure among those measured on one validation split whose
exports passed; the test only vetoes (``mlflow.champion_max_test_drop``: a version whose test accuracy falls that far
below its validation accuracy never takes it) and is shown beside: ranking versions by test accuracy would select on
the test split.

    mlflow models serve -m models:/NAME@champion --env-manager local     # with the server's address and credentials

The evaluate stage's outbox record is delivered by :func:`record_test` (which registers the run's model first when its
training did not: a search's trial); the export stage's by :func:`record_export`, which decides, one decision at a
time for every host that shares the tracking server (:func:`alias_lock`); each says in the log what it did and why.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ddpipe.core.metric_names import MODEL_VAL_ACCURACY, TEST_ACCURACY, TEST_SPLIT, VAL_SPLIT
from ddpipe.data.store import SPLITS

# The alias's lock: a registered model of this name, which the server's database holds once (a unique name). One older
# than LOCK_STALE_S was left by a process that died deciding (a decision takes a second); a waiter gives up after
# LOCK_WAIT_S, saying who holds it.
LOCK_STALE_S, LOCK_WAIT_S, LOCK_POLL_S = 120.0, 300.0, 0.2


def split_digest(prepared: str | Path, split: str) -> str:
    """sha256 of a prepared split's files (labels, pixels or shards and index) and meta's classes: two versions'
    figures on ``split`` (test or val) compare only when this is equal."""
    directory = Path(prepared)
    h = hashlib.sha256()
    others = tuple(s for s in SPLITS if s != split)
    for path in sorted(directory.iterdir()):
        if path.name.startswith(split) and not path.name.startswith(others):
            h.update(path.name.encode())
            with open(path, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)
    h.update((directory / "meta.json").read_bytes() if (directory / "meta.json").is_file() else b"")
    return h.hexdigest()[:16]


def record_test(client: Any, run_id: str, rec: dict) -> None:
    """Tag the version registered from ``run_id`` (registered now if its training did not) with its test accuracy
    and the test split's digest: the figure shown beside the alias's decision, and its veto. Moves nothing."""
    name = rec["model_name"]
    version = _version_of(client, name, run_id, "test accuracy", quiet=True) or _register(client, name, run_id)
    if version is None:
        return
    client.set_model_version_tag(name, version, TEST_ACCURACY, f"{float(rec[TEST_ACCURACY]):.6f}")
    client.set_model_version_tag(name, version, TEST_SPLIT, rec["split"])


def _version_of(client: Any, name: str, run_id: str, what: str, quiet: bool = False) -> str | None:
    """The newest version of ``name`` registered from ``run_id``; None (said, unless ``quiet``) when there is none."""
    versions = client.search_model_versions(f"name = '{name}' and run_id = '{run_id}'")
    if not versions:
        if not quiet:
            print(f"MLflow: no version of registered model {name!r} comes from run {run_id}; {what} not recorded on "
                  "the registry", flush=True)
        return None
    return str(max(int(v.version) for v in versions))


def _register(client: Any, name: str, run_id: str) -> str | None:
    """A new version of ``name`` from the model ``run_id`` logged (``model``), tagged as the train stage tags the
    versions it registers; None, said, when the run holds no such model. A search's trial trains without registering
    (issue 47: N trials would be N versions, and the alias would follow the best of them on the test split): the
    chosen trial's version is made here, by its one evaluation."""
    run = client.get_run(run_id)
    found = [m for m in client.search_logged_models([run.info.experiment_id],
                                                    filter_string=f"source_run_id = '{run_id}' AND name = 'model'")
             if str(m.status).upper().endswith("READY")]
    if not found:
        print(f"MLflow: run {run_id} holds no logged model to register as {name!r}; its test accuracy is not recorded "
              "on the registry", flush=True)
        return None
    model = max(found, key=lambda m: m.creation_timestamp)
    if not client.search_registered_models(f"name = '{name}'"):
        client.create_registered_model(name)
    tags = {"dvc_exp_name": run.data.tags.get("dvc_exp_name", ""), "git_commit": run.data.tags.get("git_commit", ""),
            "run_id": run_id}
    version = client.create_model_version(name, source=f"models:/{model.model_id}", run_id=run_id, tags=tags,
                                          model_id=model.model_id)
    print(f"MLflow: registered version {version.version} of {name!r} from run {run_id} (its model was logged "
          "unregistered, as a search's trial logs it)", flush=True)
    return str(version.version)


def record_export(client: Any, run_id: str, rec: dict, uris: dict[str, str]) -> None:
    """Tag the version registered from ``run_id`` with its exports' check (``export_passed`` and each format's
    figures), where they were logged (``uris``) and its exported model's validation accuracy and split; then, when
    they passed, decide ``rec['alias']`` (:func:`decide`) under :func:`alias_lock`. A version whose exports failed
    never takes the alias. Prints what it did."""
    name, alias, passed = rec["model_name"], rec.get("alias"), bool(rec["passed"])
    version = _version_of(client, name, run_id, "the export's check")
    if version is None:
        return
    client.set_model_version_tag(name, version, "export_passed", str(passed).lower())
    for key, value in {**rec.get("figures", {}), **uris}.items():
        client.set_model_version_tag(name, version, f"export_{key}", str(value))
    if rec.get(MODEL_VAL_ACCURACY) is not None:
        client.set_model_version_tag(name, version, MODEL_VAL_ACCURACY, f"{float(rec[MODEL_VAL_ACCURACY]):.6f}")
        client.set_model_version_tag(name, version, VAL_SPLIT, rec[VAL_SPLIT])
    if not passed:
        print(f"MLflow: version {version} of {name!r} keeps no alias: its export failed its check ({rec['why']})",
              flush=True)
        return
    if alias:
        with alias_lock(client, name, alias):
            decide(client, name, alias, version, float(rec.get("max_test_drop", 0.05)))


@contextlib.contextmanager
def alias_lock(client: Any, name: str, alias: str) -> Iterator[None]:
    """Hold the decision about ``name@alias`` for every process on every host that shares the tracking server: a
    registered model named ``ddpipe-lock.<name>.<alias>``, created by one at a time (the server's database refuses a
    second of one name), deleted on leaving. Every decision reads every version's tags after the last one's write, so
    exports finishing at once on any hosts end with the best eligible version on the alias. A lock older than
    :data:`LOCK_STALE_S` (its holder died deciding) is taken over, said; TimeoutError after :data:`LOCK_WAIT_S`."""
    from mlflow.exceptions import MlflowException

    lock, token = f"ddpipe-lock.{name}.{alias}", uuid.uuid4().hex
    holder = f"{socket.gethostname()} pid {os.getpid()}"
    deadline = time.monotonic() + LOCK_WAIT_S
    while True:
        try:
            client.create_registered_model(lock, tags={"ddpipe.lock": token, "holder": holder}, description=(
                f"ddpipe: held while {holder} decides {name}@{alias}; removed when it is done"))
            break
        except MlflowException as exc:
            if exc.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
        with contextlib.suppress(MlflowException):  # gone in between: try again at once
            held = client.get_registered_model(lock)
            age = time.time() - held.creation_timestamp / 1000
            if age > LOCK_STALE_S and client.get_registered_model(lock).tags == held.tags:
                print(f"MLflow: taking over the decision on {name}@{alias} from {held.tags.get('holder', '?')}, who "
                      f"left it {age:.0f} s ago", flush=True)
                client.delete_registered_model(lock)
                continue
            if time.monotonic() > deadline:
                raise TimeoutError(f"MLflow: {name}@{alias} is being decided by {held.tags.get('holder', '?')} for "
                                   f"{age:.0f} s (registered model {lock!r}); the alias was not decided")
        time.sleep(LOCK_POLL_S)
    try:
        yield
    finally:
        with contextlib.suppress(MlflowException):
            if client.get_registered_model(lock).tags.get("ddpipe.lock") == token:
                client.delete_registered_model(lock)


def _why_not(tags: dict[str, str], split: str | None, max_drop: float) -> str:
    """Why a version's tags keep it from the alias, or "" when they do not."""
    if tags.get("export_passed") != "true":
        return "its exports did not pass their check"
    if MODEL_VAL_ACCURACY not in tags:
        return "it records no validation accuracy of its exported model (trained before ddpipe chose by validation)"
    if tags.get(VAL_SPLIT) != split:
        return "it was measured on another validation split"
    if TEST_ACCURACY not in tags:
        return "it has no test accuracy (run the evaluate stage)"
    drop = float(tags[MODEL_VAL_ACCURACY]) - float(tags[TEST_ACCURACY])
    if drop > max_drop:
        return (f"the test vetoes it: test accuracy {float(tags[TEST_ACCURACY]):.4f} is {drop * 100:.2f} points below "
                f"its validation accuracy {float(tags[MODEL_VAL_ACCURACY]):.4f} (mlflow.champion_max_test_drop = "
                f"{max_drop:g})")
    return ""


def _figures(v: Any) -> str:
    return (f"version {v.version}: validation accuracy {float(v.tags[MODEL_VAL_ACCURACY]):.4f}, test "
            f"{float(v.tags[TEST_ACCURACY]):.4f} beside it")


def decide(client: Any, name: str, alias: str, version: str, max_drop: float) -> None:
    """Move ``name@alias`` to the version whose exported model has the best validation accuracy (the earliest on ties)
    among those measured on ``version``'s validation split that nothing keeps from it (:func:`_why_not`: exports
    passed, a test accuracy that does not veto it); a holder measured on another validation split stays (said, with
    how to move it by hand). Said: what moved, or why not, with each figure."""
    versions = {str(v.version): v for v in client.search_model_versions(f"name = '{name}'")}
    split = versions[version].tags.get(VAL_SPLIT)
    try:
        holder = client.get_model_version_by_alias(name, alias)
    except Exception:  # no holder yet
        holder = None
    if why := _why_not(versions[version].tags, split, max_drop):
        print(f"MLflow: version {version} of {name!r} cannot take {alias!r}: {why}", flush=True)
    if holder is not None and holder.tags.get(VAL_SPLIT, split) != split:
        print(f"MLflow: {name}@{alias} stays on version {holder.version}: it was measured on another validation "
              f"split ({holder.tags.get(VAL_SPLIT)} vs {split}). Move it by hand if wanted: MlflowClient()."
              f"set_registered_model_alias({name!r}, {alias!r}, {version!r})", flush=True)
        return
    eligible = [v for v in versions.values() if not _why_not(v.tags, split, max_drop)]
    if not eligible:
        print(f"MLflow: {name}@{alias} not moved: no version measured on this validation split may take it",
              flush=True)
        return
    best = max(eligible, key=lambda v: (float(v.tags[MODEL_VAL_ACCURACY]), -int(v.version)))
    if holder is not None and str(holder.version) == str(best.version):
        print(f"MLflow: {name}@{alias} stays on {_figures(best)}; the best eligible", flush=True)
        return
    client.set_registered_model_alias(name, alias, best.version)
    was = f"; was version {holder.version}" if holder is not None else "; the first holder"
    print(f"MLflow: {name}@{alias} -> {_figures(best)}: the best validation accuracy of {len(eligible)} eligible "
          f"version(s){was}", flush=True)
