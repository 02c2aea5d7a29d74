"""``ddpipe search run --cluster``: each trial a job of ``ddpipe cluster`` on the ``cluster`` section's
scheduler, its experiment back as the queue's are.

The driver asks the study as it does on this host. A trial is queued as a DVC experiment with its params (``dvc exp
run --queue -n <study>-<number> -S ...``) and submitted alone (:func:`ddpipe.launch.cluster.submission.submit`), so
that its job asks for what its own params ask for: a trial with ``distributed.nnodes: 2`` is a 2-node job. At most
``search.jobs`` are submitted at once. The trial's description reaches the job in the environment the scheduler
passes on (sbatch's default), and its training reports every epoch to the study directly: the study's storage must
be reachable from the nodes (a journal file or sqlite on the shared filesystem, or a database). A job the scheduler
requeues (its time limit, a preemption) resumes its step checkpoint in its workspace and stays the same trial.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

from ddpipe.config.schema import ClusterConfig, ConfigError
from ddpipe.core.environment import TRIAL_ENV
from ddpipe.launch.cluster import ClusterError, records
from ddpipe.launch.cluster.submission import ENDED, GRACE_SECONDS, cancel, collect, live_states, scheduler, submit

ASK_EVERY_S = 10.0  # the scheduler is asked for a job's state at most this often


def check(cluster: ClusterConfig, storage: str) -> None:
    """Before any trial: SLURM answers, and the study's storage is one the nodes reach."""
    if cluster.scheduler != "slurm":  # a Kubernetes pod gets no environment of the submitter's, so no trial
        raise ConfigError(f"cluster.scheduler = {cluster.scheduler!r} is not accepted by ddpipe search run "
                          "--cluster; accepted: slurm (Kubernetes runs queued experiments: ddpipe cluster)")
    scheduler(cluster.scheduler).available()
    on_this_host = "://" not in storage or storage.startswith("sqlite:")
    if cluster.storage == "remote" and on_this_host:
        raise ConfigError(f"search.storage = {storage!r} is a file on this host, which nodes that share nothing "
                          "(cluster.storage: remote) cannot reach; expected a database they reach, e.g. "
                          "postgresql+psycopg://search@host:5432/search (deploy/tracking_server.py provisions one)")


class ClusterTrial:
    """A trial's job, polled as a process is: ``poll()`` is None until its experiment is back (0) or it failed."""

    def __init__(self, repo: Path, record: records.Record) -> None:
        self.repo, self.rec, self.root = repo, record, records.state_dir(repo)
        self.returncode: int | None = None
        self.asked_at, self.ended_at = 0.0, 0.0

    @property
    def log(self) -> Path:
        return Path(self.rec.log)

    def poll(self) -> int | None:
        if self.returncode is None and (res := self._result()) is not None:
            self.returncode = 0 if res["state"] == "succeeded" else int(res.get("code") or 1)
        return self.returncode

    def _result(self) -> dict | None:
        if (res := records.result(self.root, self.rec.name)) or time.time() - self.asked_at < ASK_EVERY_S:
            return res
        self.asked_at = time.time()
        try:
            state = live_states([self.rec]).get(self.rec.name, "UNKNOWN")
        except ClusterError:  # the scheduler does not answer: asked again later, never taken for an end
            return None
        if state.split()[0] in ENDED:
            self.ended_at = self.ended_at or time.time()
            if self.rec.storage == "remote" or time.time() - self.ended_at > GRACE_SECONDS:
                collect(self.repo, self.root, self.rec, state)
        return records.result(self.root, self.rec.name)

    def stop(self) -> None:
        """Cancel the job: the scheduler signals its processes and the training checkpoints its step."""
        cancel(self.repo, [self.rec.name])


def start(repo: Path, name: str, settings: list[str], spec: dict[str, Any]) -> ClusterTrial:
    """Queue the trial's experiment and submit it alone, its description in the job's environment; or, when a job of
    it submitted by a driver that is gone still runs, follow that one."""
    root = records.state_dir(repo)
    alive = [r for r in records.records(root) if r.name == name and not records.result(root, r.name)]
    if alive:
        return ClusterTrial(repo, alive[-1])
    subprocess.run(["dvc", "queue", "remove", name], cwd=repo, capture_output=True)  # one a killed driver queued
    queued = subprocess.run(["dvc", "exp", "run", "--queue", "-n", name, *settings], cwd=repo, capture_output=True,
                            text=True)
    if queued.returncode != 0:
        raise ClusterError(f"dvc exp run --queue -n {name} exited {queued.returncode}: {queued.stderr.strip()[-500:]}")
    before = os.environ.get(TRIAL_ENV)
    os.environ[TRIAL_ENV] = json.dumps(spec)  # sbatch passes the submitting environment on to the job
    try:
        (record,) = submit(repo, [], None, names=[name])
    finally:
        if before is None:
            os.environ.pop(TRIAL_ENV, None)
        else:
            os.environ[TRIAL_ENV] = before
    return ClusterTrial(repo, record)


def stop(process: subprocess.Popen | ClusterTrial) -> None:
    """SIGTERM to ``process`` and every process under it (the training's launcher checkpoints and exits); wait. A
    cluster's job is cancelled (its scheduler signals it)."""
    import psutil

    if isinstance(process, ClusterTrial):
        process.stop()
        return
    try:
        tree = [psutil.Process(process.pid), *psutil.Process(process.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        tree = []
    for p in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.terminate()
    process.wait()
