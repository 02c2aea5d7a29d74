"""This host's processes: whether one is still alive (and still the one we knew), which work in a directory, and a
lock that every process on the host takes in turn.

A pid alone can be reused once its process is gone, so where it matters the pid travels with its start time
(:func:`start_time`), which names one process for as long as the host runs.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import signal
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import psutil


def _stat(pid: int) -> tuple[str, list[str]] | None:
    """The process's name and the fields after it in ``/proc/<pid>/stat`` (state, parent pid, ...), or None when it
    is gone (or there is no /proc)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
        return text[text.index("(") + 1:text.rindex(")")], text.rsplit(")", 1)[1].split()
    except (OSError, ValueError):
        return None


def start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot, or None if it is gone or a zombie (Linux's /proc;
    None everywhere without it)."""
    found = _stat(pid)
    if found is None or len(found[1]) < 20:
        return None
    return None if found[1][0] in ("Z", "X") else found[1][19]


# what may stand between a program and the command it runs through $SHELL -c
SHELLS = frozenset({"sh", "dash", "ash", "bash", "zsh", "ksh", "mksh", "posh", "yash", "csh", "tcsh", "fish"})


def caller_past_shells() -> int:
    """The pid of the program that started this process, past any shell in between: a program running a command
    through ``$SHELL -c`` (DVC does) is this process's parent only where the shell replaces itself with the command
    (bash, zsh); dash, Debian's ``/bin/sh``, forks it and waits. Without /proc: the parent."""
    pid, seen = os.getppid(), set()
    while pid > 1 and pid not in seen and (found := _stat(pid)) is not None and found[0] in SHELLS:
        seen.add(pid)  # a pid reused mid-walk cannot make it go round
        pid = int(found[1][1])
    return pid


def alive(pid: int, started: str | None = None) -> bool:
    """Whether process ``pid`` runs (a zombie does not), and, given ``started`` (its :func:`start_time`), is
    still that process rather than a later one with the same pid. Without /proc: whether the pid exists."""
    if pid <= 0:
        return False
    if Path("/proc/self/stat").exists():
        now = start_time(pid)
        return now is not None and (started is None or now == started)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def stop_group(pid: int, started: str | None = None, grace_s: float = 10.0) -> bool:
    """SIGTERM to the process group that ``pid`` leads (a server started in a session of its own), SIGKILL after
    ``grace_s`` if it still runs; whether it was running. ``started`` (its :func:`start_time`): a later process that
    reuses the pid is never signalled."""
    if not alive(pid, started):
        return False
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while alive(pid, started) and time.monotonic() < deadline:
        time.sleep(0.1)
    if alive(pid, started):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
    return True


def within(path: str, directory: str) -> bool:
    """Whether ``path`` is ``directory`` or below it, component by component (both absolute and normalised):
    ``/s/trial-1`` holds ``/s/trial-1/ckpt`` and not ``/s/trial-10``."""
    return path == directory or path.startswith(directory.rstrip(os.sep) + os.sep)


def names_directory(argument: str, directories: tuple[str, ...], cwd: str | None) -> bool:
    """Whether a command-line ``argument`` names one of ``directories`` (absolute, normalised) or a path below it:
    the argument whole, or the value of ``--opt=PATH`` / ``key=PATH`` (split at the first '='); a relative path taken
    from ``cwd``, the process's directory (left unjudged where that is unknown)."""
    for value in {argument, argument.partition("=")[2]} - {""}:
        if not os.path.isabs(value) and cwd is None:
            continue
        path = os.path.normpath(os.path.join(cwd or "", value))
        if any(within(path, d) for d in directories):
            return True
    return False


def processes_in(directory: str | Path) -> list[psutil.Process]:
    """This host's processes (with ``info``: cmdline, cwd, status) that work in ``directory`` or below it (their current
    directory) or name it or a path below it in their command line (:func:`names_directory`): whatever a DVC
    experiment runs there (``dvc exp run``, the stage's launcher, torchrun, the workers and their loader workers), this
    process left out. Paths are compared whole, component by component: a process of ``trial-10`` is not one of
    ``trial-1``. Zombies are not counted: they run nothing."""
    import psutil

    # the directory as given (made absolute) and with its links resolved: a command line may name either
    marks = tuple({os.path.normpath(os.path.abspath(directory)), os.path.realpath(directory)})
    found = []
    for p in psutil.process_iter(["cmdline", "cwd", "status"]):
        with contextlib.suppress(psutil.Error):
            if p.pid == os.getpid() or p.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            cwd = p.info["cwd"] or None
            if (cwd is not None and any(within(cwd, m) for m in marks)) or \
                    any(names_directory(a, marks, cwd) for a in p.info["cmdline"] or ()):
                found.append(p)
    return found


def working_in(directory: str | Path) -> list[int]:
    """The pids of :func:`processes_in` ``directory``."""
    return [p.pid for p in processes_in(directory)]


def this_process() -> dict[str, str | int]:
    """This process as a marker file records it: host and pid (see :func:`alive_here`)."""
    return {"host": socket.gethostname(), "pid": os.getpid()}


def alive_here(marker: dict) -> bool:
    """Whether the process a marker names (:func:`this_process`) runs on this host."""
    return marker.get("host") == socket.gethostname() and alive(int(marker.get("pid", 0)))


def named_host_lock(kind: str, *names: str, wait: bool = True) -> contextlib.AbstractContextManager[bool]:
    """:func:`host_lock` on a file in the temporary directory named after ``kind`` and a digest of ``names`` (a store's
    URI and what in it the lock guards): every process on this host that guards the same thing takes the same lock."""
    key = hashlib.sha256("|".join(names).encode()).hexdigest()[:16]
    return host_lock(Path(tempfile.gettempdir()) / f"ddpipe-{kind}-{key}.lock", wait)


@contextlib.contextmanager
def host_lock(path: Path, wait: bool = True) -> Iterator[bool]:
    """Hold an exclusive lock on ``path`` (created if missing) across every process on this host; yields whether
    it was taken (``wait=False``: not when another process holds it). Released explicitly, not by closing: a
    process forked meanwhile (a DataLoader worker) holds a copy of the descriptor, which would keep it held."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
