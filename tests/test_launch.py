"""ddpipe.launch: the torchrun command it builds, and how it passes a scheduler's stop on."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from ddpipe.config.schema import ConfigError, DistributedConfig
from ddpipe.core.exits import EXIT_PREEMPTED
from ddpipe.distributed.host_leases import GpuLease
from ddpipe.engine.resolved import Job, resolve_job
from ddpipe.launch.torchrun import torchrun_command
from tests.conftest import ROOT, args_for, run, subprocess_env


def test_one_node_command_asks_torchrun_for_a_free_port_and_to_pass_on_the_stop_signals() -> None:
    cmd = torchrun_command(DistributedConfig(), 2, ["num_epochs=1"])
    assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert "--nproc-per-node=2" in cmd and "--standalone" in cmd and "--max-restarts=0" in cmd
    assert "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1" in cmd
    assert "--shutdown-timeout=60" in cmd
    assert cmd[-3:] == ["-m", "ddpipe.launch.worker", "num_epochs=1"]  # a module: no file of a checkout


def test_multi_node_command_uses_the_c10d_rendezvous() -> None:
    d = DistributedConfig(nnodes="2:4", rdzv_endpoint="node0:29400", rdzv_id="job7", max_restarts=3)
    cmd = torchrun_command(d, 8, [])
    assert "--standalone" not in cmd
    for flag in ("--nnodes=2:4", "--rdzv-backend=c10d", "--rdzv-endpoint=node0:29400", "--rdzv-id=job7",
                 "--max-restarts=3", "--nproc-per-node=8"):
        assert flag in cmd


def test_the_train_stage_runs_the_launcher() -> None:
    """dvc.yaml's train stage, deploy/ and the tests all get their torchrun command from one builder: the stage's
    script is the launcher's entry point (``python -m ddpipe.launch`` is the same command)."""
    assert yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]["train"]["cmd"] == "python stages/train.py"
    assert "from ddpipe.launch.torchrun import main" in (ROOT / "stages" / "train.py").read_text()
    for launcher in ("deploy/slurm/train.sbatch", "deploy/k8s/indexed-job.yaml", "deploy/k8s/trainjob.yaml"):
        text = (ROOT / launcher).read_text()
        assert "ddpipe.launch" in text and "torch.distributed.run" not in text, launcher


def test_print_shows_the_command_after_the_checks(prepared: Path, tmp_path: Path) -> None:
    args = args_for(tmp_path, prepared, "distributed.nproc_per_node=1")
    out = run([sys.executable, "-m", "ddpipe.launch", "--print", *args]).stdout
    assert out.strip().splitlines()[-1] == " ".join(torchrun_command(DistributedConfig(), 1, args))


@pytest.mark.parametrize("bad, message", [
    ("distributed.nproc_per_node=999", "distributed.nproc_per_node = 999 is not accepted on this node"),
    ("train.grad_accum_steps=100000", "train.grad_accum_steps = 100000"),
])
def test_mistakes_that_need_the_node_or_the_data_fail_before_torchrun(prepared: Path, tmp_path: Path, bad: str,
                                                                      message: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "ddpipe.launch", *args_for(tmp_path, prepared, bad)],
                          cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert message in proc.stderr and "torch.distributed.run" not in proc.stdout + proc.stderr


