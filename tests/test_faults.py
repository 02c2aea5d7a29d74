"""The fault suite: multi-node on one machine, hangs, failing workers, interrupted pipelines,
invalid parameters and hostile checkpoints. Each scenario asserts its outcome (RELIABILITY.md)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch

from ddpipe.config.schema import DistributedConfig
from ddpipe.launch.torchrun import torchrun_command
from tests.conftest import (
    CLONE_ENV,
    ROOT,
    UNTRACKED,
    args_for,
    free_port,
    max_rel_diff,
    run,
    subprocess_env,
    torchrun,
    weights,
)


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _wait_for_checkpoint(directory: Path, proc: subprocess.Popen, seconds: float = 300) -> None:
    deadline = time.time() + seconds
    while time.time() < deadline and proc.poll() is None:
        if directory.exists() and list(directory.glob("ckpt-*.pt")):
            return
        time.sleep(0.05)
    raise AssertionError("no checkpoint appeared while the run was alive")


@pytest.mark.slow
def test_two_torchrun_agents_on_one_machine_match_one_agent_with_two_processes(tmp_path: Path,
                                                                                 prepared: Path) -> None:
    """--nnodes=2 --nproc-per-node=1 with a c10d rendezvous on 127.0.0.1 == one agent, 2 processes.
    Both agents see that they share the host, so each process gets 1 of the 2 cores in both launches:
    the same arithmetic, hence the same weights (bit for bit here)."""
    common = ["num_epochs=1", UNTRACKED]
    run(torchrun(2, *args_for(tmp_path / "single", prepared, *common)))
    port = free_port()
    two_nodes = DistributedConfig(nnodes="2", rdzv_endpoint=f"127.0.0.1:{port}", rdzv_id="fault-suite")
    agents = [subprocess.Popen(
        torchrun_command(two_nodes, 1, args_for(tmp_path / "multi", prepared, *common)),
        cwd=ROOT, env=subprocess_env(CLONE_ENV), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for _ in range(2)]
    for agent in agents:
        out, _ = agent.communicate(timeout=600)
        assert agent.returncode == 0, out[-4000:]
    assert max_rel_diff(weights(tmp_path / "single" / "model.pt"), weights(tmp_path / "multi" / "model.pt")) < 1e-4


def _kill_all(*pids: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.slow
def test_a_rank_that_stops_answering_fails_the_job_within_the_timeout(tmp_path: Path, prepared: Path) -> None:
    """A rank stopped (SIGSTOP: alive but silent, the worst kind of failure) in epoch 2: rank 0 fails within the
    collective timeout (and a 5 s barrier that names the silent rank), saying so. Once it has, the silent rank is
    let go (SIGCONT): torchrun's stop reaches it, instead of torch's 30 s wait before a SIGKILL of a process that
    cannot answer."""
    timeout_s = 10
    proc = subprocess.Popen(
        torchrun(2, *args_for(tmp_path, prepared, "num_epochs=50", f"distributed.timeout_s={timeout_s}")),
        cwd=ROOT, env=subprocess_env(CLONE_ENV), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    _wait_for_checkpoint(tmp_path / "ckpt", proc)
    workers = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    stopped = int(sorted(workers, key=int)[-1])
    os.kill(stopped, signal.SIGSTOP)
    started, failed_after, lines = time.time(), None, []
    # a job that never fails: its agent and workers killed, so that the pipe they hold closes
    watchdog = threading.Timer(timeout_s * 12, _kill_all, (proc.pid, *map(int, workers)))
    watchdog.start()
    try:
        for line in proc.stdout:  # the pipe closes when torchrun ends
            lines.append(line)
            if failed_after is None and f"did not complete within distributed.timeout_s = {timeout_s} s" in line:
                failed_after = time.time() - started
                os.kill(stopped, signal.SIGCONT)
        proc.wait(timeout=timeout_s * 12)
    finally:
        watchdog.cancel()
        _kill_all(*map(int, workers))
    out = "".join(lines)
    assert proc.returncode != 0
    assert failed_after is not None and failed_after < timeout_s * 3, (failed_after, out[-4000:])
    assert "rank 0/2" in out


@pytest.mark.slow
def test_a_worker_that_always_fails_gives_up_after_max_restarts(repro_clone: Path) -> None:
    """torchrun restarts the group max_restarts times, then exits non-zero naming rank and cause;
    dvc repro fails and dvc.lock is unchanged."""
    params = repro_clone / "params.yaml"
    params.write_text(params.read_text().replace("max_restarts: 0", "max_restarts: 1"))
    lock = _digest(repro_clone / "dvc.lock")
    train = repro_clone / "data" / "prepared" / "train.images.npy"
    train.unlink()  # a DVC-cached file is read-only and linked: replace it, never write through it
    train.write_bytes(b"this is not a tensor file")
    result = run(["dvc", "repro", "--single-item", "train"], cwd=repro_clone, env=CLONE_ENV, check=False, timeout=600)
    out = result.stdout + result.stderr
    assert result.returncode != 0
    # torchrun restarted the group once (attempt_1), then gave up, naming the rank and the cause
    assert "attempt_1" in out and "attempt_2" not in out, out[-6000:]
    assert out.count("PreparedDataError: data/prepared/train.images.npy: cannot be read") >= 2, out[-6000:]
    assert "Root Cause" in out and "rank      : 0" in out, out[-6000:]
    assert _digest(repro_clone / "dvc.lock") == lock


@pytest.mark.slow
def test_sigint_during_dvc_repro_then_repro_resumes(repro_clone: Path) -> None:
    params = repro_clone / "params.yaml"
    params.write_text(params.read_text().replace("num_epochs: 2", "num_epochs: 6"))
    proc = subprocess.Popen(["dvc", "repro"], cwd=repro_clone, env=subprocess_env(CLONE_ENV), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    checkpoints = repro_clone / "checkpoints"
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if any("-e0003-" in p.name for p in checkpoints.glob("ckpt-*.pt")):
            break
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C sends to the whole foreground group
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode != 0, out[-3000:]
    again = run(["dvc", "repro", "evaluate"], cwd=repro_clone, env=CLONE_ENV, timeout=600)  # no export: not read
    assert "resuming from checkpoints at epoch" in again.stdout + again.stderr
    assert "Running stage 'evaluate'" in again.stdout


@pytest.mark.slow
@pytest.mark.parametrize("old, bad", [
    ("num_epochs: 2", "num_epochs: abc"), ("num_epochs: 2", "num_epochs: -3"), ("num_epochs: 2", "num_epochs: 2.5"),
    ("  optimizer: adamw", "  optimizer: adamw\n  no_such_key: 1"), ("  base_lr: 0.003", "  base_lr: 0"),
])
def test_invalid_params_fail_before_torchrun_and_overwrite_nothing(repro_clone: Path, old: str, bad: str) -> None:
    params = repro_clone / "params.yaml"
    assert old in params.read_text()
    params.write_text(params.read_text().replace(old, bad))
    before = {p: _digest(repro_clone / p) for p in ("dvc.lock", "data/prepared/train.images.npy", "metrics/test.json")}
    model = repro_clone / "models" / "model.pt"
    model_digest = _digest(model)
    result = run(["dvc", "repro"], cwd=repro_clone, env=CLONE_ENV, check=False, timeout=300)
    out = result.stdout + result.stderr
    assert result.returncode != 0
    assert bad.split(":")[0].strip() in out or "no_such_key" in out
    assert "torch.distributed.run" not in out and "OMP_NUM_THREADS" not in out  # torchrun never started
    assert {p: _digest(repro_clone / p) for p in before} == before
    assert not model.exists() or _digest(model) == model_digest


@pytest.mark.slow
def test_dvc_exp_run_with_a_bad_value_fails(repro_clone: Path) -> None:
    result = run(["dvc", "exp", "run", "-S", "num_epochs=abc"], cwd=repro_clone, env=CLONE_ENV, check=False,
                 timeout=300)
    assert result.returncode != 0
    assert "num_epochs = 'abc' is not accepted" in result.stdout + result.stderr


@pytest.mark.slow
def test_pickle_payload_in_the_checkpoint_directory_never_runs(tmp_path: Path, prepared: Path) -> None:
    """The newest checkpoint is replaced by a pickle payload: training refuses it, falls back to the
    previous checkpoint, completes, and the payload's code never runs."""
    args = args_for(tmp_path, prepared, "num_epochs=2", "train.keep_checkpoints=2")
    run(["python", "stages/train_worker.py", *args])
    newest = sorted((tmp_path / "ckpt").glob("ckpt-*.pt"))[-1]
    marker = tmp_path / "payload-ran"
    payload = tmp_path / "payload.py"
    payload.write_text(
        "import os, pickle, sys, torch\n"
        "class P:\n"
        "    def __reduce__(self):\n"
        f"        return (os.system, ('touch {marker}',))\n"
        "torch.save({'fingerprint': sys.argv[2], 'model': P()}, sys.argv[1])\n")
    fingerprint = newest.name.split("-")[1]
    run(["python", str(payload), str(newest), fingerprint])
    result = run(["python", "stages/train_worker.py", *args, "num_epochs=2"])
    assert "cannot be loaded" in result.stderr and "resuming from" in result.stderr
    assert not marker.exists()
    assert torch.load(tmp_path / "model.pt", weights_only=True)["state_dict"]


