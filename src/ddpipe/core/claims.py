"""One training per directory: a claim on the directories a training writes, held by every process of that training
and refused to a second one while any of them lives.

A claim is a lock file in each directory, :data:`LOCK_NAME`: an ``flock`` that the training's processes hold shared
(whoever took the claim, then each worker that joins it with the claim's token) and that a new training can take
exclusively only when none of them is left. The kernel drops an flock when its holder dies, whatever killed it, so a
claim outlives a SIGKILLed launcher for exactly as long as one of its workers still runs, and no longer. The file
names the holders, a JSON line each (host, pid, start time, role; the first line is the owner's, with the token), so
that a refusal says who holds the directory and what to do. Taking a claim is serialised by a second file
(``<lock>.gate``), held only for that moment. A process forked by a holder (a DataLoader worker) holds the lock too.

The owner empties the file when it releases the claim with no other holder left; a file that still names holders
when it is taken again was left by a killed training: the taker says whose it was and removes the partial files its
atomic writes left (``ddpipe.core.files.partial_files``).

A place in an object store (checkpoints at ``s3://...``) has no flock: there a lease says who owns it
(ddpipe.core.store_lease: conditional writes, and the store's clock, never two hosts').
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
import sys
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

from ddpipe.core.files import partial_files, remove_partial
from ddpipe.core.processes import alive, host_lock, start_time

logger = logging.getLogger(__name__)

LOCK_NAME = ".ddpipe-training.lock"


class InUse(RuntimeError):
    """Another training, still running, holds a directory this one would write."""


@dataclass(frozen=True)
class Holder:
    """A process that holds a claim, as its line in the lock file says."""

    host: str
    pid: int
    started: str | None
    role: str
    since: float
    command: str = ""
    token: str = ""

    @classmethod
    def this(cls, role: str, token: str = "") -> Holder:
        return cls(socket.gethostname(), os.getpid(), start_time(os.getpid()), role, time.time(), _command(), token)

    def here(self) -> bool:
        return self.host == socket.gethostname()

    def alive(self) -> bool:
        """Whether it still runs: on this host, checked; on another host, assumed (its lock is what tells)."""
        return not self.here() or alive(self.pid, self.started)

    def __str__(self) -> str:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.since))
        what = f" ({self.command})" if self.command else ""
        return f"pid {self.pid}{'' if self.here() else ' on host ' + self.host}, {self.role}{what}, since {since}"


def _command(limit: int = 120) -> str:
    """This process's command as a person typed it (``python -m ddpipe.launch ...``), cut to ``limit`` characters."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    head = f"python -m {spec.name.removesuffix('.__main__')}" if spec else \
        f"python {Path(sys.argv[0]).name}" if sys.argv and sys.argv[0] else "python"
    text = " ".join([head, *sys.argv[1:]])
    return text if len(text) <= limit else text[:limit - 3] + "..."


def read_holders(path: Path) -> list[Holder]:
    """The holders a lock file names (lines that do not parse are skipped: a write cut by a kill)."""
    holders = []
    with contextlib.suppress(OSError):
        for line in Path(path).read_text().splitlines():
            with contextlib.suppress(ValueError, TypeError):
                holders.append(Holder(**json.loads(line)))
    return holders


def _line(holder: Holder) -> bytes:
    return (json.dumps(asdict(holder), separators=(",", ":")) + "\n").encode()


