"""The experiments in DVC's queue, as ``dvc exp run --queue -S ...`` left them: each one's name, its baseline
commit, the stash commit that holds its params and code, and its params loaded and checked as a training would.

Submitting takes them off DVC's queue (``dvc queue start`` would run them a second time) after pinning each stash
commit under ``refs/ddpipe/cluster/<name>``: the job's workspace is made from that ref.
"""

from __future__ import annotations

import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ddpipe.config.load import load_config
from ddpipe.config.schema import Config, ConfigError
from ddpipe.launch.cluster import ClusterError

PIN = "refs/ddpipe/cluster/"


@dataclass(frozen=True)
class Queued:
    name: str
    stash_rev: str
    baseline_rev: str
    cfg: Config  # its params.yaml with the submit command's overrides, checked

    @property
    def pin(self) -> str:
        return PIN + self.name


def git(repo: Path, *args: str, check: bool = True) -> str:
    result = subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True)
    if check and result.returncode != 0:
        raise ClusterError(f"git {' '.join(args)} in {repo} exited {result.returncode}: {result.stderr.strip()}")
    return result.stdout.strip()


def exp_ref(repo: Path, name: str) -> str:
    """The ref of DVC experiment ``name`` in ``repo`` (``refs/exps/<baseline>/<name>``), or ""."""
    refs = git(repo, "for-each-ref", "--format=%(refname)", "refs/exps", check=False).split()
    return next((r for r in refs if r.rsplit("/", 1)[-1] == name), "")


def queued(repo: Path, overrides: list[str] = (), names: list[str] | None = None) -> list[Queued]:
    """Every experiment in ``repo``'s DVC queue (or those of ``names``) with its params (``overrides`` on top), oldest
    first. ClusterError for an empty queue, or naming the experiment whose params fail the checks."""
    from dvc.repo import Repo

    with Repo(str(repo)) as dvc:
        entries = [e for e in dvc.experiments.celery_queue.iter_queued() if names is None or e.name in names]
    if not entries:
        raise ClusterError(f"DVC's queue in {repo} holds no experiment: queue some first, e.g. "
                           "dvc exp run --queue -S seed=1,2 -S mlflow.sweep=grid")
    out = []
    for entry in entries:
        name = entry.name or entry.stash_rev[:7]
        with tempfile.TemporaryDirectory() as tmp:
            params = Path(tmp) / "params.yaml"
            params.write_text(git(repo, "show", f"{entry.stash_rev}:params.yaml"))
            try:
                cfg = load_config(list(overrides), params_file=params)
            except ConfigError as exc:
                raise ClusterError(f"queued experiment {name!r}: {str(exc).replace(str(params), 'its params.yaml')}; "
                                   "nothing was submitted (dvc queue remove " + name + " drops it)") from None
        if ":" in cfg.distributed.nnodes:
            raise ClusterError(f"queued experiment {name!r}: distributed.nnodes = {cfg.distributed.nnodes!r} is not "
                               "accepted on a cluster (a job asks for a fixed number of nodes); accepted: N")
        out.append(Queued(name, entry.stash_rev, entry.baseline_rev, cfg))
    return out


def pin_and_dequeue(repo: Path, experiments: list[Queued]) -> None:
    """Pin each stash commit under :data:`PIN` and take the experiments off DVC's queue."""
    from dvc.repo import Repo

    for exp in experiments:
        git(repo, "update-ref", exp.pin, exp.stash_rev)
    try:
        with Repo(str(repo)) as dvc:  # by stash commit: a finished experiment of the same name is not this one
            dvc.experiments.celery_queue.remove([e.stash_rev for e in experiments])
    except Exception as exc:  # the jobs are submitted: say exactly what is left to do
        names = " ".join(e.name for e in experiments)
        raise ClusterError(f"the jobs were submitted, but DVC's queue could not be emptied ({type(exc).__name__}: "
                           f"{exc}); run `dvc queue remove {names}` before any `dvc queue start`") from None
