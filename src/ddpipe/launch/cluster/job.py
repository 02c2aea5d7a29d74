"""What runs inside a job that ``ddpipe cluster submit`` sent: one queued experiment, run with DVC itself.

    python -m ddpipe.launch.cluster.job MANIFEST INDEX [--agent]

1. Its workspace (made once; a requeued job finds it again): a clone of the user's repository (``storage:
   shared``) or of ``cluster.git_remote`` (``remote``) at the experiment's baseline, with the queued changes (the
   pinned stash commit) in the working tree; the DVC cache is the user's (shared), or the data the pipeline needs
   is pulled from the DVC remote (remote).
2. ``dvc exp run --name NAME`` there: the experiment's own repository lock, its own ``params.yaml``; the train
   stage's launcher starts one agent per node through srun when the experiment asks for several nodes.
3. Its experiment ref goes back to the user's repository (shared: the outputs are already in its cache), or to
   the git remote with its outputs on the DVC remote (``dvc exp push``).

A stop is not an end: SIGUSR1 ahead of the time limit reaches the training (the whole process group of ``dvc``,
which itself ignores it), which checkpoints its step; the job requeues itself and its next run resumes there.
SLURM's own requeue and preemption signal every process of the job. How the experiment ended goes to
``results/<name>.json`` (:mod:`ddpipe.launch.cluster.records`) and, when it failed, to its MLflow run (FAILED, with the
log's path).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import NoReturn

from ddpipe.core.environment import CLUSTER_JOB_ENV, CLUSTER_LOG_ENV, NODES_ENV, REPO_ROOT_ENV, trial_spec
from ddpipe.core.exits import EXIT_PREEMPTED, STOP_SIGNALS
from ddpipe.core.logs import configure
from ddpipe.launch import workspace
from ddpipe.launch.cluster import kubernetes, records, slurm
from ddpipe.launch.cluster.queue import exp_ref

READY = ".ddpipe-ready"

logger = logging.getLogger(__spec__.name)  # its dotted name under `python -m` too (there __name__ is "__main__")


def say(text: str, level: int = logging.INFO) -> None:
    """A line of the job's log, timed."""
    logger.log(level, f"ddpipe.cluster [{time.strftime('%H:%M:%S')}]: {text}")


def sh(cmd: list[str], cwd: Path, env: dict | None = None, check: bool = True) -> int:
    say("$ " + " ".join(cmd))
    code = subprocess.run(cmd, cwd=cwd, env=env).returncode
    if check and code != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {code} in {cwd}")
    return code


def make_workspace(m: dict, e: dict, ws: Path) -> None:
    """The experiment's workspace at ``ws``: its baseline checked out, its queued changes in the working tree."""
    if not (ws / ".git").is_dir():
        shared = e["storage"] == "shared"
        workspace.make(ws, m["repo"] if shared else e["git_remote"], e["baseline_rev"], e["stash_rev"],
                       fetch=e["pin"], cache=m["cache"] if shared else "", sh=sh)
    if not (ws / READY).exists():
        if e["storage"] == "shared":
            sh(["dvc", "checkout", "--quiet"], cwd=ws, check=False)  # what the cache has; the rest is computed
        else:
            remote = ["-r", e["dvc_remote"]] if e["dvc_remote"] else []
            sh(["dvc", "pull", "--quiet", "--allow-missing", *remote], cwd=ws, check=False)
        (ws / READY).write_text(json.dumps({"host": socket.gethostname(), "time": time.time()}))


def environment(m: dict, e: dict, ws: Path, sched) -> dict[str, str]:
    env = {**os.environ, "PATH": f"{Path(m['python']).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "PYTHONPATH": str(ws / "src"),  # the experiment's own library, not the installed checkout's
           "PYTHONUNBUFFERED": "1", CLUSTER_JOB_ENV: sched.job_id(), CLUSTER_LOG_ENV: e["log"]}
    if not env.get("MLFLOW_TRACKING_URI"):  # the job's own (with credentials) wins
        env["MLFLOW_TRACKING_URI"] = e["tracking_uri"]
    if e["storage"] == "shared":  # the outbox and default store of the user's repository, not of this workspace
        env[REPO_ROOT_ENV] = m["repo"]
    if e["nnodes"] > 1:
        env[NODES_ENV] = sched.nodes_env(e["nnodes"], ws)
    return env