class Claim:
    """This process's hold on a training's directories (``places``: what each is, as a message names it -> the
    directory). :meth:`take` makes a new claim, :meth:`join` joins one by its token; :meth:`release` lets go."""

    def __init__(self, places: Mapping[str, Path], token: str, me: Holder, fds: dict[Path, int]) -> None:
        self.places, self.token, self.me, self._fds = dict(places), token, me, fds

    @classmethod
    def take(cls, places: Mapping[str, str | Path], role: str, say: Callable[[str], None] | None = None) -> Claim:
        """A new claim on every directory of ``places`` (created if missing), or :class:`InUse` naming the training
        that holds one, with nothing taken. A claim its holders left without releasing (they were killed) is taken
        over, saying so through ``say``."""
        say = say or logger.info
        token = uuid.uuid4().hex
        me = Holder.this(role, token)
        claim = cls(_directories(places), token, me, {})
        left: dict[Path, list[Holder]] = {}
        partial: list[Path] = []
        try:
            for label, directory in claim.places.items():
                claim._fds[directory], left[directory] = _take_one(label, directory, me)
                if left[directory]:  # its holders are gone, their flocks with them, without releasing it: killed
                    partial += partial_files(directory)
        except BaseException:
            claim.release()
            raise
        if taken_over := [d for d, holders in left.items() if holders]:
            remove_partial(partial)
            say(f"note: taking over {', '.join(map(str, taken_over))} from a training that ended without releasing "
                f"{'it' if len(taken_over) == 1 else 'them'} ({left[taken_over[0]][0]})"
                + (f"; removed {len(partial)} partial file(s) its killed writes left" if partial else ""))
        return claim

    @classmethod
    def join(cls, places: Mapping[str, str | Path], token: str, role: str, patience_s: float = 10.0) -> Claim:
        """This process as one more holder of the claim ``token`` (a worker of the training that took it); InUse if
        that claim is gone and another training holds a directory now."""
        me = Holder.this(role)
        claim = cls(_directories(places), token, me, {})
        try:
            for label, directory in claim.places.items():
                claim._fds[directory] = _join_one(label, directory, token, me, patience_s)
        except BaseException:
            claim.release()
            raise
        return claim

    def others(self) -> list[Holder]:
        """The other holders still alive (on this host; those on another host as their lines say)."""
        found: dict[tuple[str, int], Holder] = {}
        for directory in self._fds:
            for h in read_holders(directory / LOCK_NAME):
                if (h.host, h.pid) != (self.me.host, self.me.pid) and h.alive():
                    found[h.host, h.pid] = h
        return list(found.values())

    def wait_for_others(self, timeout_s: float, say: Callable[[str], None]) -> list[Holder]:
        """Wait up to ``timeout_s`` for the other holders on this host to end (the workers of a torchrun that was
        killed finish their step and checkpoint it); those still running after it."""
        deadline, said = time.monotonic() + timeout_s, False
        while (left := [h for h in self.others() if h.here()]) and time.monotonic() < deadline:
            if not said:
                say(f"waiting for {len(left)} process(es) of this training to stop (pids "
                    f"{', '.join(str(h.pid) for h in left)}): each stops at its next step, after a checkpoint")
                said = True
            time.sleep(0.2)
        return left

    def release(self) -> None:
        """Let go of every directory; the owner empties a lock file no other process holds (a clean end)."""
        for directory, fd in self._fds.items():
            with contextlib.suppress(OSError):
                if self.me.token:
                    with host_lock(directory / f"{LOCK_NAME}.gate"):
                        with contextlib.suppress(BlockingIOError):
                            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # nobody else holds it any more
                            os.ftruncate(fd, 0)
                        fcntl.flock(fd, fcntl.LOCK_UN)
                fcntl.flock(fd, fcntl.LOCK_UN)  # explicitly: a forked process's copy of fd would keep it held
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds = {}

    def __enter__(self) -> Claim:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _directories(places: Mapping[str, str | Path]) -> dict[str, Path]:
    """``places`` with each directory once (resolved; labels of one directory joined), in a fixed order: two
    trainings that take the same directories take them in the same order."""
    merged: dict[Path, list[str]] = {}
    for label, directory in places.items():
        merged.setdefault(Path(directory).resolve(), []).append(label)
    return {", ".join(labels): directory for directory, labels in sorted(merged.items())}


def _take_one(label: str, directory: Path, me: Holder) -> tuple[int, list[Holder]]:
    """Take ``directory``: its lock's descriptor, and the holders a killed training left named in it."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / LOCK_NAME
    with host_lock(directory / f"{LOCK_NAME}.gate"):
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise InUse(in_use(label, directory, read_holders(path))) from None
        left = read_holders(path)
        os.ftruncate(fd, 0)
        os.pwrite(fd, _line(me), 0)
        os.fsync(fd)
        fcntl.flock(fd, fcntl.LOCK_SH)  # under the gate: no other taker comes in between
    return fd, left


def _join_one(label: str, directory: Path, token: str, me: Holder, patience_s: float) -> int:
    path = directory / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
    deadline = time.monotonic() + patience_s
    while True:  # exclusive only for a taker's moment, or an owner's release
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() > deadline:
                os.close(fd)
                raise InUse(in_use(label, directory, read_holders(path))) from None
            time.sleep(0.05)
    holders = read_holders(path)
    if not holders or holders[0].token != token:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
        raise InUse(f"{directory} ({label}) is no longer this training's: "
                    + (f"another training holds it ({holders[0]})" if holders else "its claim was released")
                    + "; this process stops without writing anything")
    os.write(fd, _line(me))
    return fd


def in_use(label: str, directory: Path, holders: list[Holder]) -> str:
    """The refusal: who holds ``directory`` and what to do."""
    if not holders:
        return (f"{directory} ({label}) is in use by another training (its lock file names nobody yet: it is "
                "starting); wait for it to end, or stop it")
    owner, alive_ = holders[0], [h for h in holders if h.alive()]
    head = f"{directory} ({label}) is in use by another training: "
    if not owner.here():
        return (head + f"{owner}. Two trainings on one directory would overwrite each other's files: wait for it to "
                f"end, or stop pid {owner.pid} on {owner.host}")
    if owner in alive_:
        workers = [h.pid for h in alive_ if h is not owner]
        return (head + f"{owner}" + (f", its workers pids {', '.join(map(str, workers))}" if workers else "")
                + f". Two trainings on one directory would overwrite each other's files: wait for it to end, or "
                f"stop it with `kill {owner.pid}` (it checkpoints its step and exits; your command then resumes it)")
    pids = " ".join(str(h.pid) for h in alive_) or "?"
    return (head + f"its launcher ({owner}) has ended and its processes (pids {pids}) are stopping after a "
            f"checkpoint: wait a few seconds, or stop them with `kill {pids}`")
