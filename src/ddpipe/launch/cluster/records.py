"""What ``ddpipe cluster`` submitted and how each experiment ended, under ``.dvc/tmp/cluster`` of the
user's repository (ignored by git and DVC):

    submissions/<id>/     the job script or manifests and manifest.json (what each job's driver reads)
    experiments/<name>.json   the experiment's job, log and workspace (written at submit)
    results/<name>.json       how it ended: succeeded, failed or cancelled, with its exit code, experiment ref and
                              MLflow run (written by the job's driver on a shared filesystem, by cancel, or by wait)
    logs/<name>.log           everything the experiment's job printed, every attempt appended
    work/<submission>/<name>/ its workspace (cluster.storage: shared)
    history/<submission>/     the records and results of a submission whose names were submitted again
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ddpipe.core.files import atomic_write_json

FINAL = ("succeeded", "failed", "cancelled")


def state_dir(repo: Path) -> Path:
    return Path(repo).resolve() / ".dvc" / "tmp" / "cluster"


@dataclass
class Record:
    name: str
    submission: str
    scheduler: str
    job: str           # the scheduler's id of the experiment's own job: 123, or 123_4 for an array's task
    log: str
    workspace: str     # on the nodes (remote: a node-local path)
    storage: str
    git_remote: str    # remote: where its experiment ref is pushed and pulled from
    dvc_remote: str    # remote: where its outputs are pushed ("" = the default remote)
    stash_rev: str
    baseline_rev: str
    submitted: float
    test_metrics: str  # the experiment's paths.test_metrics, read from its experiment commit

    def save(self, root: Path) -> None:
        atomic_write_json(root / "experiments" / f"{self.name}.json", asdict(self))


def records(root: Path) -> list[Record]:
    """Every submitted experiment, oldest submission first."""
    found = [Record(**json.loads(p.read_text())) for p in (root / "experiments").glob("*.json")]
    return sorted(found, key=lambda r: (r.submitted, r.name))


def result(root: Path, name: str) -> dict | None:
    path = root / "results" / f"{name}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def write_result(root: Path, name: str, state: str, keep: bool = False, **fields: object) -> None:
    """How experiment ``name`` ended; ``keep``: not over a result already there (the job's own word wins)."""
    assert state in FINAL, state
    path = root / "results" / f"{name}.json"
    if not (keep and path.exists()):
        atomic_write_json(path, {"state": state, "time": time.time(), **fields})


def archive(root: Path, name: str) -> None:
    """An earlier submission's record and result of ``name`` out of the way of a new one (kept under history/)."""
    old = root / "experiments" / f"{name}.json"
    if not old.is_file():
        return
    submission = json.loads(old.read_text())["submission"]
    for kind in ("experiments", "results"):
        path = root / kind / f"{name}.json"
        if path.is_file():
            dest = root / "history" / submission / kind / path.name
            dest.parent.mkdir(parents=True, exist_ok=True)
            path.rename(dest)
