"""DVC's queue on a cluster (`ddpipe cluster`), for real: experiments queued with `dvc exp run --queue`
in a clone, submitted to the throwaway two-node SLURM cluster of slurm_cluster.py, back as DVC experiments and
MLflow runs; one requeued mid-training, one failing; the mistakes refused before anything is submitted; the
Kubernetes manifests validated offline. And "reproduce any past experiment" through a real SSH remote (Debian's
openssh-server on 127.0.0.1, dvc-ssh): a fresh clone pulls main's model and a pushed experiment's, byte for byte."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from ddpipe.core.environment import NODES_ENV
from ddpipe.launch.cluster import ClusterError, kubernetes
from ddpipe.launch.cluster.queue import exp_ref
from ddpipe.launch.torchrun import cluster_nodes
from tests.conftest import (
    GIT_ENV,
    VENV_BIN,
    commit_params,
    free_port,
    plain_mlflow_server,
    queue_status,
    run,
    same_weights,
    weights,
)
from tests.slurm_cluster import SlurmCluster, unavailable

CLUSTER = "ddpipe cluster".split()
# Every experiment single-threaded (the same arithmetic wherever it runs), 16 steps an epoch; one that is stopped
# mid-epoch takes STEPPED's 128 steps an epoch, a checkpoint every 2, so that the stop finds it training
SMALL = {"train.batch_size_per_rank": 64, "distributed.nproc_per_node": 1, "distributed.threads_per_process": 1,
         "train.checkpoint_every_steps": 0, "train.model_epoch": "last", "mlflow.log_model": False,
         "mlflow.log_system_metrics": False, "cluster.cpus_per_node": 1, "cluster.time_limit": "30:00"}
STEPPED = ("train.batch_size_per_rank=8", "train.checkpoint_every_steps=2")
IMAGE = "registry.internal:5000/ddpipe:1.0"  # a Kubernetes submission names its pods' image (cluster.image)
slurm_only = pytest.mark.skipif(bool(unavailable()), reason=str(unavailable()))


def queue(repo: Path, name: str, *sets: str) -> None:
    run(["dvc", "exp", "run", "--queue", "-n", name, *(a for s in sets for a in ("-S", s))], cwd=repo, env=GIT_ENV)


def queued_names(repo: Path) -> list[str]:
    out = queue_status(repo)
    return sorted(line.split()[1] for line in out.splitlines()[1:] if line.strip() and "Queued" in line)


# -- no scheduler needed ---------------------------------------------------------------------


def test_launch_under_a_cluster_job_joins_the_rendezvous_and_starts_one_launcher_per_node(monkeypatch) -> None:
    monkeypatch.setenv(NODES_ENV, "10.0.0.1:29407 ddpipe-7 srun --nodes=2 --ntasks-per-node=1")
    overrides, every_node = cluster_nodes(["num_epochs=3"])
    assert overrides == ["distributed.rdzv_endpoint=10.0.0.1:29407", "distributed.rdzv_id=ddpipe-7", "num_epochs=3"]
    assert every_node[:3] == ["srun", "--nodes=2", "--ntasks-per-node=1"]
    assert every_node[3:] == [every_node[3], "-m", "ddpipe.launch", *overrides]
    monkeypatch.setenv(NODES_ENV, "pod-0.job:29400 job")  # Kubernetes: the Job starts the other nodes' pods
    assert cluster_nodes([])[1] == []


def test_the_queue_is_refused_whole_when_one_experiment_is_wrong_and_left_as_it_was(repro_clone: Path) -> None:
    repo = repro_clone
    empty = run(CLUSTER + ["submit"], cwd=repo, check=False)
    assert empty.returncode == 2 and "holds no experiment" in empty.stderr, empty.stderr
    queue(repo, "fine", "seed=1")
    queue(repo, "wrong", "train.base_lr=-1")
    bad = run(CLUSTER + ["submit", "--dry-run", str(repo / "out")], cwd=repo, check=False)
    assert bad.returncode == 2 and "queued experiment 'wrong'" in bad.stderr, bad.stderr
    assert "train.base_lr" in bad.stderr
    run(["dvc", "queue", "remove", "wrong"], cwd=repo)
    bare = repo / "bin-without-slurm"  # a PATH with git and the venv, and no sbatch
    bare.mkdir()
    (bare / "git").symlink_to(shutil.which("git"))
    no_sbatch = run(CLUSTER + ["submit"], cwd=repo, check=False, env={"PATH": f"{VENV_BIN}:{bare}"})
    assert no_sbatch.returncode == 2 and "sbatch" in no_sbatch.stderr and "not on PATH" in no_sbatch.stderr, \
        no_sbatch.stderr
    queue(repo, "elastic", "distributed.nnodes=1:2")
    elastic = run(CLUSTER + ["submit", "--dry-run", str(repo / "out")], cwd=repo, check=False)
    assert elastic.returncode == 2 and "'elastic'" in elastic.stderr and "fixed number of nodes" in elastic.stderr, \
        elastic.stderr
    run(["dvc", "queue", "remove", "elastic"], cwd=repo)
    params = run(CLUSTER + ["submit", "--dry-run", str(repo / "out"), "num_epochs=3"], cwd=repo, check=False)
    assert params.returncode == 2 and "only cluster.* keys" in params.stderr, params.stderr
    no_image = run(CLUSTER + ["submit", "--dry-run", str(repo / "out"), "--scheduler", "kubernetes"], cwd=repo,
                   check=False)
    assert no_image.returncode == 2 and "cluster.image is not set" in no_image.stderr, no_image.stderr
    assert "make image" in no_image.stderr and not (repo / "out").exists()
    remote = run(CLUSTER + ["submit", "--dry-run", str(repo / "out"), "--scheduler", "kubernetes", "--storage",
                            "remote", f"cluster.image={IMAGE}"], cwd=repo, check=False)
    assert remote.returncode == 2 and "tracking server" in remote.stderr, remote.stderr
    assert queued_names(repo) == ["fine"]
    assert not list(repo.glob(".dvc/tmp/cluster/experiments/*.json"))
    assert "refs/ddpipe" not in run(["git", "for-each-ref"], cwd=repo).stdout


def test_kubernetes_submission_is_an_indexed_job_per_experiment_valid_for_the_api(repro_clone: Path) -> None:
    import kubernetes_validate

    repo = repro_clone
    queue(repo, "one", "seed=1")
    queue(repo, "two", "seed=2", "distributed.nnodes=2", "cluster.gpus_per_node=4")
    out = repo / "k8s"
    run(CLUSTER + ["submit", "--scheduler", "kubernetes", "--dry-run", str(out), f"cluster.image={IMAGE}"], cwd=repo)
    docs = [d for f in sorted(out.glob("*.yaml")) for d in yaml.safe_load_all(f.read_text())]
    jobs = [d for d in docs if d["kind"] == "Job"]
    assert sorted(j["metadata"]["annotations"]["ddpipe.cluster/experiment"] for j in jobs) == ["one", "two"]
    for doc in docs:
        kubernetes_validate.validate(doc, "1.30", strict=True)
    two = next(j for j in jobs if j["metadata"]["annotations"]["ddpipe.cluster/experiment"] == "two")
    assert two["spec"]["completions"] == two["spec"]["parallelism"] == 2
    pod = two["spec"]["template"]["spec"]
    assert pod["containers"][0]["image"] == IMAGE
    assert pod["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": 4}
    assert pod["subdomain"] == two["metadata"]["name"]
    assert pod["securityContext"] == kubernetes.pod_security() and pod["securityContext"]["runAsNonRoot"]  # uid 10001
    # the image's own interpreter, the repository's volume at /workspace and the group's manifest in a ConfigMap: no
    # path of this machine in anything the pods get
    assert pod["containers"][0]["command"][:4] == [kubernetes.IMAGE_PYTHON, "-m", "ddpipe.launch.cluster.job",
                                                   "/etc/ddpipe/group.json"]
    written = "".join(f.read_text() for f in out.iterdir())
    assert sys.executable not in written and str(repo.resolve()) not in written and str(repo) not in written
    (volume,) = [v for v in pod["volumes"] if "configMap" in v]
    (config,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == volume["configMap"]["name"]]
    read = json.loads(config["data"]["group.json"])
    assert read["repo"] == "/workspace" and read["python"] == kubernetes.IMAGE_PYTHON
    assert [x["name"] for x in read["experiments"]] == ["two"]
    assert all(x["workspace"].startswith("/workspace/.dvc/tmp/cluster/") for x in read["experiments"])
    assert kubernetes.rendezvous(two["metadata"]["name"]).startswith(two["metadata"]["name"] + "-0.")
    assert {"action": "Ignore", "onExitCodes": {"containerName": "ddpipe", "operator": "In", "values": [75]}} in \
        two["spec"]["podFailurePolicy"]["rules"]
    assert queued_names(repo) == ["one", "two"]  # a dry run submits nothing


def test_kubernetes_refuses_a_submission_without_an_image_naming_the_key_and_how_to_make_one() -> None:
    """cluster.image has no default (a made-up name makes pods that wait for ever): unset or empty, the submission
    stops before anything is written, naming the key and `make image`."""
    for unset in (None, ""):
        with pytest.raises(ClusterError, match=r"queued experiment 'exp': cluster\.image is not set.*make image "
                                               r"IMAGE=<registry>/ddpipe:<tag>.*cluster\.image=<registry>"):
            kubernetes.require_image(unset, "exp")
    assert kubernetes.require_image(IMAGE, "exp") == IMAGE


def test_the_pods_manifest_refuses_a_path_their_volume_does_not_hold(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    m = {"repo": str(repo), "state": str(repo / ".dvc" / "tmp" / "cluster"), "python": sys.executable,
         "cache": str(tmp_path / "elsewhere" / "cache"), "experiments": []}
    with pytest.raises(ClusterError, match=r"the DVC cache \(dvc cache dir\) = .*elsewhere/cache is outside the "
                                           r"repository .*: on Kubernetes the pods see the repository's volume only"):
        kubernetes.in_pods(m, repo)
    m["cache"] = str(repo / ".dvc" / "cache")
    assert kubernetes.in_pods(m, repo)["cache"] == "/workspace/.dvc/cache"


# -- on the throwaway SLURM cluster ------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    if unavailable():
        pytest.skip(unavailable())
    with SlurmCluster(tmp_path_factory.mktemp("slurm"), nodes=2) as c:
        yield c


def runs_by_name(repo: Path) -> dict:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{repo}/mlflow.db")
    exp = client.get_experiment_by_name("ddpipe")
    return {r.info.run_name: r for r in client.search_runs([exp.experiment_id])}


def model_md5(repo: Path, ref: str) -> str:
    """The md5 of models/model.pt that the experiment commit ``ref`` records in its dvc.lock."""
    lock = yaml.safe_load(run(["git", "show", f"{ref}:dvc.lock"], cwd=repo).stdout)
    return next(o["md5"] for o in lock["stages"]["train"]["outs"] if o["path"] == "models/model.pt")


def cached_model(repo: Path, ref: str) -> Path:
    md5 = model_md5(repo, ref)
    return repo / ".dvc" / "cache" / "files" / "md5" / md5[:2] / md5[2:]


@pytest.mark.slow
@slurm_only
def test_a_queued_grid_runs_on_slurm_and_comes_back_as_dvc_experiments_and_one_mlflow_sweep(
        cluster: SlurmCluster, repro_clone: Path) -> None:
    repo = repro_clone
    commit_params(repo, SMALL, "cluster params")
    # a sweep of two (the array's and the 2-node job's), g1's reference and a broken one: 4 pipelines (a third member
    # of the sweep, alike to g1, added a pipeline and checked nothing more)
    grid = {"g1": ("seed=1", "train.base_lr=0.003"), "g3": ("seed=2", "train.base_lr=0.01", "distributed.nnodes=2")}
    for name, sets in grid.items():
        queue(repo, name, *sets, *(STEPPED if name == "g1" else ()), "mlflow.sweep=grid")
    queue(repo, "ref", "seed=1", "train.base_lr=0.003", *STEPPED)  # g1 uninterrupted: g1 is requeued mid-training
    (repo / "stages" / "evaluate.py").write_text("raise RuntimeError('broken on purpose')\n")
    queue(repo, "broken", "seed=3")
    run(["git", "checkout", "stages/evaluate.py"], cwd=repo)
    env = {"SLURM_CONF": str(cluster.conf), **GIT_ENV, "MLFLOW_TRACKING_URI": ""}

    submitted = run(CLUSTER + ["submit"], cwd=repo, env=env)
    assert queued_names(repo) == [], "submitted experiments left DVC's queue (dvc queue start would rerun them)"
    jobs = {line.split()[1].rstrip(":"): line.split()[4].rstrip(",") for line in submitted.stdout.splitlines()
            if line.startswith("submitted ")}
    assert sorted(jobs) == ["broken", "g1", "g3", "ref"], submitted.stdout
    assert len({j.split("_")[0] for j in jobs.values()}) == 2  # one array of the alike three, one 2-node job

    # g1 requeued by the scheduler once its training checkpointed step 4 of epoch 1
    work = repo / ".dvc" / "tmp" / "cluster" / "work"
    deadline = time.time() + 600
    while not list(work.glob("*/g1/checkpoints/ckpt-*-e0000-s000004.pt")) and time.time() < deadline:
        time.sleep(0.01)
    assert list(work.glob("*/g1/checkpoints/ckpt-*-e0000-s000004.pt")), \
        (repo / ".dvc/tmp/cluster/logs/g1.log").read_text()[-3000:]
    cluster.scontrol("requeue", jobs["g1"])
    # SLURM holds a requeued job ~2 min (AuthInfo's cred_expire) from the moment its first run has ended; released
    # here once it is back in the queue, it starts as soon as a CPU is free (its resume is the same whenever it starts)
    deadline = time.time() + 120
    while time.time() < deadline and (cluster.job(jobs["g1"]).get("Restarts"),
                                      cluster.job(jobs["g1"])["JobState"]) != ("1", "PENDING"):
        time.sleep(0.5)
    cluster.scontrol("update", f"JobId={jobs['g1']}", "StartTime=now", check=False)  # (running again: nothing to do)

    waited = run(CLUSTER + ["wait", "--poll", "2", "--timeout", "1500"], cwd=repo, env=env, check=False, timeout=1600)
    logs = repo / ".dvc" / "tmp" / "cluster" / "logs"
    assert waited.returncode == 1, f"{waited.stdout}\n{waited.stderr}\n" + (logs / "g1.log").read_text()[-3000:]
    assert "broken" in waited.stderr and "1 of 4 experiment(s) did not succeed" in waited.stderr, waited.stderr

    shown = json.loads(run(["dvc", "exp", "show", "--json"], cwd=repo).stdout)
    exps = {x["revs"][0]["name"]: x["revs"][0] for b in shown for x in (b.get("experiments") or [])}
    assert sorted(exps) == ["g1", "g3", "ref"], sorted(exps)
    for name, e in exps.items():
        metrics = e["data"]["metrics"]["metrics/test.json"]["data"]["test"]
        assert 0.1 < metrics["accuracy"] <= 1, (name, metrics)
        assert e["data"]["params"]["params.yaml"]["data"]["seed"] == int(grid.get(name, ("seed=1",))[0][-1])
    g3 = exps["g3"]["data"]["params"]["params.yaml"]["data"]
    assert g3["distributed"]["nnodes"] == 2 and "world size 2 (2 node(s)" in (logs / "g3.log").read_text()

    runs = runs_by_name(repo)
    parent = runs["grid"]
    children = [r for r in runs.values() if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert sorted(r.data.tags["dvc_exp_name"] for r in children) == ["g1", "g3"]
    assert {r.info.status for r in children} == {"FINISHED"}
    for r in children:  # the run names its experiment and job; the experiment names its run (models/run.json)
        ref = exp_ref(repo, r.data.tags["dvc_exp_name"])
        assert json.loads(run(["git", "show", f"{ref}:models/run.json"], cwd=repo).stdout)["run_id"] == r.info.run_id
        assert r.data.tags["ddpipe.cluster.job"] == jobs[r.data.tags["dvc_exp_name"]]
    broken = next(r for r in runs.values() if r.data.tags.get("dvc_exp_name") == "broken")
    assert broken.info.status == "FAILED"
    assert "broken on purpose" in Path(broken.data.tags["ddpipe.cluster.log"]).read_text()

    # requeued: a second attempt resumed g1's checkpoint and ended with the uninterrupted run's weights
    assert "attempt 2" in (logs / "g1.log").read_text()
    g1, ref = (weights(cached_model(repo, exp_ref(repo, name))) for name in ("g1", "ref"))
    assert same_weights(g1, ref)

    # an experiment back in the workspace: its model and metrics from the cache, nothing left to do
    run(["dvc", "exp", "apply", "g3"], cwd=repo)
    run(["dvc", "checkout"], cwd=repo)
    assert "up to date" in run(["dvc", "status"], cwd=repo).stdout
    assert json.loads((repo / "metrics" / "test.json").read_text()) == json.loads(
        run(["git", "show", f"{exp_ref(repo, 'g3')}:metrics/test.json"], cwd=repo).stdout)
    status = run(CLUSTER + ["status"], cwd=repo, env=env).stdout
    assert "succeeded" in status and "failed" in status and "broken" in status


@pytest.mark.slow
@slurm_only
def test_a_search_on_slurm_runs_each_trial_as_a_job_of_its_own_resources_and_prunes(
        cluster: SlurmCluster, repro_clone: Path) -> None:
    """ddpipe search run --cluster: 4 trials, 2 jobs at once, the first on 2 nodes, the third with a
    learning rate that cannot learn (pruned after epoch 1 of 2 on its node); every completed trial back as a DVC
    experiment, the study ending with exactly 4 finished trials and none running."""
    import optuna

    repo = repro_clone
    commit_params(repo, {
        **SMALL, "search.study": "cs",
        "search.trials": 4, "search.jobs": 2, "search.startup_trials": 1,
        "search.space": {"train.base_lr": "loguniform(1e-4, 1e-1)", "distributed.nnodes": "choice(1, 2)"},
        "search.first": [{"train.base_lr": 0.003, "distributed.nnodes": 2},
                         {"train.base_lr": 0.01, "distributed.nnodes": 1},
                         {"train.base_lr": 1e-7, "distributed.nnodes": 1}]}, "a search")
    env = {"SLURM_CONF": str(cluster.conf), **GIT_ENV, "MLFLOW_TRACKING_URI": ""}
    searched = run(["python", "-m", "ddpipe.search", "run", "--cluster"], cwd=repo, env=env, timeout=1800)
    out = searched.stdout + searched.stderr  # the driver's lines are messages, on stderr
    assert "slurm job" in out, out

    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(
        str(repo / "search" / "cs" / "study.journal")))
    study = optuna.load_study(study_name="cs", storage=storage)
    states = {t.number: t.state.name for t in study.trials}
    assert len(states) == 4 and set(states.values()) <= {"COMPLETE", "PRUNED"}, (states, out)
    assert states[2] == "PRUNED" and study.trials[2].user_attrs["pruned_epoch"] == 1, out
    for t in study.trials:
        assert bool(exp_ref(repo, f"cs-{t.number}")) == (t.state.name == "COMPLETE"), (t.number, out)
    logs = repo / ".dvc" / "tmp" / "cluster" / "logs"
    assert "world size 2 (2 node(s)" in (logs / "cs-0.log").read_text()


# -- a real SSH remote --------------------------------------------------------------------------


@pytest.fixture
def ssh_remote(tmp_path: Path):
    """sshd on 127.0.0.1 (its own config, host key and authorized key) and a HOME whose known_hosts holds its
    host key: dvc-ssh verifies it as for any server."""
    sshd = Path("/usr/sbin/sshd")
    if not sshd.exists() or os.geteuid() != 0:
        pytest.skip("needs Debian's openssh-server and root (make system-deps installs it)")
    d = tmp_path / "ssh"
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    d.mkdir()
    for key in ("host", "client"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / key)], check=True)
    (d / "authorized_keys").write_text((d / "client.pub").read_text())
    port = free_port()
    (d / "sshd_config").write_text("\n".join([
        f"Port {port}", "ListenAddress 127.0.0.1", f"HostKey {d / 'host'}", f"PidFile {d / 'sshd.pid'}",
        f"AuthorizedKeysFile {d / 'authorized_keys'}", "PermitRootLogin prohibit-password", "StrictModes no",
        "UsePAM no", "PasswordAuthentication no", "Subsystem sftp internal-sftp", ""]))
    Path("/run/sshd").mkdir(exist_ok=True)
    proc = subprocess.Popen([str(sshd), "-D", "-e", "-f", str(d / "sshd_config")], stderr=subprocess.PIPE)
    host_key = (d / "host.pub").read_text().split()[:2]
    (home / ".ssh" / "known_hosts").write_text(f"[127.0.0.1]:{port} {' '.join(host_key)}\n")
    deadline = time.time() + 20
    while time.time() < deadline:
        if subprocess.run(["ssh", "-i", str(d / "client"), "-p", str(port), "-o", "BatchMode=yes", "-o",
                           f"UserKnownHostsFile={home / '.ssh' / 'known_hosts'}", "root@127.0.0.1", "true"],
                          capture_output=True).returncode == 0:
            break
        time.sleep(0.3)
    try:
        yield f"ssh://root@127.0.0.1:{port}{tmp_path / 'store'}", d / "client", home
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.mark.slow
def test_a_fresh_clone_reproduces_main_and_a_pushed_experiment_from_an_ssh_remote(
        repro_clone: Path, ssh_remote: tuple, tmp_path: Path) -> None:
    url, key, home = ssh_remote
    repo = repro_clone
    env = {**GIT_ENV, "HOME": str(home), "MLFLOW_TRACKING_URI": ""}
    run(["dvc", "remote", "add", "-d", "ssh-store", url], cwd=repo, env=env)
    run(["dvc", "remote", "modify", "--local", "ssh-store", "keyfile", str(key)], cwd=repo, env=env)
    run(["git", "commit", "-qam", "an ssh remote"], cwd=repo, env=env)
    origin = tmp_path / "origin.git"
    run(["git", "clone", "-q", "--bare", str(repo), str(origin)], env=env)
    run(["git", "remote", "add", "origin", str(origin)], cwd=repo, env=env)
    run(["dvc", "push"], cwd=repo, env=env, timeout=600)
    run(["dvc", "exp", "run", "-n", "pushed", "-S", "seed=5"], cwd=repo, env=env, timeout=900)
    run(["dvc", "exp", "push", "origin", "pushed"], cwd=repo, env=env, timeout=600)
    pushed_model = cached_model(repo, exp_ref(repo, "pushed")).read_bytes()
    run(["git", "checkout", "-q", "--", "."], cwd=repo, env=env)
    run(["dvc", "checkout", "--force"], cwd=repo, env=env)

    other = tmp_path / "elsewhere"  # another user's machine: a clone, no cache, only the remotes
    run(["git", "clone", "-q", str(origin), str(other)], env=env)
    run(["dvc", "remote", "modify", "--local", "ssh-store", "keyfile", str(key)], cwd=other, env=env)
    run(["dvc", "pull"], cwd=other, env=env, timeout=600)
    for f in ("models/model.pt", "metrics/test.json", "metrics/train.json"):
        assert (other / f).read_bytes() == (repo / f).read_bytes(), f
    assert "Data and pipelines are up to date" in run(["dvc", "status"], cwd=other, env=env).stdout
    repro = run(["dvc", "repro"], cwd=other, env=env, timeout=600).stdout
    assert "Running stage" not in repro, repro

    run(["dvc", "exp", "pull", "origin", "pushed"], cwd=other, env=env, timeout=600)
    run(["dvc", "exp", "apply", "pushed"], cwd=other, env=env)
    run(["dvc", "pull"], cwd=other, env=env, timeout=600)
    assert (other / "models" / "model.pt").read_bytes() == pushed_model


@pytest.fixture
def tracking_server(tmp_path: Path) -> Iterator[str]:
    """A plain `mlflow server` (sqlite behind it) on 127.0.0.1: what jobs on nodes that share nothing log to."""
    with plain_mlflow_server(tmp_path) as url:
        yield url


@pytest.mark.slow
@slurm_only
def test_nodes_that_share_nothing_clone_pull_and_push_through_the_git_and_dvc_remotes(
        cluster: SlurmCluster, repro_clone: Path, ssh_remote: tuple, tracking_server: str, tmp_path: Path) -> None:
    """cluster.storage=remote: the job's workspace and DVC cache are its own (node-local), its data comes from
    the SSH remote, its experiment goes back through the git remote and the SSH remote; `wait` pulls it here."""
    url, key, home = ssh_remote
    repo = repro_clone
    env = {"SLURM_CONF": str(cluster.conf), **GIT_ENV, "HOME": str(home), "MLFLOW_TRACKING_URI": tracking_server}
    commit_params(repo, SMALL, "cluster params")
    run(["dvc", "remote", "add", "-d", "ssh-store", url], cwd=repo, env=env)
    run(["dvc", "remote", "modify", "ssh-store", "keyfile", str(key)], cwd=repo, env=env)  # the nodes' credentials
    run(["git", "commit", "-qam", "an ssh remote"], cwd=repo, env=env)
    run(["dvc", "push"], cwd=repo, env=env, timeout=600)
    origin = tmp_path / "origin.git"
    run(["git", "clone", "-q", "--bare", str(repo), str(origin)], env=env)
    run(["git", "remote", "add", "origin", str(origin)], cwd=repo, env=env)
    queue(repo, "far", "train.base_lr=0.01")
    nodes = tmp_path / "node-local"

    run(CLUSTER + ["submit", "--storage", "remote", f"cluster.workdir={nodes}"], cwd=repo, env=env)
    waited = run(CLUSTER + ["wait", "--poll", "2", "--timeout", "900"], cwd=repo, env=env, check=False, timeout=1000)
    log = next(nodes.glob("*/far.log"), nodes / "far.log")
    tail = log.read_text()[-4000:] if log.exists() else ""
    assert waited.returncode == 0, f"{waited.stdout}\n{waited.stderr}\n{tail}"
    text = log.read_text()
    assert "dvc pull" in text and "dvc exp push" in text and "Running stage 'train'" in text, text[-3000:]
    assert list(nodes.glob("*/far/.dvc/cache/files"))  # its own cache, filled from the SSH remote

    ref = exp_ref(repo, "far")
    run(["dvc", "exp", "apply", "far"], cwd=repo, env=env)
    run(["dvc", "checkout"], cwd=repo, env=env)
    assert "up to date" in run(["dvc", "status"], cwd=repo, env=env).stdout
    assert hashlib.md5((repo / "models" / "model.pt").read_bytes()).hexdigest() == model_md5(repo, ref)

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_server)
    (r,) = client.search_runs([client.get_experiment_by_name("ddpipe").experiment_id],
                              filter_string="tags.dvc_exp_name = 'far'")
    assert r.info.status == "FINISHED" and r.data.tags["ddpipe.cluster.state"] == "succeeded"
