"""Trainings at once on one host share its cores: the registry of live workers and the threads it gives."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from ddpipe.core.processes import start_time
from ddpipe.distributed import host_leases
from ddpipe.distributed.host_leases import GpuLease, HostShare, cpu_share


@pytest.fixture
def eight_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(host_leases, "cpu_count", lambda: 8)
    monkeypatch.setattr(host_leases, "RECHECK_S", 0.0)  # re-list at every call: deaths show at once
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _register(registry: Path, pid: int, content: str = "0") -> Path:
    """Process ``pid``'s entry: the threads it holds (0: it shares), or in the GPU registry its GPUs."""
    entry = registry / f"{pid}-{start_time(pid)}"
    entry.write_text(content)
    return entry


def test_alone_a_training_keeps_its_threads_and_two_split_the_cores(tmp_path: Path, eight_cores: None) -> None:
    with HostShare(None, own_processes=1, registry=tmp_path) as share:
        assert share.threads() == 8
        other = subprocess.Popen(["sleep", "60"])
        try:
            _register(tmp_path, other.pid)
            assert share.threads() == 4
            assert share.rebalance() == 4 and torch.get_num_threads() == 4 and share.rebalance() is None
        finally:
            other.kill()
            other.wait()
        assert share.threads() == 8  # the other worker died without unregistering: its entry is pruned
        assert [p.name for p in tmp_path.iterdir()] == [share.entry.name]
    assert not list(tmp_path.iterdir())  # this worker unregistered on exit


def test_a_training_never_takes_more_than_its_own_share(tmp_path: Path, eight_cores: None) -> None:
    """Its own second worker may not have registered yet: 2 processes of one job get 4 threads each."""
    with HostShare(None, own_processes=2, registry=tmp_path) as share:
        assert share.threads() == 4


def test_a_stale_entry_of_a_reused_pid_is_not_counted(tmp_path: Path, eight_cores: None) -> None:
    (tmp_path / f"{os.getpid()}-1").touch()  # this pid, but another start time: a process long gone
    with HostShare(None, own_processes=1, registry=tmp_path) as share:
        assert share.threads() == 8
    assert not list(tmp_path.iterdir())


def test_a_training_with_fixed_threads_keeps_them_and_the_others_share_what_is_left(
        tmp_path: Path, eight_cores: None) -> None:
    with HostShare(3, own_processes=1, registry=tmp_path) as fixed:  # its claim, for the others to read
        assert fixed.threads() == 3 and fixed.entry.read_text() == "3"
    assert not list(tmp_path.iterdir())
    others = [subprocess.Popen(["sleep", "60"]) for _ in range(2)]
    try:
        with HostShare(None, own_processes=1, registry=tmp_path) as share:
            _register(tmp_path, others[0].pid, "3")  # a training started with 3 threads
            assert share.threads() == 5
            _register(tmp_path, others[1].pid)  # a second sharing training
            assert share.threads() == 2
            _register(tmp_path, others[1].pid, "6")  # claims more than is left: 1 at least
            assert share.threads() == 1
            others[0].kill()
            others[0].wait()
            assert share.threads() == 2  # the 3-thread training ended: its claim went with it
    finally:
        for other in others:
            other.kill()
            other.wait()


def test_an_evaluation_takes_its_share_beside_a_training_and_a_set_value_is_kept(tmp_path: Path,
                                                                                 eight_cores: None) -> None:
    """The evaluate and export stages (cpu_share): every core alone, half beside a sharing training, a set
    distributed.threads_per_process whatever else runs; registered while they run, so trainings count them."""
    with cpu_share(None, registry=tmp_path) as alone:
        assert alone == 8 == torch.get_num_threads()
        assert [p.read_text() for p in tmp_path.iterdir()] == ["0"]
    assert not list(tmp_path.iterdir())
    other = subprocess.Popen(["sleep", "60"])
    try:
        _register(tmp_path, other.pid)
        with cpu_share(None, registry=tmp_path) as beside:
            assert beside == 4 == torch.get_num_threads()
            assert sorted(p.read_text() for p in tmp_path.iterdir()) == ["0", "0"]  # the training counts it too
        with cpu_share(3, registry=tmp_path) as fixed:
            assert fixed == 3 == torch.get_num_threads()
            assert sorted(p.read_text() for p in tmp_path.iterdir()) == ["0", "3"]
    finally:
        other.kill()
        other.wait()


