"""A throwaway SLURM cluster on this host, from Debian's packages (slurm-wlm, slurmctld, slurmd, munge):
its own munge key and socket, slurm.conf, spool, state and log directories, and free ports, all in
one directory. Two nodes on one host: two ``slurmd -N <node>`` with their own ports, both addressed
as 127.0.0.1. Every daemon it started is stopped on exit, jobs first, whatever happened.

    with SlurmCluster(tmp_path / "slurm") as cluster:
        job = cluster.sbatch(["--nodes=2", "deploy/slurm/train.sbatch", "num_epochs=2"], cwd=ROOT)
        cluster.wait(job, {"COMPLETED"}, seconds=600)

Needs root (slurmd starts job steps as the submitting user) and the packages: ``make system-deps``.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from ddpipe.core.processes import alive
from tests.conftest import free_port

DAEMONS = ("munged", "slurmctld", "slurmd")
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
                "DEADLINE", "PREEMPTED"}


def unavailable() -> str | None:
    """Why no cluster can start here, or None."""
    missing = [d for d in DAEMONS if not (shutil.which(d) or Path(f"/usr/sbin/{d}").exists())]
    if missing:
        return f"{', '.join(missing)} not installed (make system-deps, as root, installs Debian's slurm-wlm and munge)"
    if os.geteuid() != 0:
        return "slurmd must run as root to start job steps (run the SLURM tests as root)"
    return None


def _daemon(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


class SlurmCluster:
    def __init__(self, directory: Path, nodes: int = 2, cpus: int | None = None) -> None:
        self.dir = Path(directory)
        self.nodes = [f"n{i + 1}" for i in range(nodes)]
        self.cpus = cpus or os.cpu_count() or 1
        self.conf = self.dir / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self._pid_files: list[Path] = []

    # -- lifecycle ---------------------------------------------------------------------------

    def __enter__(self) -> SlurmCluster:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        d = self.dir
        for sub in ("munge", "state", "log", *(f"spool/{n}" for n in self.nodes)):
            (d / sub).mkdir(parents=True, exist_ok=True)
        key = d / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        (d / "munge").chmod(0o700)
        self.munge_socket = d / "munge" / "munge.socket"
        # --force: munged refuses paths under a world-writable /tmp otherwise
        self._run([_daemon("munged"), "--force", f"--socket={self.munge_socket}", f"--key-file={key}",
                   f"--log-file={d / 'log' / 'munged.log'}", f"--pid-file={d / 'munge' / 'munged.pid'}",
                   f"--seed-file={d / 'munge' / 'munged.seed'}"])
        self._pid_files.append(d / "munge" / "munged.pid")
        self.conf.write_text(self._slurm_conf())
        self._run([_daemon("slurmctld"), "-f", str(self.conf)])
        self._pid_files.append(d / "slurmctld.pid")
        for node in self.nodes:
            self._run([_daemon("slurmd"), "-f", str(self.conf), "-N", node])
            self._pid_files.append(d / f"slurmd-{node}.pid")
        self.wait_idle(60)

    def wait_idle(self, seconds: float) -> None:
        """Until every node is idle: up, and done with the steps of any job that ran on it (no process of
        a job left on this host), plus 2 s: slurmd refuses to launch a job whose credential is dated the
        same second as the kill of its previous run ("Job credential revoked")."""
        deadline = time.time() + seconds
        while time.time() < deadline and self._job_processes(jobs_only=True):
            time.sleep(0.2)
        time.sleep(2)
        states = ""
        while time.time() < deadline:
            states = self.scontrol("show", "nodes", "--oneliner", check=False).stdout
            if [line.split("State=")[1].split()[0] for line in states.splitlines()] == ["IDLE"] * len(self.nodes):
                return
            time.sleep(0.5)
        raise RuntimeError(f"the SLURM nodes were not idle within {seconds} s:\n{states}\n{self.logs()}")

    def _slurm_conf(self) -> str:
        d, host = self.dir, socket.gethostname()
        lines = [
            "ClusterName=ddpipetest",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={free_port()}",
            "SlurmUser=root", "SlurmdUser=root",
            "AuthType=auth/munge", "CredType=cred/munge", f"AuthInfo=socket={self.munge_socket}",
            f"StateSaveLocation={d / 'state'}", f"SlurmdSpoolDir={d / 'spool'}/%n",
            f"SlurmctldPidFile={d / 'slurmctld.pid'}", f"SlurmdPidFile={d}/slurmd-%n.pid",
            f"SlurmctldLogFile={d / 'log' / 'slurmctld.log'}", f"SlurmdLogFile={d / 'log'}/slurmd-%n.log",
            # no cgroups in a container: processes tracked by parentage, no CPU binding, no accounting
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none", "AccountingStorageType=accounting_storage/none",
            "MpiDefault=none", "SchedulerType=sched/backfill",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU",
            "ReturnToService=2", "JobRequeue=1", "KillWait=30", "MinJobAge=3600",
        ]
        for node in self.nodes:
            lines.append(f"NodeName={node} NodeHostname={host} NodeAddr=127.0.0.1 Port={free_port()} "
                         f"CPUs={self.cpus} State=UNKNOWN")
        lines.append(f"PartitionName=debug Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE State=UP")
        return "\n".join(lines) + "\n"

    def stop(self) -> None:
        """Cancel every job, stop the daemons, and kill whatever of them or their jobs is left."""
        if self.conf.exists():
            subprocess.run(["scancel", "--full", "--user=root"], env=self.env, capture_output=True, timeout=30)
            deadline = time.time() + 60
            while time.time() < deadline and self.squeue_ids():
                time.sleep(0.5)
            subprocess.run(["scontrol", "shutdown"], env=self.env, capture_output=True, timeout=30)
        pids = self.daemon_pids()
        munged = self.dir / "munge" / "munged.pid"
        if munged.exists() and int(munged.read_text()) in pids:  # last: slurm's shutdown needs it
            os.kill(int(munged.read_text()), signal.SIGTERM)
        deadline = time.time() + 20
        while time.time() < deadline and any(alive(p) for p in pids):
            time.sleep(0.2)
        for pid in [*pids, *self._job_processes()]:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        self._pid_files.clear()

    def _job_processes(self, jobs_only: bool = False) -> list[int]:
        """Processes of this cluster: its daemons, slurmstepd and the jobs' processes (only the last two
        with ``jobs_only``)."""
        found = []
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            try:
                cmd = (proc / "cmdline").read_bytes().decode(errors="replace")
                env = (proc / "environ").read_bytes().decode(errors="replace")
            except OSError:
                continue
            ours = str(self.dir) in cmd or f"SLURM_CONF={self.conf}" in env
            job = cmd.startswith("slurmstepd") or "SLURM_JOB_ID=" in env
            if ours and (job or not jobs_only) and alive(int(proc.name)):
                found.append(int(proc.name))
        return [p for p in found if p != os.getpid()]

    def _run(self, cmd: list[str]) -> None:
        result = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=60)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} exited {result.returncode}: {result.stderr}\n{self.logs()}")

    def logs(self) -> str:
        return "\n".join(f"== {p.name}\n{p.read_text()[-2000:]}" for p in sorted((self.dir / "log").glob("*.log")))

    # -- jobs --------------------------------------------------------------------------------

    def sbatch(self, args: list[str], cwd: Path, env: dict | None = None) -> str:
        result = subprocess.run(["sbatch", "--parsable", *args], cwd=cwd, env={**self.env, **(env or {})},
                                capture_output=True, text=True, timeout=60)
        if result.returncode != 0:
            raise RuntimeError(f"sbatch {' '.join(args)} exited {result.returncode}: {result.stderr}")
        return result.stdout.strip().split(";")[0]

    def scancel(self, *args: str) -> None:
        subprocess.run(["scancel", *args], env=self.env, capture_output=True, text=True, timeout=30, check=True)

    def daemon_pids(self) -> list[int]:
        """The pids of the daemons this cluster started and that are still running."""
        pids = [int(f.read_text()) for f in self._pid_files if f.exists() and f.read_text().strip().isdigit()]
        return [p for p in pids if alive(p)]

    def scontrol(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(["scontrol", *args], env=self.env, capture_output=True, text=True, timeout=60,
                              check=check)

    def squeue_ids(self) -> list[str]:
        out = subprocess.run(["squeue", "-h", "-o", "%i"], env=self.env, capture_output=True, text=True,
                             timeout=30).stdout
        return out.split()

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job`` as a dict (JobState, Restarts, ExitCode, ...)."""
        out = self.scontrol("show", "job", job_id, "--oneliner").stdout
        return dict(f.split("=", 1) for f in out.split() if "=" in f)

    def wait(self, job_id: str, states: set[str], seconds: float) -> dict[str, str]:
        """Until the job's state is one of ``states`` (or final); its record."""
        deadline = time.time() + seconds
        while time.time() < deadline:
            info = self.job(job_id)
            if info["JobState"] in states or info["JobState"] in FINAL_STATES:
                return info
            time.sleep(0.5)
        raise TimeoutError(f"job {job_id} still {self.job(job_id)['JobState']} after {seconds} s")


