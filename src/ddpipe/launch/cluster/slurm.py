"""SLURM: the resources a queued experiment asks for, checked against what the cluster has (``sinfo``); one batch
script per group of alike experiments (an array, ``%N`` at most N at once); their states (``squeue``, then
``scontrol``/``sacct`` once ended); ``scancel``. Inside a job: its id, the srun that starts a launcher on each of
its nodes, and the requeue after a stop ahead of the time limit (as deploy/slurm/train.sbatch does).
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from ddpipe.config.schema import Config
from ddpipe.launch.cluster import RDZV_PORT, ClusterError

FORWARD = (signal.SIGUSR1,)  # --signal=B:USR1 reaches the driver only; SLURM's stops (SIGTERM) reach every process
COMMANDS = ("sbatch", "squeue", "scontrol", "scancel", "sinfo")
WARN_SECONDS = 180  # SIGUSR1 this long before the time limit: the training checkpoints its step and the job requeues


@dataclass(frozen=True)
class Resources:
    nodes: int
    gpus_per_node: int
    cpus_per_node: int | None
    mem: str | None
    time_limit: str
    partition: str | None
    account: str | None
    max_running: int | None

    @classmethod
    def of(cls, cfg: Config) -> Resources:
        c = cfg.cluster
        return cls(int(cfg.distributed.nnodes), c.gpus_per_node, c.cpus_per_node, c.mem, c.time_limit, c.partition,
                   c.account, c.max_running)

    def sbatch_options(self) -> list[str]:
        opts = [f"--nodes={self.nodes}", "--ntasks-per-node=1", f"--time={self.time_limit}"]
        opts.append(f"--cpus-per-task={self.cpus_per_node}" if self.cpus_per_node else "--exclusive")
        opts += [f"--gpus-per-node={self.gpus_per_node}"] if self.gpus_per_node else []
        opts += [f"--mem={self.mem}"] if self.mem else []
        opts += [f"--partition={self.partition}"] if self.partition else []
        opts += [f"--account={self.account}"] if self.account else []
        return opts


def available() -> None:
    missing = [c for c in COMMANDS if not shutil.which(c)]
    if missing:
        raise ClusterError(f"cluster.scheduler = 'slurm': {', '.join(missing)} not on PATH; run this on a machine that "
                           "submits to your SLURM cluster (a login node), or set cluster.scheduler: kubernetes")


def seconds(limit: str) -> int | None:
    """A SLURM time (minutes, MM:SS, HH:MM:SS, D-HH[:MM[:SS]]) in seconds; None for unlimited."""
    if limit.upper() in ("INFINITE", "UNLIMITED", "NONE"):
        return None
    days, _, rest = limit.rpartition("-")
    parts = [int(p) for p in rest.split(":")]
    if days:
        h, m, s = (parts + [0, 0])[:3]
    else:
        h, m, s = {1: (0, parts[0], 0), 2: (0, *parts), 3: tuple(parts)}[len(parts)]
    return ((int(days or 0) * 24 + h) * 60 + m) * 60 + s


@dataclass
class Partition:
    name: str
    nodes: int
    cpus: int
    gpus: int
    max_seconds: int | None


def partitions() -> dict[str, Partition]:
    """The cluster's partitions (the default under the key ``""`` as well), from ``sinfo``."""
    out = subprocess.run(["sinfo", "-h", "-o", "%P|%D|%c|%G|%l"], capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        raise ClusterError(f"sinfo exited {out.returncode}: {out.stderr.strip()} (is the SLURM controller reachable?)")
    found: dict[str, Partition] = {}
    for line in out.stdout.splitlines():
        name, nodes, cpus, gres, limit = line.split("|")
        gpus = max([int(g.split(":")[-1].split("(")[0]) for g in gres.split(",") if g.startswith("gpu")] or [0])
        p = found.setdefault(name.rstrip("*"), Partition(name.rstrip("*"), 0, 0, 0, seconds(limit)))
        p.nodes += int(nodes)
        p.cpus, p.gpus = max(p.cpus, int(cpus.rstrip("+"))), max(p.gpus, gpus)
        if name.endswith("*"):
            found[""] = p
    return found


def check(res: Resources, name: str, parts: dict[str, Partition]) -> None:
    """ClusterError when the partition cannot give ``res`` to experiment ``name``."""
    part = parts.get(res.partition or "")
    where = f"experiment {name!r}"
    if part is None:
        accepted = ", ".join(sorted(p for p in parts if p)) or "none"
        raise ClusterError(f"{where}: cluster.partition = {res.partition!r} is not a partition of this cluster; "
                           f"accepted: {accepted}" if res.partition else
                           f"{where}: the cluster has no default partition; set cluster.partition ({accepted})")
    label = f"partition {part.name!r}"
    if res.nodes > part.nodes:
        raise ClusterError(f"{where}: distributed.nnodes = {res.nodes} is more than the {part.nodes} node(s) of "
                           f"{label}; accepted: 1 to {part.nodes}")
    if res.cpus_per_node and res.cpus_per_node > part.cpus:
        raise ClusterError(f"{where}: cluster.cpus_per_node = {res.cpus_per_node} is more than the {part.cpus} CPUs "
                           f"of a node of {label}; accepted: 1 to {part.cpus}, or null (whole nodes)")
    if res.gpus_per_node > part.gpus:
        raise ClusterError(f"{where}: cluster.gpus_per_node = {res.gpus_per_node} is more than the {part.gpus} GPU(s) "
                           f"of a node of {label}; accepted: 0 to {part.gpus}")
    asked = seconds(res.time_limit)
    if part.max_seconds is not None and asked is not None and asked > part.max_seconds:
        raise ClusterError(f"{where}: cluster.time_limit = {res.time_limit!r} is more than {label}'s limit of "
                           f"{part.max_seconds // 60} minutes")
    if asked is not None and asked <= WARN_SECONDS:
        raise ClusterError(f"{where}: cluster.time_limit = {res.time_limit!r} leaves no time to train: the job is "
                           f"warned {WARN_SECONDS} s before its limit to checkpoint; accepted: above 00:03:00")


def script(res: Resources, count: int, submission: str, python: str, manifest: Path, logs: Path) -> str:
    """The batch script of ``count`` experiments alike in ``res``: an array of them when more than one."""
    array = [f"--array=0-{count - 1}" + (f"%{res.max_running}" if res.max_running else "")] if count > 1 else []
    output = logs / ("slurm-%A_%a.out" if count > 1 else "slurm-%j.out")
    lines = ["#!/bin/bash",
             f"# ddpipe.launch.cluster submission {submission}: {count} queued experiment(s), one per "
             + ("array task" if count > 1 else "job") + f"; which is which: {manifest}",
             f"#SBATCH --job-name=ddpipe-{submission}",
             *(f"#SBATCH {o}" for o in res.sbatch_options() + array),
             f"#SBATCH --signal=B:USR1@{WARN_SECONDS}   # to the driver: the training checkpoints a step, the job "
             "requeues itself",
             "#SBATCH --requeue", "#SBATCH --open-mode=append", f'#SBATCH --output="{output}"',
             # the driver appends everything after its first line to the experiment's own log
             f"exec {shlex.quote(python)} -m ddpipe.launch.cluster.job {shlex.quote(str(manifest))} "
             '"${SLURM_ARRAY_TASK_ID:-0}"',
             ""]
    return "\n".join(lines)


def submit(path: Path, count: int) -> list[str]:
    """sbatch ``path``; the job id of each of its ``count`` experiments (``123_0``... for an array)."""
    out = subprocess.run(["sbatch", "--parsable", str(path)], capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        raise ClusterError(f"sbatch {path} exited {out.returncode}: {out.stderr.strip()}")
    job = out.stdout.strip().split(";")[0]
    return [f"{job}_{i}" for i in range(count)] if count > 1 else [job]


def states(jobs: list[str]) -> dict[str, str]:
    """Each job's SLURM state (PENDING, RUNNING, COMPLETED, FAILED, CANCELLED, ...; ENDED when SLURM no longer
    knows it). ClusterError when squeue does not answer (a state is never guessed from silence)."""
    found: dict[str, str] = {}
    try:
        out = subprocess.run(["squeue", "-h", "-r", "-o", "%i|%T", "-j", ",".join(jobs)], capture_output=True,
                             text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ClusterError(f"squeue did not answer: {exc}") from None
    if out.returncode != 0 and "Invalid job id" not in out.stderr:  # every job gone is an answer, not a failure
        raise ClusterError(f"squeue exited {out.returncode}: {out.stderr.strip()} (is the SLURM controller reachable?)")
    for line in out.stdout.splitlines():
        job, _, state = line.partition("|")
        found[job] = state
    for job in jobs:
        if job not in found:
            found[job] = _ended_state(job)
    return found


def _ended_state(job: str) -> str:
    try:
        out = subprocess.run(["scontrol", "show", "job", job, "--oneliner"], capture_output=True, text=True,
                             timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ClusterError(f"scontrol did not answer: {exc}") from None
    for field in out.stdout.split():
        if field.startswith("JobState="):
            return field.split("=", 1)[1]
    if shutil.which("sacct"):
        out = subprocess.run(["sacct", "-n", "-X", "-P", "-o", "State", "-j", job], capture_output=True, text=True,
                             timeout=60)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.split()[0]
    return "ENDED"


def cancel(jobs: list[str]) -> None:
    out = subprocess.run(["scancel", *jobs], capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        raise ClusterError(f"scancel {' '.join(jobs)} exited {out.returncode}: {out.stderr.strip()}")


# -- inside a job ------------------------------------------------------------------------------


def job_id() -> str:
    """This job's id as :func:`submit` named it."""
    if os.environ.get("SLURM_ARRAY_TASK_ID") and os.environ.get("SLURM_ARRAY_JOB_ID"):
        return f"{os.environ['SLURM_ARRAY_JOB_ID']}_{os.environ['SLURM_ARRAY_TASK_ID']}"
    return os.environ.get("SLURM_JOB_ID", "")


def attempt() -> int:
    return int(os.environ.get("SLURM_RESTART_COUNT", "0")) + 1


def nodes_env(nnodes: int, workspace: Path) -> str:
    """ddpipe.launch's :data:`~ddpipe.core.environment.NODES_ENV` for a job of ``nnodes`` nodes: the rendezvous on its
    first node (this one; the address SLURM reaches it at, a port from the job id) and the srun that starts one launcher
    per node in ``workspace``."""
    job = os.environ["SLURM_JOB_ID"]
    cpus = os.environ.get("SLURM_CPUS_PER_TASK") or os.environ.get("SLURM_CPUS_ON_NODE", "1")
    # --cpus-per-task again: some SLURM versions do not pass it from sbatch to srun
    srun = ["srun", f"--nodes={nnodes}", "--ntasks-per-node=1", f"--cpus-per-task={cpus}", "--kill-on-bad-exit=1",
            f"--chdir={workspace}"]
    return shlex.join([rendezvous_endpoint(), f"ddpipe-{job}", *srun])


def rendezvous_endpoint() -> str:
    """host:port of this job's c10d rendezvous: its first node (the agent there hosts the store), at the address
    SLURM itself reaches it at (NodeAddr: the node's name unless slurm.conf says otherwise), and a port derived from
    the job id so that jobs sharing a node do not collide (``RDZV_PORT`` in the environment overrides it). The one
    recipe of both deploy/slurm/train.sbatch (``python -m ddpipe.launch.cluster.slurm rendezvous``) and the jobs
    that ``ddpipe cluster submit`` sends."""
    nodes = subprocess.run(["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]], capture_output=True,
                           text=True, check=True).stdout.split()
    info = subprocess.run(["scontrol", "show", "node", nodes[0], "--oneliner"], capture_output=True, text=True).stdout
    addr = next((f.split("=", 1)[1] for f in info.split() if f.startswith("NodeAddr=")), "") or nodes[0]
    port = os.environ.get("RDZV_PORT") or RDZV_PORT + int(os.environ["SLURM_JOB_ID"]) % 1000
    return f"{addr}:{port}"


def requeue_self() -> None:
    """After a stop ahead of the time limit: back to the queue, same id; the next run resumes the step."""
    subprocess.run(["scontrol", "requeue", os.environ["SLURM_JOB_ID"]], capture_output=True, text=True, timeout=60)


if __name__ == "__main__":  # deploy/slurm/train.sbatch: python -m ddpipe.launch.cluster.slurm rendezvous
    if sys.argv[1:] != ["rendezvous"]:
        raise SystemExit("usage: python -m ddpipe.launch.cluster.slurm rendezvous   (inside a SLURM job: host:port)")
    print(rendezvous_endpoint())