def test_a_loss_gone_to_inf_stops_every_rank_at_one_step_and_keeps_the_last_good_checkpoint(
        tmp_path: Path, prepared: Path) -> None:
    """2 processes at a learning rate of 1e30: the logits overflow within a few steps and the gradients are no longer
    finite. Every rank stops at that step before its update (none waits on a collective for a rank gone on), with one
    line naming the epoch, the step, the norm and the usual suspects; the MLflow run is FAILED with that line; the
    newest checkpoint is the step before (the weights finite); nothing is written as if the training had finished. As
    a search's trial, it tells the study where it diverged and why, for the driver to record it pruned there."""
    import optuna
    from mlflow import MlflowClient

    from ddpipe.core.environment import TRIAL_ENV
    from ddpipe.core.trials import open_storage

    journal = str(tmp_path / "study.journal")
    study = optuna.create_study(study_name="cliff", storage=open_storage(journal), direction="maximize")
    trial = study.ask({"train.base_lr": optuna.distributions.FloatDistribution(1e-4, 3.0, log=True)})
    spec = {"storage": journal, "study": "cliff", "trial": trial.number, "trial_id": trial._trial_id,
            "metric": "val_accuracy", "pruner": "none", "startup_trials": 1}
    result = run(torchrun(2, *args_for(tmp_path, prepared, "train.optimizer=sgd", "train.base_lr=1e30",
                                       "train.warmup_epochs=0", "train.checkpoint_every_steps=1")),
                 env={**CLONE_ENV, TRIAL_ENV: json.dumps(spec)}, check=False, timeout=300)
    out = result.stdout + result.stderr
    assert result.returncode != 0
    said = [line for line in out.splitlines() if line.startswith("training diverged at epoch ")]
    assert len(said) == 1 and "train.base_lr = 1e+30 (lower it)" in said[0], out[-4000:]
    epoch, step = map(int, re.match(r"training diverged at epoch (\d+), step (\d+)", said[0]).groups())
    assert "did not complete within distributed.timeout_s" not in out
    newest = sorted((tmp_path / "ckpt").glob("ckpt-*.pt"))[-1]  # the step before (epoch - 1 and step - 1: from 0)
    assert newest.name.endswith(f"-e{epoch - 1:04d}-s{step - 1:06d}.pt"), (newest.name, said[0])
    state = torch.load(newest, weights_only=True)["model"]
    assert all(torch.isfinite(v).all() for v in state.values() if v.is_floating_point())
    assert not (tmp_path / "model.pt").exists()
    train_json = tmp_path / "train.json"  # written after a validation only, and then as a running training's
    assert not train_json.exists() or json.loads(train_json.read_text())["running"] is True
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    (r,) = [r for r in client.search_runs([client.get_experiment_by_name("ddpipe").experiment_id])
            if r.data.tags.get("ddpipe.sweep_parent") != "true"]  # the trial's run, not its study's parent
    assert r.info.status == "FAILED" and said[0] in r.data.tags["ddpipe.end_reason"], r.data.tags
    attrs = study.trials[trial.number].user_attrs
    assert (attrs["pruned_epoch"], attrs["pruned_step"], attrs["diverged"]) == (epoch, step, said[0]), attrs


