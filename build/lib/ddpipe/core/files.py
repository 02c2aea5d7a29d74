"""Atomic file writes: a reader (or a crash) never sees a half-written output."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any


@contextlib.contextmanager
def atomic_open(path: str | Path, mode: str = "wb") -> Iterator[IO[Any]]:
    """Write to a temp file beside ``path``; fsync and ``os.replace`` it onto ``path`` on success.

    On any error (or a kill) the temp file is removed or left under a hidden ``.tmp`` name, and
    whatever was at ``path`` before is untouched.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _fsync_dir(directory: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def atomic_write_text(path: str | Path, text: str) -> None:
    with atomic_open(path, "w") as f:
        f.write(text)


def atomic_write_json(path: str | Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def atomic_save(path: str | Path, write: Callable[[IO[bytes]], None]) -> None:
    """``write(f)`` into a temp file, then move it onto ``path`` (e.g. ``lambda f: torch.save(obj, f)``)."""
    with atomic_open(path, "wb") as f:
        write(f)


@contextlib.contextmanager
def atomic_dir(target: str | Path) -> Iterator[Path]:
    """An empty staging directory beside ``target``, moved onto it (:func:`replace_dir`) when the block ends
    without an error; on an error (or a kill) the staging directory goes and ``target`` is untouched."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{target.name}.tmp") as tmp:
        staging = Path(tmp) / "out"
        staging.mkdir()
        yield staging
        replace_dir(staging, target)


def replace_dir(staging: Path, target: Path) -> None:
    """Move a fully written ``staging`` directory onto ``target``, replacing what was there only
    once the new one is complete."""
    target = Path(target)
    old = None
    if target.exists():
        old = target.with_name(f".{target.name}.old-{os.getpid()}")
        os.replace(target, old)
    os.replace(staging, target)
    _fsync_dir(target.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def partial_files(directory: str | Path) -> list[Path]:
    """What the writes above left half-done in ``directory`` when their process was killed: hidden temp files of
    :func:`atomic_open` and staging directories of :func:`atomic_dir` (only safe to remove while no writer lives)."""
    directory = Path(directory)
    return sorted([*directory.glob(".*.tmp"), *(p for p in directory.glob(".*.tmp*") if p.is_dir())])


def remove_partial(paths: list[Path]) -> None:
    for path in paths:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