def trial_targets(ws: Path, name: str) -> list[str]:
    """A search's trial (``ddpipe search run --cluster``: its description in the job's environment) runs
    its one stage, the train stage, with the evaluate and export stages' tracked files out of its experiment (issue
    47: a trial never touches the test split) and how to apply it in their place (``workspace.hold_out``); any other
    experiment runs whole: ``[]``."""
    spec = trial_spec() or {}
    if spec.get("held_out"):
        workspace.hold_out(ws, spec["held_out"], spec.get("apply_note", ""), name)
    return [spec["stage"]] if spec.get("stage") else []


def run_experiment(ws: Path, name: str, env: dict, forward: tuple[signal.Signals, ...],
                   warn_seconds: float, targets: list[str] | None = None) -> tuple[int, list[int]]:
    """``dvc exp run --name NAME [TARGETS]`` in ``ws``; its exit code and the stop signals this driver received. ``dvc``
    ignores stop signals (its children set their own): a stop ends the training at a checkpointed step, never DVC
    before it. A stage that ignores them (prepare, evaluate) is killed ``warn_seconds`` after SIGUSR1, before the
    time limit would end the job without a requeue; the next run of the job runs it again."""
    stops: list[int] = []
    child: subprocess.Popen | None = None

    def kill_if_running() -> None:
        if child is not None and child.poll() is None:
            say(f"still running {warn_seconds:.0f} s after SIGUSR1 (a stage that does not checkpoint): stopped",
                logging.WARNING)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)

    def on_stop(signum: int, frame: object) -> None:
        stops.append(signum)
        say(f"received {signal.Signals(signum).name}", logging.WARNING)
        if child is not None and child.poll() is None and signum in forward:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signum)
        if signum == signal.SIGUSR1:
            timer = threading.Timer(warn_seconds, kill_if_running)
            timer.daemon = True
            timer.start()

    def ignore_stops() -> None:
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)

    for sig in STOP_SIGNALS:  # from now on: a stop is recorded, never the driver's end
        signal.signal(sig, on_stop)
    child = subprocess.Popen(["dvc", "exp", "run", "--name", name, *(targets or [])], cwd=ws, env=env,
                             start_new_session=True, preexec_fn=ignore_stops)
    if stops and forward:  # arrived while it was starting
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, stops[-1])
    return child.wait(), stops


def mlflow_run(ws: Path, e: dict) -> str | None:
    path = ws / e["run_info"]
    try:
        return json.loads(path.read_text()).get("run_id") or None
    except (OSError, ValueError):
        return None


def mark_run(e: dict, run_id: str | None, state: str) -> None:
    """The experiment's end in its MLflow run: ``ddpipe.cluster.state``; FAILED when the experiment failed after
    its training finished (its evaluation, or DVC).

    Written to the store directly, not through the outbox: this is the job's last act (no later process of the job
    would deliver a record left behind), and the experiment's own record (``results/``, the log) keeps the state
    whatever the store answers; a failure is said in the job's log."""
    if not run_id:
        return
    try:
        from mlflow import MlflowClient

        from ddpipe.tracking.run_store import bound_http_requests, store_uri
        bound_http_requests()
        client = MlflowClient(store_uri(e["tracking_uri"]))
        client.set_tag(run_id, "ddpipe.cluster.state", state)
        # a run that ended KILLED says why itself (a search's pruned trial, a stop): left so
        if state == "failed" and client.get_run(run_id).info.status not in ("FAILED", "KILLED"):
            client.set_tag(run_id, "ddpipe.cluster.log", e["log"])
            client.set_terminated(run_id, "FAILED")
    except Exception as exc:  # the experiment's own record (results/, the log) still says it
        say(f"could not mark MLflow run {run_id} {state}: {type(exc).__name__}: {exc}", logging.WARNING)


