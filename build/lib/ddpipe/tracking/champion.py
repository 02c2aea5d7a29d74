"""Registered models by alias (MLflow's successor to registry stages): each version carries the test accuracy the
evaluate stage measured and the digest of the test split it measured on, then whether its exports passed their check
(the export stage); an alias (``mlflow.champion_alias``, e.g. ``champion``) moves to a version only when its exports
passed and it beats the current holder on the same test split.

    mlflow models serve -m models:/NAME@champion --env-manager local     # with the server's address and credentials

The evaluate stage computes the digest and the accuracy (:func:`test_split_digest`), and its outbox record is
delivered by :func:`record_and_promote` (which registers the run's model first when its training did not: a search's
trial); the export stage's by :func:`record_export`, which decides; each says in
the log what it did and why.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from ddpipe.core.metric_names import TEST_ACCURACY, TEST_SPLIT
from ddpipe.core.processes import named_host_lock
from ddpipe.data.store import SPLITS


def test_split_digest(prepared: str | Path) -> str:
    """sha256 of the prepared test split's files (labels, pixels or shards and index, and meta's classes): two
    versions' accuracies compare only when this is equal."""
    directory = Path(prepared)
    h = hashlib.sha256()
    others = tuple(s for s in SPLITS if s != "test")
    for path in sorted(directory.iterdir()):
        if path.name.startswith("test") and not path.name.startswith(others):
            h.update(path.name.encode())
            with open(path, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)
    h.update((directory / "meta.json").read_bytes() if (directory / "meta.json").is_file() else b"")
    return h.hexdigest()[:16]


def record_and_promote(client: Any, run_id: str, rec: dict) -> None:
    """Tag the version registered from ``run_id`` with its test result; then move ``rec['alias']`` to the best
    version measured on the holder's test split (this one's when there is no holder), if that beats the holder.
    Each evaluate stage tags first and decides second, under a lock on this host, so evaluate stages at once
    converge on the best version whatever their order. Prints what it did."""
    name, alias, accuracy, split = rec["model_name"], rec.get("alias"), float(rec[TEST_ACCURACY]), rec["split"]
    version = _version_of(client, name, run_id, "test accuracy", quiet=True) or _register(client, name, run_id)
    if version is None:
        return
    client.set_model_version_tag(name, version, TEST_ACCURACY, f"{accuracy:.6f}")
    client.set_model_version_tag(name, version, TEST_SPLIT, split)
    if not alias:
        return
    with named_host_lock("alias", client.tracking_uri, name, alias):
        _promote(client, name, alias, version, accuracy, split)


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
    figures) and where they were logged (``uris``); then, only if they passed, move ``rec['alias']`` as
    :func:`record_and_promote` would. A version whose exports failed never takes the alias. Prints what it did."""
    name, alias, passed = rec["model_name"], rec.get("alias"), bool(rec["passed"])
    version = _version_of(client, name, run_id, "the export's check")
    if version is None:
        return
    client.set_model_version_tag(name, version, "export_passed", str(passed).lower())
    for key, value in {**rec.get("figures", {}), **uris}.items():
        client.set_model_version_tag(name, version, f"export_{key}", str(value))
    if not passed:
        print(f"MLflow: version {version} of {name!r} keeps no alias: its export failed its check ({rec['why']})",
              flush=True)
        return
    tags = client.get_model_version(name, version).tags
    if not alias or TEST_ACCURACY not in tags:
        if alias:
            print(f"MLflow: {name}@{alias} not moved: version {version} has no test accuracy (run the evaluate stage)",
                  flush=True)
        return
    with named_host_lock("alias", client.tracking_uri, name, alias):
        _promote(client, name, alias, version, float(tags[TEST_ACCURACY]), tags[TEST_SPLIT])


def _promote(client: Any, name: str, alias: str, version: str, accuracy: float, split: str) -> None:
    try:
        holder = client.get_model_version_by_alias(name, alias)
    except Exception:  # no holder yet
        holder = None
    if holder is not None and holder.tags.get(TEST_SPLIT) != split:
        print(f"MLflow: {name}@{alias} stays on version {holder.version}: it was measured on another test split "
              f"({holder.tags.get(TEST_SPLIT)} vs {split}); version {version} has test accuracy {accuracy:.4f}. "
              f"Move it by hand if wanted: MlflowClient().set_registered_model_alias({name!r}, {alias!r}, "
              f"{version!r})", flush=True)
        return
    measured = [v for v in client.search_model_versions(f"name = '{name}'")  # only those whose exports passed
                if v.tags.get(TEST_SPLIT) == split and TEST_ACCURACY in v.tags and v.tags.get("export_passed") ==
                "true"]
    if not measured:
        print(f"MLflow: {name}@{alias} not moved: no version measured on this test split has passed its export",
              flush=True)
        return
    best = max(measured, key=lambda v: (float(v.tags[TEST_ACCURACY]), -int(v.version)))
    best_acc = float(best.tags[TEST_ACCURACY])
    if holder is None:
        client.set_registered_model_alias(name, alias, best.version)
        print(f"MLflow: {name}@{alias} -> version {best.version} (test accuracy {best_acc:.4f}; the first holder)",
              flush=True)
    elif best.version != holder.version and best_acc > float(holder.tags[TEST_ACCURACY]):
        client.set_registered_model_alias(name, alias, best.version)
        print(f"MLflow: {name}@{alias} -> version {best.version} (test accuracy {best_acc:.4f} beats version "
              f"{holder.version}'s {float(holder.tags[TEST_ACCURACY]):.4f} on the same test split)", flush=True)
    else:
        print(f"MLflow: {name}@{alias} stays on version {holder.version} (test accuracy "
              f"{float(holder.tags[TEST_ACCURACY]):.4f}; version {version} has {accuracy:.4f} on the same test "
              "split)", flush=True)
