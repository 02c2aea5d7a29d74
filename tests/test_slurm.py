"""deploy/slurm/train.sbatch on a real (throwaway, one-host, two-node) SLURM cluster: a job runs to the
end; a job stopped mid-epoch (SIGUSR1 as before a time limit, or `scontrol requeue`) is requeued and
ends with the uninterrupted job's weights. `pytest -k slurm` (or `make test-slurm`) runs these."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from ddpipe.core.processes import alive
from tests.conftest import CLONE_ENV, ROOT, STOPPED, args_for, same_weights, wait_for_step_checkpoint, weights
from tests.slurm_cluster import SlurmCluster, unavailable

pytestmark = [pytest.mark.slow, pytest.mark.skipif(bool(unavailable()), reason=str(unavailable()))]

SCRIPT = "deploy/slurm/train.sbatch"
# Two one-process nodes on one host, one thread each: the same arithmetic in every job; 65 steps an epoch, a
# checkpoint every 2 (what the stopped jobs wait for before the stop)
EXTRA = ("num_epochs=3", "train.batch_size_per_rank=8", "distributed.nproc_per_node=1",
         "distributed.threads_per_process=1", "train.checkpoint_every_steps=2")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    if not (ROOT / ".venv" / "bin" / "activate").exists():
        pytest.skip("the sbatch script activates the repo's .venv, which this checkout lacks (make setup)")
    with SlurmCluster(tmp_path_factory.mktemp("slurm"), nodes=2) as c:
        yield c


def submit(cluster: SlurmCluster, tmp: Path, prepared: Path) -> str:
    """The sbatch script as a user submits it, with options and overrides for these CPU "nodes"."""
    options = ["--nodes=2", "--gpus-per-node=0", f"--cpus-per-task={cluster.cpus}", "--time=00:30:00",
               f"--output={tmp}/job-%j.out"]
    return cluster.sbatch([*options, SCRIPT, *args_for(tmp, prepared, *EXTRA)], cwd=ROOT, env=CLONE_ENV)


def _runs(tmp: Path) -> list:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp}/mlflow.db")
    return client.search_runs([client.get_experiment_by_name("ddpipe").experiment_id])


def _log(tmp: Path, job: str) -> str:
    path = tmp / f"job-{job}.out"
    return path.read_text() if path.exists() else ""


@pytest.fixture(scope="module")
def finished_job(cluster: SlurmCluster, tmp_path_factory: pytest.TempPathFactory,
                 prepared: Path) -> tuple[Path, str]:
    tmp = tmp_path_factory.mktemp("slurm-job")
    job = submit(cluster, tmp, prepared)
    info = cluster.wait(job, {"COMPLETED"}, seconds=900)
    assert info["JobState"] == "COMPLETED", f"{info}\n{_log(tmp, job)[-5000:]}\n{cluster.logs()}"
    return tmp, job


def test_slurm_job_of_two_nodes_runs_the_sbatch_script_to_the_end(finished_job: tuple[Path, str]) -> None:
    tmp, job = finished_job
    log = _log(tmp, job)
    assert "ddpipe: 2 node(s)" in log and "rendezvous 127.0.0.1:" in log, log[-3000:]
    assert "world size 2 (2 node(s)" in log, log[-3000:]
    assert (tmp / "model.pt").exists() and (tmp / "history.csv").read_text().count("\n") == 4
    (r,) = _runs(tmp)
    assert r.info.status == "FINISHED" and r.data.params["world_size"] == "2"


@pytest.mark.parametrize("stop", ["usr1", "requeue"])
def test_slurm_job_stopped_mid_epoch_is_requeued_and_ends_with_the_uninterrupted_weights(
        stop: str, cluster: SlurmCluster, finished_job: tuple[Path, str], tmp_path: Path, prepared: Path) -> None:
    """usr1: `scancel --signal=USR1` sends the job's tasks what `#SBATCH --signal=USR1@180` sends before
    the time limit; the ranks checkpoint a step, srun exits 75 and the script requeues the job.
    requeue: `scontrol requeue` (an operator, or preemption in REQUEUE mode) stops the job with SIGTERM
    and requeues it itself. Either way the job's next run resumes at that step."""
    job = submit(cluster, tmp_path, prepared)
    cluster.wait(job, {"RUNNING"}, seconds=300)
    # into epoch 2 (its step-2 checkpoint is written), whatever the speed of this machine
    wait_for_step_checkpoint(tmp_path / "ckpt", 2, 2, lambda: cluster.job(job)["JobState"] == "RUNNING")
    if stop == "usr1":
        cluster.scancel("--signal=USR1", job)
    else:
        cluster.scontrol("requeue", job)
    deadline = time.time() + 120
    while time.time() < deadline and not (cluster.job(job)["JobState"] == "PENDING"
                                          and cluster.job(job)["Restarts"] == "1"):
        time.sleep(0.5)
    assert cluster.job(job)["Restarts"] == "1", f"{cluster.job(job)}\n{_log(tmp_path, job)[-4000:]}"
    saved = sorted(p.name for p in (tmp_path / "ckpt").glob("ckpt-*.pt"))
    # SLURM holds a requeued job ~2 min; release it as soon as the nodes are done with its first run
    cluster.wait_idle(120)
    cluster.scontrol("update", f"JobId={job}", "StartTime=now")
    info = cluster.wait(job, {"COMPLETED"}, seconds=900)
    log = _log(tmp_path, job)
    assert info["JobState"] == "COMPLETED", f"{info}\n{log[-5000:]}\n{cluster.logs()}"
    print(f"{stop}: checkpoints when stopped: {saved}")
    (sig, epoch, step), = set(STOPPED.findall(log))  # both ranks name the same step
    assert (sig, epoch, int(step) > 0) == ("SIGUSR1" if stop == "usr1" else "SIGTERM", "2", True), log[-5000:]
    assert f"at epoch 2, step {step}" in log.split("run 2 of the job")[1]  # resumed there
    if stop == "usr1":
        assert "requeueing job" in log
    (r,) = _runs(tmp_path)
    assert r.info.status == "FINISHED" and r.data.tags["ddpipe.attempts"] == "2"
    assert same_weights(weights(finished_job[0] / "model.pt"), weights(tmp_path / "model.pt"))


def test_slurm_cluster_leaves_no_daemon_behind(tmp_path: Path) -> None:
    """The cluster helper's promise: after `with`, none of the daemons it started runs any more."""
    with SlurmCluster(tmp_path / "c", nodes=1) as c:
        started = c.daemon_pids()
        assert len(started) == 3  # munged, slurmctld, one slurmd
    assert not any(alive(pid) for pid in started)
