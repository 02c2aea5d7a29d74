"""Trainings at once on one host share its cores: the registry of live workers and the threads it gives."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch

from ddpipe import hostshare
from ddpipe.hostshare import HostShare


@pytest.fixture
def eight_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hostshare, "cpu_count", lambda: 8)
    monkeypatch.setattr(hostshare, "RECHECK_S", 0.0)  # re-list at every call: deaths show at once
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _register(registry: Path, pid: int) -> Path:
    entry = registry / f"{pid}-{hostshare._start_time(pid)}"
    entry.touch()
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


def test_fixed_threads_and_gpu_workers_do_not_share(tmp_path: Path, eight_cores: None) -> None:
    with HostShare(3, own_processes=1, registry=tmp_path) as share:
        assert share.threads() == 3 and share.entry is None
    torch.set_num_threads(2)
    with HostShare(None, own_processes=1, enabled=False, registry=tmp_path) as share:
        assert share.threads() == 2 and share.rebalance() is None and not list(tmp_path.iterdir())
