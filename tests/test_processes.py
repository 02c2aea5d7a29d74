"""Which processes work in a directory (ddpipe.core.processes.working_in): paths compared whole, component by
component, so a search's trial 1 never counts trial 10's training as its own. Real processes, fast."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from ddpipe.core.processes import names_directory, working_in

# a process that waits, doing nothing, with whatever arguments it is given (-I -S: no site, a fast start)
IDLE = [sys.executable, "-I", "-S", "-c", "import time; time.sleep(120)"]


@pytest.fixture
def started() -> Iterator[list[subprocess.Popen]]:
    procs: list[subprocess.Popen] = []
    yield procs
    for p in procs:
        p.kill()
        p.wait()


def _start(procs: list[subprocess.Popen], cwd: Path, *args: str) -> int:
    cwd.mkdir(parents=True, exist_ok=True)
    procs.append(subprocess.Popen([*IDLE, *args], cwd=cwd))
    return procs[-1].pid


def test_a_process_of_trial_10_is_not_one_of_trial_1(tmp_path: Path, started: list[subprocess.Popen]) -> None:
    ten = _start(started, tmp_path / "trial-10")
    below = _start(started, tmp_path / "trial-1" / "sub")
    assert ten not in working_in(tmp_path / "trial-1") and below in working_in(tmp_path / "trial-1")
    assert ten in working_in(tmp_path / "trial-10") and below not in working_in(tmp_path / "trial-10")


def test_a_directory_named_in_an_argument_counts_whole_relative_or_as_an_options_value(
        tmp_path: Path, started: list[subprocess.Popen]) -> None:
    (tmp_path / "trial-1").mkdir()
    relative = _start(started, tmp_path, "--dir=trial-1")  # taken from the process's directory
    key = _start(started, tmp_path / "elsewhere", f"paths.checkpoints={tmp_path}/trial-1/checkpoints")
    whole = _start(started, tmp_path / "elsewhere", str(tmp_path / "trial-1"))
    others = [_start(started, tmp_path, "--dir=trial-10"),
              _start(started, tmp_path / "elsewhere", f"paths.checkpoints={tmp_path}/trial-10/checkpoints"),
              _start(started, tmp_path / "elsewhere", f"{tmp_path}/trial-12")]
    found = working_in(tmp_path / "trial-1")
    assert {relative, key, whole} <= set(found) and not set(others) & set(found), (found, others)


@pytest.mark.parametrize(("argument", "cwd", "named"), [
    ("/s/trial-1", None, True),
    ("/s/trial-1/", None, True),
    ("/s/trial-1/checkpoints/ckpt.pt", None, True),
    ("/s/trial-10", None, False),
    ("/s/trial-1-old", None, False),
    ("/s", None, False),
    ("--dir=/s/trial-1", None, True),
    ("--dir=/s/trial-10", None, False),
    ("paths.checkpoints=/s/trial-1/ckpt", None, True),
    ("trial-1/ckpt", "/s", True),
    ("trial-1", None, False),  # relative, and the process's directory unknown: not judged
    ("../trial-1", "/s/trial-2", True),
    ("x=y=/s/trial-1", None, False),  # split at the first '=' only
])
def test_names_directory_compares_path_components(argument: str, cwd: str | None, named: bool) -> None:
    assert names_directory(argument, ("/s/trial-1",), cwd) is named