def test_gpu_workers_do_not_share(tmp_path: Path, eight_cores: None) -> None:
    torch.set_num_threads(2)
    with HostShare(None, own_processes=1, enabled=False, registry=tmp_path) as share:
        assert share.threads() == 2 and share.rebalance() is None and not list(tmp_path.iterdir())


# -- GPUs: leased at launch --------------------------------------------------------------------


EIGHT_GPUS = [str(i) for i in range(8)]


def test_a_training_alone_leases_every_gpu_and_gives_them_back(tmp_path: Path) -> None:
    with GpuLease(EIGHT_GPUS, None, registry=tmp_path, expected=lambda: 0) as lease:
        assert lease.gpus == EIGHT_GPUS and lease.entry.read_text() == ",".join(EIGHT_GPUS)
    assert [p.name for p in tmp_path.iterdir()] == ["lock"]


def test_queued_trainings_split_the_gpus_and_a_fixed_count_takes_free_ones(tmp_path: Path) -> None:
    """`dvc queue start -j 2`: two queue workers, so an `auto` training takes half, the second the other half."""
    with GpuLease(EIGHT_GPUS, None, registry=tmp_path, expected=lambda: 2) as lease:
        assert lease.gpus == ["0", "1", "2", "3"]
    first = subprocess.Popen(["sleep", "60"])
    try:
        _register(tmp_path, first.pid, "0,1,2,3")
        with GpuLease(EIGHT_GPUS, None, registry=tmp_path, expected=lambda: 2) as lease:
            assert lease.gpus == ["4", "5", "6", "7"]
        with GpuLease(EIGHT_GPUS, None, registry=tmp_path, expected=lambda: 0) as lease:
            assert lease.gpus == ["4", "5", "6", "7"]  # not queued: this one and the holder split them
        with GpuLease(EIGHT_GPUS, 3, registry=tmp_path, expected=lambda: 0) as lease:
            assert lease.gpus == ["4", "5", "6"]  # nproc_per_node = 3
    finally:
        first.kill()
        first.wait()


def test_a_training_waits_while_the_gpus_it_needs_are_held(tmp_path: Path, capfd: pytest.CaptureFixture) -> None:
    holder = subprocess.Popen(["sleep", "60"])
    try:
        _register(tmp_path, holder.pid, "0,1,2,3,4,5,6")
        threading.Timer(0.5, holder.kill).start()  # the other training ends
        with GpuLease(EIGHT_GPUS, 2, registry=tmp_path, expected=lambda: 0, poll_s=0.05) as lease:
            assert lease.gpus == ["0", "1"]
        assert "waiting for 2 free GPU(s) of 0,1,2,3,4,5,6,7" in capfd.readouterr().err
    finally:
        holder.kill()
        holder.wait()


def test_dvc_queue_workers_are_found_by_their_command_lines() -> None:
    args = ["exp", "queue-worker", "dvc-exp-abc123-1@localhost"]
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", *args])
    other = subprocess.Popen(["sleep", "60"])
    try:
        cmdline = Path(f"/proc/{worker.pid}/cmdline")
        for _ in range(500):  # until the child has exec'd (before, it has the forking parent's command line)
            if b"queue-worker" in cmdline.read_bytes():
                break
            time.sleep(0.01)
        pids = host_leases.dvc_queue_worker_pids()
        assert worker.pid in pids and other.pid not in pids
    finally:
        for p in (worker, other):
            p.kill()
            p.wait()