def agent(m: dict, e: dict, ws: Path, index: int) -> NoReturn:
    """Another node's pod of a Kubernetes job: when the first pod has made the workspace, its launcher."""
    while not (ws / READY).exists():
        time.sleep(2)
    rdzv = kubernetes.rendezvous(e["job"])
    env = {**os.environ, "PYTHONPATH": str(ws / "src"), "PYTHONUNBUFFERED": "1"}
    cmd = [m["python"], "-m", "ddpipe.launch", f"distributed.rdzv_endpoint={rdzv}", f"distributed.rdzv_id={e['job']}"]
    say(f"node {index} of experiment {e['name']}: " + " ".join(cmd))
    os.chdir(ws)
    os.execve(cmd[0], cmd, env)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    manifest, index = Path(argv[0]), int(argv[1])
    m = json.loads(manifest.read_text())
    e = m["experiments"][index]
    sched = slurm if m["scheduler"] == "slurm" else kubernetes
    ws, name = Path(e["workspace"]), e["name"]
    # everything from here on into the experiment's own log (on the node, where nodes share nothing), every attempt
    # appended
    Path(e["log"]).parent.mkdir(parents=True, exist_ok=True)
    log = os.open(e["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    configure()  # DDPIPE_LOG_LEVEL, as the submitting command's environment had it
    if "--agent" in argv or os.environ.get("JOB_COMPLETION_INDEX", "0") != "0":
        agent(m, e, ws, index)
    say(f"experiment {name}, job {sched.job_id()}, attempt {sched.attempt()}, on {socket.gethostname()}, "
        f"workspace {ws}")
    root = Path(m["state"])
    try:
        make_workspace(m, e, ws)
        env = environment(m, e, ws, sched)
    except Exception as exc:
        say(f"the workspace could not be made: {exc}", logging.ERROR)
        if e["storage"] == "shared":
            records.write_result(root, name, "failed", code=1, log=e["log"], reason=f"workspace: {exc}")
        return 1
    targets = trial_targets(ws, name)
    say(f"$ dvc exp run --name {name}{''.join(f' {t}' for t in targets)}   (in {ws})")
    code, stops = run_experiment(ws, name, env, sched.FORWARD, sched.WARN_SECONDS - 60, targets)
    run_id = mlflow_run(ws, e)
    if code == 0 and (ref := exp_ref(ws, name)):
        remote = ["-r", e["dvc_remote"]] if e["dvc_remote"] else []
        back = (workspace.send_back(ws, m["repo"], ref, sh) if e["storage"] == "shared" else
                sh(["dvc", "exp", "push", *remote, e["git_remote"], name], cwd=ws, check=False) == 0)
        if not back:  # done here, not back: say so, keep the workspace to push again
            say(f"experiment {name} ran but could not be sent back; its workspace is kept: {ws} (run the command "
                "above there)", logging.ERROR)
            if e["storage"] == "shared":
                records.write_result(root, name, "failed", code=1, log=e["log"], run_id=run_id or "",
                                     workspace=str(ws), reason="the experiment ref could not be pushed back")
            return 1
        mark_run(e, run_id, "succeeded")
        say(f"experiment {name} is back as {ref}" + (f" (MLflow run {run_id})" if run_id else ""))
        if e["storage"] == "shared":
            records.write_result(root, name, "succeeded", code=0, log=e["log"], exp_ref=ref, run_id=run_id or "")
            shutil.rmtree(ws, ignore_errors=True)
        return 0
    if stops:  # stopped, its step checkpointed in the workspace: the next run of the job resumes it
        if signal.SIGUSR1 in stops and m["scheduler"] == "slurm":
            say("stopped ahead of the time limit; requeueing the job", logging.WARNING)
            slurm.requeue_self()
        else:
            say(f"stopped by {signal.Signals(stops[0]).name}; the scheduler requeues or cancels the job",
                logging.WARNING)
        return EXIT_PREEMPTED
    say(f"experiment {name} failed (dvc exp run exited {code}); its workspace is kept: {ws}", logging.ERROR)
    mark_run(e, run_id, "failed")
    if e["storage"] == "shared":
        records.write_result(root, name, "failed", code=code or 1, log=e["log"], run_id=run_id or "",
                             workspace=str(ws))
    return code or 1


if __name__ == "__main__":
    raise SystemExit(main())
