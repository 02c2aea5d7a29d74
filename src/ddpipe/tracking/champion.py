"""Registered models by alias (MLflow's successor to registry stages): each version carries the test accuracy the
evaluate stage measured and the digest of the test split it measured on; an alias (``mlflow.champion_alias``,
e.g. ``champion``) moves to a new version only when it beats the current holder on the same test split.

    mlflow models serve -m models:/NAME@champion --env-manager local     # with the server's address and credentials

The evaluate stage computes the digest and the accuracy (:func:`test_split_digest`), and its outbox record is
delivered by :func:`record_and_promote`, which says in the log what it did and why.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

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
    name, alias, accuracy, split = rec["model_name"], rec.get("alias"), float(rec["test_accuracy"]), rec["split"]
    versions = client.search_model_versions(f"name = '{name}' and run_id = '{run_id}'")
    if not versions:
        print(f"MLflow: no version of registered model {name!r} comes from run {run_id}; test accuracy not "
              "recorded on the registry", flush=True)
        return
    version = str(max(int(v.version) for v in versions))
    client.set_model_version_tag(name, version, "test_accuracy", f"{accuracy:.6f}")
    client.set_model_version_tag(name, version, "test_split", split)
    if not alias:
        return
    with named_host_lock("alias", client.tracking_uri, name, alias):
        _promote(client, name, alias, version, accuracy, split)


def _promote(client: Any, name: str, alias: str, version: str, accuracy: float, split: str) -> None:
    try:
        holder = client.get_model_version_by_alias(name, alias)
    except Exception:  # no holder yet
        holder = None
    if holder is not None and holder.tags.get("test_split") != split:
        print(f"MLflow: {name}@{alias} stays on version {holder.version}: it was measured on another test split "
              f"({holder.tags.get('test_split')} vs {split}); version {version} has test accuracy {accuracy:.4f}. "
              f"Move it by hand if wanted: MlflowClient().set_registered_model_alias({name!r}, {alias!r}, "
              f"{version!r})", flush=True)
        return
    measured = [v for v in client.search_model_versions(f"name = '{name}'")
                if v.tags.get("test_split") == split and "test_accuracy" in v.tags]
    best = max(measured, key=lambda v: (float(v.tags["test_accuracy"]), -int(v.version)))
    best_acc = float(best.tags["test_accuracy"])
    if holder is None:
        client.set_registered_model_alias(name, alias, best.version)
        print(f"MLflow: {name}@{alias} -> version {best.version} (test accuracy {best_acc:.4f}; the first holder)",
              flush=True)
    elif best.version != holder.version and best_acc > float(holder.tags["test_accuracy"]):
        client.set_registered_model_alias(name, alias, best.version)
        print(f"MLflow: {name}@{alias} -> version {best.version} (test accuracy {best_acc:.4f} beats version "
              f"{holder.version}'s {float(holder.tags['test_accuracy']):.4f} on the same test split)", flush=True)
    else:
        print(f"MLflow: {name}@{alias} stays on version {holder.version} (test accuracy "
              f"{float(holder.tags['test_accuracy']):.4f}; version {version} has {accuracy:.4f} on the same test "
              "split)", flush=True)