@pytest.mark.slow
def test_the_environment_is_in_every_runs_record_and_a_new_runtime_version_shows_in_dvc_status(
        repro_clone: Path) -> None:
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{repro_clone}/mlflow.db")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    trainings = [r for r in runs if "world_size" in r.data.tags]
    assert trainings, [r.data.tags for r in runs]
    for r in trainings:  # the lock's digest, and this suite's venv (made from the lock) holding it
        assert r.data.tags["ddpipe.env_lock"] == _digest(repro_clone / "uv.lock")
        assert r.data.tags["ddpipe.env_matches_lock"] == "true"
    assert "up to date" in run(["dvc", "status"], cwd=repro_clone, env=CLONE_ENV).stdout

    def new_version(package: str) -> str:  # the lock with `package` at another version, the stages' files rewritten
        lock = repro_clone / "uv.lock"
        lock.write_text(re.sub(rf'(\[\[package\]\]\nname = "{package}"\nversion = )"[^"]+"', r'\1"999.0.0"',
                               lock.read_text()))
        run(["python", "-m", "ddpipe.config", "--stage-env"], cwd=repro_clone, env=CLONE_ENV)
        return run(["dvc", "status"], cwd=repro_clone, env=CLONE_ENV).stdout

    assert "up to date" in new_version("ruff")  # a dev tool: no stage runs with it
    status = new_version("torch")  # the stages that import it, or a package that depends on it (fetch: torchvision)
    for stage in ("fetch", "train", "evaluate", "export"):
        moved = rf"^{stage}:\n(\t.*\n)*?\t\tmodified:\s+stages/env/{stage}\.txt$"  # dvc status names the file
        assert re.search(moved, status, re.MULTILINE), status
    assert not re.search(r"^prepare:", status, re.MULTILINE), status
