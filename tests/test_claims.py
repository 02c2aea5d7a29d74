"""One training per directory (ddpipe.core.claims), workers that follow their launcher and launchers that follow DVC
(ddpipe.distributed.preemption.follow_launcher), with real processes: fast, no training."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from ddpipe.core.claims import LOCK_NAME, Claim, InUse, read_holders
from ddpipe.core.environment import CLAIM_ENV, LAUNCHER_ENV
from ddpipe.core.processes import start_time
from tests.conftest import ROOT, subprocess_env

HOLD = textwrap.dedent("""
    import sys, time
    from ddpipe.core.claims import Claim
    claim = Claim.take({"paths.checkpoints": sys.argv[1]}, "launcher")
    print(claim.token, flush=True)
    time.sleep(600)
""")


def _holder(directory: Path) -> subprocess.Popen:
    """A process that takes a claim on ``directory`` and holds it; its token is its first line."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(directory)], cwd=ROOT, env=subprocess_env(),
                            stdout=subprocess.PIPE, text=True)
    proc.token = proc.stdout.readline().strip()  # type: ignore[attr-defined]
    assert proc.token, "the holder did not take its claim"  # type: ignore[attr-defined]
    return proc


def test_a_second_claim_is_refused_naming_the_holder_and_the_first_is_untouched(tmp_path: Path) -> None:
    first = _holder(tmp_path / "ckpt")
    try:
        before = (tmp_path / "ckpt" / LOCK_NAME).read_text()
        with pytest.raises(InUse) as refused:
            Claim.take({"paths.checkpoints": tmp_path / "ckpt", "paths.model": tmp_path / "models"}, "launcher")
        text = str(refused.value)
        assert f"pid {first.pid}" in text and f"kill {first.pid}" in text and "paths.checkpoints" in text, text
        assert (tmp_path / "ckpt" / LOCK_NAME).read_text() == before  # the holder's file as it was
        assert not (tmp_path / "models" / LOCK_NAME).exists() or not read_holders(tmp_path / "models" / LOCK_NAME)

        # a worker of the first training joins it by its token; a process with another token is refused
        joined = Claim.join({"paths.checkpoints": tmp_path / "ckpt"}, first.token, "rank 0")  # type: ignore[attr-defined]
        assert [h.role for h in read_holders(tmp_path / "ckpt" / LOCK_NAME)] == ["launcher", "rank 0"]
        with pytest.raises(InUse, match="no longer this training's"):
            Claim.join({"paths.checkpoints": tmp_path / "ckpt"}, "another-token", "rank 1", patience_s=0.5)
    finally:
        first.kill()
        first.wait()

    # the launcher is gone, its worker (this process) still holds: refused, naming the worker that is left
    with pytest.raises(InUse) as refused:
        Claim.take({"paths.checkpoints": tmp_path / "ckpt"}, "launcher")
    assert f"its launcher (pid {first.pid}" in str(refused.value) and f"kill {os.getpid()}" in str(refused.value)
    joined.release()


def test_a_lock_left_by_a_killed_training_is_taken_over_with_a_note(tmp_path: Path, capsys) -> None:
    first = _holder(tmp_path / "ckpt")
    (tmp_path / "ckpt" / ".ckpt-abc-e0001-s000004.pt.x1y2.tmp").write_bytes(b"half a checkpoint")
    (tmp_path / "ckpt" / "ckpt-abc-e0001-s000002.pt").write_bytes(b"a whole one")
    first.send_signal(signal.SIGKILL)
    first.wait()
    with Claim.take({"paths.checkpoints": tmp_path / "ckpt"}, "launcher") as claim:
        note = capsys.readouterr().err
        assert f"pid {first.pid}" in note and "taking over" in note and "removed 1 partial file" in note, note
        assert sorted(p.name for p in (tmp_path / "ckpt").iterdir() if not p.name.startswith(".ddpipe")) == \
            ["ckpt-abc-e0001-s000002.pt"]
        assert [h.pid for h in read_holders(tmp_path / "ckpt" / LOCK_NAME)] == [os.getpid()]
        assert claim.others() == []
    # released with nobody else holding it: emptied, and the next one takes it without a note
    assert (tmp_path / "ckpt" / LOCK_NAME).read_text() == ""
    with Claim.take({"paths.checkpoints": tmp_path / "ckpt"}, "launcher"):
        assert capsys.readouterr().err == ""


def test_a_claim_held_on_another_host_is_reported_with_that_host(tmp_path: Path) -> None:
    first = _holder(tmp_path / "ckpt")
    try:
        path = tmp_path / "ckpt" / LOCK_NAME
        line = json.loads(path.read_text().splitlines()[0])
        path.write_text(json.dumps({**line, "host": "node-7", "pid": 4242}) + "\n")  # as a node of a cluster wrote it
        with pytest.raises(InUse) as refused:
            Claim.take({"paths.checkpoints": tmp_path / "ckpt"}, "launcher")
        assert "pid 4242 on host node-7" in str(refused.value) and "stop pid 4242 on node-7" in str(refused.value)
    finally:
        first.kill()
        first.wait()


FOLLOWER = textwrap.dedent("""
    import os, signal, sys, time
    from ddpipe.distributed.preemption import follow_launcher
    signal.signal(signal.SIGTERM, lambda *a: (open(sys.argv[1], "w").write(str(time.time())), os._exit(0)))
    follow_launcher("rank 0")
    print("following", flush=True)
    time.sleep(600)
""")


