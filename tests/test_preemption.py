"""Preemption with real signals at a random step: every rank stops at the same step, rank 0 checkpoints
it, the exit code asks for a resume, and the resumed run ends with the uninterrupted run's weights."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

import psutil
import pytest
import torch

from ddpipe.core.exits import EXIT_PREEMPTED
from tests.conftest import (
    CLONE_ENV,
    GIT_ENV,
    ROOT,
    STOPPED,
    UNTRACKED,
    args_for,
    free_port,
    kill_all,
    none_left_within,
    prepare_generated_folder,
    run,
    same_weights,
    subprocess_env,
    training_processes,
    wait_for_step_checkpoint,
    weights,
)

# 2 processes x 1 thread, about 30 steps an epoch on the session's 1,050 training images
EXTRA = ("num_epochs=3", "train.batch_size_per_rank=16", "distributed.nproc_per_node=2",
         "distributed.threads_per_process=1", UNTRACKED)


# a step checkpoint every 2 steps (not part of the run's fingerprint): a test waits for the one of epoch 2,
# step 2 and then signals, so the stop lands inside epoch 2 however fast the machine runs its steps
EVERY_2 = ("train.checkpoint_every_steps=2",)


def launch(tmp: Path, prepared: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "ddpipe.launch", *args_for(tmp, prepared, *EXTRA, *extra)]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory, prepared: Path) -> dict[str, torch.Tensor]:
    tmp = tmp_path_factory.mktemp("uninterrupted")
    run(launch(tmp, prepared), env=CLONE_ENV)
    return weights(tmp / "model.pt")


def _train_workers(launcher: subprocess.Popen, count: int) -> dict[int, psutil.Process]:
    """{global rank: process} of the training workers started under ``launcher``, once all are up."""
    deadline = time.time() + 120
    while time.time() < deadline and launcher.poll() is None:
        found = {}
        for p in psutil.Process(launcher.pid).children(recursive=True):
            try:
                if "ddpipe.launch.worker" in p.cmdline() and "RANK" in p.environ():
                    found[int(p.environ()["RANK"])] = p
            except psutil.NoSuchProcess:
                continue
        if len(found) == count:
            return found
        time.sleep(0.1)
    raise AssertionError(f"{count} workers did not start (launcher exit {launcher.poll()})")


def _sigterm_inside_epoch_2(cmd: list[str], tmp_path: Path) -> tuple[str, str, str]:
    """Run a launcher ``cmd`` (checkpointing every 2 steps into tmp_path/ckpt), SIGTERM it alone once epoch 2's
    step-2 checkpoint exists; it exits 75. The (signal, epoch, step) every rank says it stopped at."""
    log = tmp_path / "log.txt"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=subprocess_env(CLONE_ENV), stdout=out, stderr=subprocess.STDOUT)
        try:
            wait_for_step_checkpoint(tmp_path / "ckpt", 2, 2, lambda: proc.poll() is None)
            sent = time.time()
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=300)
            print(f"exited {time.time() - sent:.1f} s after SIGTERM")
        finally:
            proc.kill()
    text = log.read_text()
    assert proc.returncode == EXIT_PREEMPTED, text[-4000:]
    (stopped,) = set(STOPPED.findall(text))  # every rank that says so names the same step
    return stopped


@pytest.mark.slow
def test_a_stop_signal_to_one_rank_stops_every_rank_at_one_step_and_the_restart_ends_equal(
        tmp_path: Path, prepared: Path, uninterrupted: dict[str, torch.Tensor]) -> None:
    """SIGUSR1 (SLURM's warning before a time limit) reaches rank 1 only: rank 0 learns of it through the
    per-step agreement, both stop after the same step, rank 0 checkpoints it, both exit 75; torchrun
    restarts the group (max_restarts=1), which resumes at that step and ends bit-equal."""
    log = tmp_path / "log.txt"
    with open(log, "w") as out:
        proc = subprocess.Popen(launch(tmp_path, prepared, "distributed.max_restarts=1", *EVERY_2), cwd=ROOT,
                                env=subprocess_env(CLONE_ENV), stdout=out, stderr=subprocess.STDOUT)
        try:
            workers = _train_workers(proc, 2)
            wait_for_step_checkpoint(tmp_path / "ckpt", 2, 2, lambda: proc.poll() is None)
            workers[1].send_signal(signal.SIGUSR1)
            proc.wait(timeout=600)
        finally:
            proc.kill()
    text = log.read_text()
    assert proc.returncode == 0, text[-4000:]
    (sig, epoch, step), = set(STOPPED.findall(text))  # every rank that says so names the same step
    assert sig == "SIGUSR1" and (epoch, int(step) > 0) == ("2", True)
    assert f"resuming from {tmp_path / 'ckpt'} at epoch {epoch}, step {step}" in text, text[-4000:]
    assert f"failed (exitcode: {EXIT_PREEMPTED})" in text  # torchrun on the stopped attempt
    print(f"stopped at epoch {epoch}, step {step}")
    assert same_weights(weights(tmp_path / "model.pt"), uninterrupted)


@pytest.mark.slow
def test_sigterm_to_the_launcher_exits_75_and_the_same_command_resumes_equal(
        tmp_path: Path, prepared: Path, uninterrupted: dict[str, torch.Tensor]) -> None:
    """SIGTERM to `python -m ddpipe.launch` alone (Kubernetes signals a container's PID 1 only): it passes
    it on through torchrun, the workers checkpoint one step and it exits 75; the same command resumes."""
    sig, epoch, step = _sigterm_inside_epoch_2(launch(tmp_path, prepared, *EVERY_2), tmp_path)
    assert sig == "SIGTERM" and (epoch, int(step) > 0) == ("2", True)
    saved = sorted(p.name for p in (tmp_path / "ckpt").glob("ckpt-*.pt"))
    assert saved[-1].endswith(f"-e{int(epoch) - 1:04d}-s{int(step):06d}.pt"), saved
    assert not (tmp_path / "model.pt").exists()
    # what DVC shows of it meanwhile: epoch 1's history row and metrics, marked running (issue 49)
    assert len((tmp_path / "history.csv").read_text().splitlines()) == 2
    live = json.loads((tmp_path / "train.json").read_text())["train"]
    assert live["running"] is True and live["epochs"] == 1 and live["exported_epoch"] == 1, live

    resumed = run(launch(tmp_path, prepared), env=CLONE_ENV)
    assert f"at epoch {epoch}, step {step}" in resumed.stderr
    print(f"stopped at epoch {epoch}, step {step}")
    assert same_weights(weights(tmp_path / "model.pt"), uninterrupted)
    done = json.loads((tmp_path / "train.json").read_text())["train"]  # the finished training's, as before
    assert "running" not in done and done["epochs"] == 3  # EXTRA's num_epochs
    assert len((tmp_path / "history.csv").read_text().splitlines()) == 4


def _checkpoint_every_2_steps(clone: Path) -> None:
    """The clone's checkpoints gone, and a step checkpoint every 2 steps (not part of the run's fingerprint): a test
    that waits for epoch 2's step-2 checkpoint signals inside epoch 2 however fast or slow the host runs."""
    for old in (clone / "checkpoints").glob("ckpt-*.pt"):
        old.unlink()
    params = clone / "params.yaml"
    text = params.read_text()
    assert text.count("  checkpoint_every_steps: 0") == 1
    params.write_text(text.replace("  checkpoint_every_steps: 0", "  checkpoint_every_steps: 2"))


def _group_gone(leader: subprocess.Popen, seconds: float) -> bool:
    """Whether every process of ``leader``'s group (torchrun, its workers) has ended within ``seconds``."""
    deadline = time.time() + seconds
    while time.time() < deadline:
        leader.poll()  # reap the leader, or its zombie keeps the group alive
        try:
            os.killpg(leader.pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    return False


@pytest.mark.slow
def test_sigterm_to_dvc_repro_leaves_a_step_checkpoint_and_the_next_repro_resumes_equal(repro_clone: Path) -> None:
    """A scheduler's SIGTERM to the whole process group of a running `dvc repro`: the stage fails,
    dvc.lock is unchanged, a checkpoint of the step is left, and the next `dvc repro` resumes from it
    and ends with the weights the uninterrupted `dvc repro` (the clone's own) ended with."""
    model = repro_clone / "models" / "model.pt"
    reference = weights(model)
    lock = (repro_clone / "dvc.lock").read_text()
    _checkpoint_every_2_steps(repro_clone)
    log = repro_clone / "repro.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(["dvc", "repro", "--force", "train"], cwd=repro_clone, stdout=out,
                                stderr=subprocess.STDOUT, env=subprocess_env(CLONE_ENV), start_new_session=True)
        gone = False
        try:
            wait_for_step_checkpoint(repro_clone / "checkpoints", 2, 2, lambda: proc.poll() is None)
            os.killpg(proc.pid, signal.SIGTERM)
            gone = _group_gone(proc, 120)
            assert gone, "processes of the stopped `dvc repro` are still running"
        finally:
            if not gone:
                os.killpg(proc.pid, signal.SIGKILL)
    text = log.read_text()
    (sig, epoch, step), = set(STOPPED.findall(text))
    assert sig == "SIGTERM" and (epoch, int(step) > 0) == ("2", True), text[-3000:]
    assert (repro_clone / "dvc.lock").read_text() == lock
    assert run(["git", "status", "--porcelain", "dvc.lock"], cwd=repro_clone, env=GIT_ENV).stdout == ""

    again = run(["dvc", "repro", "train"], cwd=repro_clone, env=CLONE_ENV, timeout=900)  # what is compared
    assert f"resuming from checkpoints at epoch {epoch}, step {step}" in again.stderr, again.stderr[-3000:]
    print(f"stopped at epoch {epoch}, step {step}")
    assert same_weights(weights(model), reference)


@pytest.fixture(scope="module")
def encoded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A generated folder of JPEG/PNG files of many sizes, prepared (encoded)."""
    return prepare_generated_folder(tmp_path_factory.mktemp("encoded"), 300, 0.1)


# 2 processes x 1 thread, 2 loader workers each decoding and cropping, 15 steps an epoch, a checkpoint every 2
ENCODED = ("num_epochs=3", "data.image_size=32", "data.num_workers=2", "train.batch_size_per_rank=8",
           "model.name=resnet_compact", "distributed.nproc_per_node=2", "distributed.threads_per_process=1",
           "train.hflip=true", "train.checkpoint_every_steps=2", UNTRACKED)


# the recipe in the workers (a policy, erasing, MixUp/CutMix partners) and in the checkpoint (the weight average)
RECIPE = ("train.ema_decay=0.9", "train.auto_augment=randaugment", "train.random_erasing=0.25",
          "train.mixup_alpha=0.2", "train.cutmix_alpha=1.0", "data.eval_image_size=40")


@pytest.mark.slow
def test_encoded_images_with_loader_workers_resume_mid_epoch_to_equal_weights(tmp_path: Path, encoded: Path) -> None:
    """Persistent loader workers decode, crop and augment ahead of the step: a SIGTERM mid-epoch checkpoints that
    step, and the resumed run's workers start at it, ending with the uninterrupted run's weights and weight
    average."""
    whole = tmp_path / "whole"
    run([sys.executable, "-m", "ddpipe.launch", *args_for(whole, encoded, *ENCODED, *RECIPE)], env=CLONE_ENV)
    cmd = [sys.executable, "-m", "ddpipe.launch", *args_for(tmp_path, encoded, *ENCODED, *RECIPE)]
    _, epoch, step = _sigterm_inside_epoch_2(cmd, tmp_path)
    resumed = run(cmd, env=CLONE_ENV)
    assert f"resuming from {tmp_path / 'ckpt'} at epoch {epoch}, step {step}" in resumed.stderr
    print(f"stopped at epoch {epoch}, step {step}")
    assert same_weights(weights(tmp_path / "model.pt"), weights(whole / "model.pt"))
    newest = [torch.load(sorted((d / "ckpt").glob("ckpt-*.pt"))[-1], weights_only=True) for d in (tmp_path, whole)]
    assert same_weights(newest[0]["ema"]["average"], newest[1]["ema"]["average"])
    assert same_weights(newest[0]["model"], newest[1]["model"])


@pytest.mark.slow
def test_a_training_stopped_at_two_processes_resumes_at_one_and_takes_the_same_samples(
        tmp_path: Path, prepared: Path) -> None:
    """What it takes: the same global batch (2 x 16 then 1 x 32) and effective lr (lr_scaling none); the
    checkpoint's fingerprint has neither the world size nor the per-rank batch. In exact mode the arithmetic
    does not depend on the world size either, so if every remaining step takes the same samples, the run ends
    bit-equal to one trained at 1 process throughout."""
    common = ("num_epochs=2", "distributed.exact=true", "train.lr_scaling=none", "distributed.threads_per_process=1",
              "train.checkpoint_every_steps=2", UNTRACKED)
    one = ("train.batch_size_per_rank=32", "distributed.nproc_per_node=1")
    whole = tmp_path / "whole"
    run([sys.executable, "-m", "ddpipe.launch", *args_for(whole, prepared, *common, *one)], env=CLONE_ENV)
    two = [sys.executable, "-m", "ddpipe.launch",
           *args_for(tmp_path, prepared, *common, "train.batch_size_per_rank=16", "distributed.nproc_per_node=2")]
    _, epoch, step = _sigterm_inside_epoch_2(two, tmp_path)
    resumed = run([sys.executable, "-m", "ddpipe.launch", *args_for(tmp_path, prepared, *common, *one)],
                  env=CLONE_ENV)
    assert (f"resuming from {tmp_path / 'ckpt'} at epoch {epoch}, step {step} (checkpointed at world size 2, "
            "now 1") in resumed.stderr, resumed.stderr[-3000:]
    print(f"stopped at 2 processes at epoch {epoch}, step {step}; resumed at 1")
    assert same_weights(weights(tmp_path / "model.pt"), weights(whole / "model.pt"))


def _start_in_own_session(cmd: list[str], log: IO[str]) -> subprocess.Popen:
    """A launcher ``cmd`` in a session of its own (its process group is what a test kills), writing to ``log``."""
    return subprocess.Popen(cmd, cwd=ROOT, env=subprocess_env(CLONE_ENV), stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


def _resumes_equal(cmd: list[str], tmp_path: Path, text: str,
                   uninterrupted: dict[str, torch.Tensor]) -> subprocess.CompletedProcess:
    """After a kill in epoch 2 whose log is ``text``: every rank stopped by the SIGTERM its watch sent, at one step
    (of epoch 2, or of epoch 3 where epoch 2's remaining steps take less than the watch's look: 0.5 s an epoch on an
    AMX CPU), after a checkpoint; ``cmd`` run again resumes at that step and ends bit-equal to ``uninterrupted``."""
    (sig, epoch, step), = set(STOPPED.findall(text))
    assert sig == "SIGTERM" and epoch in ("2", "3"), text[-3000:]
    resumed = run(cmd, env=CLONE_ENV)
    assert f"resuming from {tmp_path / 'ckpt'} at epoch {epoch}, step {step}" in resumed.stderr
    print(f"stopped at epoch {epoch}, step {step}")
    assert same_weights(weights(tmp_path / "model.pt"), uninterrupted)
    return resumed


@pytest.mark.slow
def test_sigkill_to_the_launchers_process_group_leaves_no_worker_and_the_same_command_resumes_equal(
        tmp_path: Path, prepared: Path, uninterrupted: dict[str, torch.Tensor]) -> None:
    """`kill -9 -PGID` of `python -m ddpipe.launch` in epoch 2 (the OOM killer, a closed session's supervisor): the
    launcher and torchrun die at once, the workers (in sessions of their own) notice, stop at the next step after
    rank 0's checkpoint, and are gone within 5 s; meanwhile a second training on the same directories is refused
    before any worker starts, naming the first's pid; the same command then resumes and ends bit-equal."""
    log, marker = tmp_path / "log.txt", str(tmp_path)
    cmd = launch(tmp_path, prepared, *EVERY_2)
    with open(log, "w") as out:
        proc = _start_in_own_session(cmd, out)
        try:
            _train_workers(proc, 2)
            second = run(cmd, env=CLONE_ENV, check=False, timeout=300)
            assert second.returncode != 0 and "torch.distributed.run" not in second.stdout + second.stderr, \
                second.stderr[-2000:]
            assert f"pid {proc.pid}" in second.stderr and f"kill {proc.pid}" in second.stderr, second.stderr[-2000:]
            wait_for_step_checkpoint(tmp_path / "ckpt", 2, 2, lambda: proc.poll() is None)
            os.killpg(proc.pid, signal.SIGKILL)
            killed = time.time()
            proc.wait()
            left = none_left_within(marker, 5.0)
            assert not left, f"still running 5 s after the kill: {[p.info['cmdline'] for p in left]}"
            print(f"every process gone {time.time() - killed:.1f} s after the SIGKILL")
        finally:
            kill_all(marker)
    text = log.read_text()
    assert "the torchrun agent" in text or "the launcher" in text, text[-3000:]
    resumed = _resumes_equal(cmd, tmp_path, text, uninterrupted)
    assert "taking over" in resumed.stderr and f"pid {proc.pid}" in resumed.stderr, resumed.stderr[-2000:]


@pytest.mark.slow
def test_sigkill_to_the_torchrun_agent_alone_stops_its_workers_and_the_same_command_resumes_equal(
        tmp_path: Path, prepared: Path, uninterrupted: dict[str, torch.Tensor]) -> None:
    """SIGKILL to torchrun alone in epoch 2: its workers stop at the next step after a checkpoint, the launcher waits
    for them (they still hold the training's directories) and exits 137, leaving nothing running; the same command
    resumes and ends bit-equal."""
    log, marker = tmp_path / "log.txt", str(tmp_path)
    cmd = launch(tmp_path, prepared, *EVERY_2)
    with open(log, "w") as out:
        proc = _start_in_own_session(cmd, out)
        try:
            workers = _train_workers(proc, 2)
            agent = psutil.Process(workers[0].ppid())
            assert "torch.distributed.run" in " ".join(agent.cmdline())
            wait_for_step_checkpoint(tmp_path / "ckpt", 2, 2, lambda: proc.poll() is None)
            agent.kill()
            assert proc.wait(timeout=120) == 128 + signal.SIGKILL
            left = none_left_within(marker, 2.0)
            assert not left, f"still running after the launcher ended: {[p.info['cmdline'] for p in left]}"
        finally:
            kill_all(marker)
    text = log.read_text()
    assert "was killed by SIGKILL" in text and "the torchrun agent" in text, text[-3000:]
    _resumes_equal(cmd, tmp_path, text, uninterrupted)


@pytest.mark.slow
def test_sigkill_to_dvc_repro_leaves_a_step_checkpoint_and_the_next_repro_resumes_equal(repro_clone: Path) -> None:
    """`dvc repro` SIGKILLed as a process group mid-training (DVC's lock goes with it): the workers, which notice
    their dead launcher within a poll (not at once, as a signal to them would be: so the kill comes early, at epoch
    1's step 2, for the stop to land inside an epoch on a fast host too) stop after a checkpoint and are gone within
    5 s, dvc.lock is unchanged, and the next `dvc repro` resumes from that step (the
    killed training's lock taken over, no traceback) and ends with the uninterrupted `dvc repro`'s weights."""
    model = repro_clone / "models" / "model.pt"
    reference = weights(model)
    lock = (repro_clone / "dvc.lock").read_text()
    _checkpoint_every_2_steps(repro_clone)
    log, marker = repro_clone / "repro.log", str(repro_clone)
    with open(log, "w") as out:
        proc = subprocess.Popen(["dvc", "repro", "--force", "train"], cwd=repro_clone, stdout=out,
                                stderr=subprocess.STDOUT, env=subprocess_env(CLONE_ENV), start_new_session=True)
        try:
            wait_for_step_checkpoint(repro_clone / "checkpoints", 1, 2, lambda: proc.poll() is None)
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            left = none_left_within(marker, 5.0)
            assert not left, f"still running 5 s after the kill: {[p.info['cmdline'] for p in left]}"
        finally:
            kill_all(marker)
    text = log.read_text()
    stops = set(STOPPED.findall(text))
    assert len(stops) == 1, f"not one stop at a step: {stops}\n{text[-3000:]}"
    (sig, epoch, step), = stops
    # after epoch 1's step 2: in epoch 1, or in epoch 2 when the workers' poll of their launcher (every 0.1 s) came
    # after epoch 1's last step or in its validation (16 steps take under a second on a fast host); the resume below
    # from exactly that step, bit-equal, is what matters
    assert sig == "SIGTERM" and (int(epoch), int(step)) >= (1, 2) and epoch in ("1", "2"), text[-3000:]
    assert (repro_clone / "dvc.lock").read_text() == lock

    again = run(["dvc", "repro", "train"], cwd=repro_clone, env=CLONE_ENV, timeout=900)  # what is compared
    assert "Traceback" not in again.stdout + again.stderr, (again.stdout + again.stderr)[-3000:]
    assert f"resuming from checkpoints at epoch {epoch}, step {step}" in again.stderr, again.stderr[-3000:]
    print(f"stopped at epoch {epoch}, step {step}")
    assert same_weights(weights(model), reference)


@pytest.mark.slow
def test_sigkill_to_one_node_of_two_stops_every_rank_at_one_step_and_both_nodes_resume_equal(
        tmp_path: Path, prepared: Path, uninterrupted: dict[str, torch.Tensor]) -> None:
    """Two nodes on this host (two launchers, a c10d rendezvous on 127.0.0.1, one process each): the process group of
    the node whose worker is global rank 0 is SIGKILLed in epoch 2. Its worker follows its dead launcher, and through
    the per-step agreement the other node's worker stops at the same step; rank 0 checkpoints it, no worker is left
    5 s later, and the two nodes run again resume there and end with the one-node run's weights."""
    port, marker = free_port(), str(tmp_path)

    def node() -> list[str]:
        return [sys.executable, "-m", "ddpipe.launch",
                *args_for(tmp_path, prepared, *EXTRA, "distributed.nproc_per_node=1", "distributed.nnodes=2",
                          f"distributed.rdzv_endpoint=127.0.0.1:{port}", "distributed.rdzv_id=kill-one-node")]

    logs = [tmp_path / f"node{i}.log" for i in range(2)]
    nodes = [subprocess.Popen(node() + list(EVERY_2), cwd=ROOT, env=subprocess_env(CLONE_ENV), stdout=open(log, "w"),
                              stderr=subprocess.STDOUT, start_new_session=True) for log in logs]
    try:
        ranks = {rank: i for i, launcher in enumerate(nodes) for rank in _train_workers(launcher, 1)}
        wait_for_step_checkpoint(tmp_path / "ckpt", 2, 2, lambda: all(n.poll() is None for n in nodes))
        killed = nodes[ranks[0]]
        os.killpg(killed.pid, signal.SIGKILL)
        killed.wait()
        workers = [p for p in training_processes(marker) if "torch.distributed.run" not in " ".join(p.cmdline())
                   and "ddpipe.launch" not in " ".join(p.cmdline())]
        deadline = time.time() + 5
        while any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in workers) and time.time() < deadline:
            time.sleep(0.1)
        left = [p for p in workers if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert not left, f"workers still running 5 s after the kill: {[p.cmdline() for p in left]}"
        assert nodes[1 - ranks[0]].wait(timeout=120) != 0  # the other node ends, without a checkpoint of its own
    finally:
        kill_all(marker)
    text = "".join(log.read_text() for log in logs)
    (sig, epoch, step), = set(STOPPED.findall(text))  # both ranks, on both nodes, stopped at one step
    # in epoch 2 after its step 2, or in epoch 3 when the killed node's worker noticed its dead launcher (a poll every
    # 0.1 s) after epoch 2's last step or in its validation, as on a host busy with another test
    assert sig == "SIGTERM" and (int(epoch), int(step)) >= (2, 2) and epoch in ("2", "3"), text[-4000:]
    # rank 0's line, and the other node's at the same step unless its agent, which lost the c10d store with the
    # killed node, ended it first (on a busy host); the resume from that step below, bit-equal, is the check
    assert 1 <= len(STOPPED.findall(text)) <= 2, text[-4000:]

    port = free_port()
    again = [subprocess.Popen(node(), cwd=ROOT, env=subprocess_env(CLONE_ENV), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=600)[0] for p in again]
    assert [p.returncode for p in again] == [0, 0], outs[0][-3000:] + outs[1][-3000:]
    assert any(f"at epoch {epoch}, step {step}" in out for out in outs)
    print(f"stopped at epoch {epoch}, step {step}")
    assert same_weights(weights(tmp_path / "model.pt"), uninterrupted)