def test_nproc_is_refused_above_the_cores_of_a_cpu_node(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    monkeypatch.setattr("ddpipe.engine.resolved.cpu_count", lambda: 4)
    assert resolve_job(DistributedConfig(nproc_per_node="4")) == Job(4, 1, 1, gpus_requested=4)
    assert resolve_job(DistributedConfig(nproc_per_node="auto", nnodes="2:4")) == Job(1, 2, 4)
    with pytest.raises(ConfigError, match="it has 4 CPU cores"):
        resolve_job(DistributedConfig(nproc_per_node="5"))


def test_on_a_gpu_host_the_launcher_runs_torchrun_on_the_gpus_it_leased(
        monkeypatch: pytest.MonkeyPatch, prepared: Path, tmp_path: Path) -> None:
    """Two queue workers on an 8-GPU host (faked): an `auto` training gets 4 GPUs and 4 processes, checked
    again for that job size; the lease is given back when torchrun ends."""
    from ddpipe.launch import torchrun as launch

    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("torch.cuda.device_count", lambda: 8)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    checked, ran = [], []
    monkeypatch.setattr(launch, "preflight", lambda cfg, world_size, choice=None: checked.append(world_size))
    monkeypatch.setattr(launch, "supervise", lambda cmd, env=None: ran.append((cmd, env)) or 0)
    registry = tmp_path / "gpus"
    monkeypatch.setattr(launch, "GpuLease", lambda gpus, count: GpuLease(gpus, count, registry, lambda: 2))
    with pytest.raises(SystemExit) as exit_:
        launch.main(args_for(tmp_path, prepared))
    assert exit_.value.code == 0 and checked == [8, 4]
    ((cmd, env),) = ran
    assert "--nproc-per-node=4" in cmd and env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"
    assert [p.name for p in registry.iterdir()] == ["lock"]


def _signal_self_soon(signum: int, after: float) -> None:
    threading.Timer(after, os.kill, (os.getpid(), signum)).start()


def test_a_stop_signal_is_passed_on_and_the_launcher_exits_75() -> None:
    """SIGTERM to the launcher reaches its child (torchrun in real use); the child's failure after a
    stop becomes 75, "resume me"."""
    from ddpipe.launch.torchrun import supervise

    child = [sys.executable, "-c", "import signal, sys, time; "
             "signal.signal(signal.SIGTERM, lambda *a: sys.exit(3)); time.sleep(60); sys.exit(0)"]
    before = signal.getsignal(signal.SIGTERM)
    _signal_self_soon(signal.SIGTERM, 1.0)
    start = time.time()
    assert supervise(child) == EXIT_PREEMPTED
    assert time.time() - start < 30  # the child ended on the forwarded signal, not its 60 s sleep
    assert signal.getsignal(signal.SIGTERM) == before  # the launcher's handlers are gone again


def test_without_a_stop_the_child_exit_code_is_kept() -> None:
    from ddpipe.launch.torchrun import supervise

    assert supervise([sys.executable, "-c", "raise SystemExit(4)"]) == 4
    assert supervise([sys.executable, "-c", "pass"]) == 0


@pytest.mark.slow
def test_a_wheel_installed_outside_the_checkout_trains(tmp_path: Path, prepared: Path) -> None:
    """The package built as a wheel and installed into a new virtual environment (its dependencies this one's, read
    through a path: none of this environment's .pth files, the checkout's editable path among them), run from a
    directory with only a params.yaml: ``python -m ddpipe.launch`` trains an epoch under torchrun, whose workers
    run the wheel's ddpipe.launch.worker. No file of the checkout is needed."""
    import shutil
    import sysconfig

    source = tmp_path / "source"  # a copy: the build writes its build/ and egg-info beside the sources
    shutil.copytree(ROOT / "src", source / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path / "dist"),
         str(source)], cwd=tmp_path)
    (wheel,) = (tmp_path / "dist").glob("ddpipe-*.whl")
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=tmp_path)
    (site,) = (venv / "lib").glob("python3*/site-packages")
    run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", str(site), str(wheel)],
        cwd=tmp_path)
    (site / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "params.yaml").write_text((ROOT / "params.yaml").read_text())
    env = {k: v for k, v in subprocess_env().items() if k not in ("PYTHONPATH", "DVC_ROOT")}
    python = str(venv / "bin" / "python")
    found = subprocess.run([python, "-c", "import ddpipe, sys; print(ddpipe.__file__); print(sys.path)"],
                           cwd=elsewhere, env=env, capture_output=True, text=True, check=True).stdout
    assert found.startswith(str(site / "ddpipe")) and str(ROOT / "src") not in found, found
    out = tmp_path / "out"
    trained = subprocess.run([python, "-m", "ddpipe.launch", *args_for(out, prepared, "num_epochs=1")], cwd=elsewhere,
                             env=env, capture_output=True, text=True, timeout=600)
    assert trained.returncode == 0, trained.stderr[-4000:]
    assert "-m ddpipe.launch.worker" in trained.stderr and (out / "model.pt").is_file(), trained.stderr[-2000:]


def test_a_failed_ranks_error_file_is_written_whole_or_not_at_all(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun's agent reads a failed rank's error file once the rank has exited; a write cut short (the agent's
    SIGTERM landing in it) must leave no file, not an empty one on which the agent dies instead of restarting."""
    import json

    from torch.distributed.elastic.multiprocessing.errors import error_handler

    from ddpipe.launch.worker import ERROR_FILE_ENV, WholeErrorFile

    target = tmp_path / "error.json"
    monkeypatch.setenv(ERROR_FILE_ENV, str(target))
    try:
        raise RuntimeError("gloo: connection closed by peer")
    except RuntimeError as e:
        WholeErrorFile().record_exception(e)
    said = json.loads(target.read_text())["message"]
    assert said["message"] == "RuntimeError: gloo: connection closed by peer" and "py_callstack" in said["extraInfo"]
    target.unlink()

    def cut_short(data, fp) -> None:  # noqa: ANN001
        fp.write('{"message": ')
        raise KeyboardInterrupt  # what a signal's handler raises between two bytecodes

    monkeypatch.setattr(error_handler.json, "dump", cut_short)
    with pytest.raises(KeyboardInterrupt):
        WholeErrorFile().record_exception(RuntimeError("again"))
    assert not target.exists() and os.environ[ERROR_FILE_ENV] == str(target)