@pytest.mark.parametrize("killed", ["launcher", "agent"])
def test_a_worker_stops_within_seconds_of_its_launcher_or_agent_being_killed(tmp_path: Path, killed: str) -> None:
    """A stand-in launcher starts a stand-in agent (SIGKILLed alone, or the launcher alone), which starts a worker in a
    session of its own, as torchrun does: the worker gets SIGTERM (its preemption stop) within about a second."""
    done = tmp_path / "stopped"
    agent_code = ("import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', sys.argv[1], sys.argv[2]], "
                  "start_new_session=True); time.sleep(600)")
    launcher_code = ("import os, subprocess, sys, time; from ddpipe.core.processes import start_time; "
                     f"os.environ[{LAUNCHER_ENV!r}] = f'{{os.getpid()}} {{start_time(os.getpid())}}'; "
                     "p = subprocess.Popen([sys.executable, '-c', sys.argv[1], sys.argv[2], sys.argv[3]]); "
                     "print(p.pid, flush=True); time.sleep(600)")
    env = subprocess_env({"TORCHELASTIC_RUN_ID": "test"})
    env.pop(CLAIM_ENV, None)
    launcher = subprocess.Popen([sys.executable, "-c", launcher_code, agent_code, FOLLOWER, str(done)], cwd=ROOT,
                                env=env, stdout=subprocess.PIPE, text=True)
    agent_pid = int(launcher.stdout.readline())
    deadline = time.time() + 60
    worker = None
    while worker is None and time.time() < deadline:
        kids = [p for p in Path("/proc").iterdir() if p.name.isdigit() and (p / "stat").exists()]
        for p in kids:
            try:
                if int((p / "stat").read_text().rsplit(")", 1)[1].split()[1]) == agent_pid:
                    worker = int(p.name)
            except (OSError, ValueError, IndexError):
                continue
        time.sleep(0.1)
    assert worker is not None and start_time(worker)
    time.sleep(1.0)  # the worker's watch is running
    try:
        os.kill(launcher.pid if killed == "launcher" else agent_pid, signal.SIGKILL)
        killed_at = time.time()
        deadline = killed_at + 10
        while not done.exists() and time.time() < deadline:
            time.sleep(0.05)
        assert done.exists(), f"the worker did not stop after its {killed} was killed"
        print(f"stopped {float(done.read_text()) - killed_at:.2f} s after its {killed} was SIGKILLed")
    finally:
        for pid in (launcher.pid, agent_pid, worker):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        launcher.wait()


STUCK = textwrap.dedent("""
    import signal, time
    from ddpipe.distributed.preemption import follow_launcher
    signal.signal(signal.SIGTERM, lambda *a: None)  # recorded, as StopRequests does, but no step boundary comes
    follow_launcher("rank 0")
    print("following", flush=True)
    time.sleep(600)  # a long validation pass
""")


def test_a_worker_with_no_step_boundary_in_sight_leaves_a_few_seconds_after_its_launcher(tmp_path: Path) -> None:
    """Where the training cannot stop at a step (inside a validation pass, writing a finished training's outputs), a
    worker whose launcher died leaves on its own STEP_GRACE_S later, saying so: nothing outlives a dead launcher."""
    from ddpipe.distributed.preemption import STEP_GRACE_S

    launcher = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    env = subprocess_env({LAUNCHER_ENV: f"{launcher.pid} {start_time(launcher.pid)}"})
    log = tmp_path / "worker.log"  # a file: a pipe's reader may be gone with the launcher, so a pipe is muted
    with open(log, "w") as errors:
        worker = subprocess.Popen([sys.executable, "-c", STUCK], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                  stderr=errors, text=True)
    try:
        assert worker.stdout.readline().strip() == "following"
        launcher.kill()
        launcher.wait()
        worker.wait(timeout=STEP_GRACE_S + 30)
        err = log.read_text()
        assert worker.returncode == 128 + signal.SIGTERM, err
        assert "no step boundary within" in err and "resumes from its newest checkpoint" in err, err
    finally:
        worker.kill()
        launcher.kill()


FOLLOW_DVC = textwrap.dedent("""
    import sys, time
    from ddpipe.launch.torchrun import follow_dvc
    follow_dvc(lambda: open(sys.argv[1], "w").write(str(time.time())))
    print("following", flush=True)
    time.sleep(600)
""")


@pytest.mark.parametrize("shell", ["/bin/sh", "/bin/bash"])
def test_a_training_run_by_dvc_through_a_shell_stops_when_dvc_alone_is_killed(tmp_path: Path, shell: str) -> None:
    """A stand-in DVC runs the stage's command through ``$SHELL -c``, as DVC does (dash, Debian's /bin/sh and CI's
    shell, forks the command and waits for it); `dvc queue kill --force` SIGKILLs DVC's process alone: the launcher's
    stop is called within seconds all the same, though the shell between them lives on."""
    done, ready = tmp_path / "stopped", tmp_path / "following"
    command = f"{sys.executable} -c {shlex.quote(FOLLOW_DVC)} {done} > {ready}"  # as dvc.yaml: one command
    dvc = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                            "subprocess.Popen([sys.argv[1], '-c', sys.argv[2]]); time.sleep(600)", shell, command],
                           cwd=ROOT, env=subprocess_env({"DVC_STAGE": "train"}), start_new_session=True)
    try:
        deadline = time.time() + 60
        while "following" not in (ready.read_text() if ready.exists() else "") and time.time() < deadline:
            time.sleep(0.05)
        assert ready.exists(), "the stand-in training never started"
        dvc.kill()
        dvc.wait()
        deadline = time.time() + 10
        while not done.exists() and time.time() < deadline:
            time.sleep(0.05)
        assert done.exists(), f"the training did not stop after the DVC above {shell} was killed"
    finally:
        os.killpg(dvc.pid, signal.SIGKILL)
