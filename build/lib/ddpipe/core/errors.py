"""How an exception becomes one line of a message: what a log, a run's end reason or a warning says of it."""

from __future__ import annotations


def one_line(exc: BaseException, limit: int = 400) -> str:
    """``Type: the first line of its message`` (cut to ``limit`` characters), or ``Type`` alone when it says nothing:
    a traceback's whole text never reaches a run's tags, a warning or a user's terminal."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0][:limit]}" if lines and lines[0] else type(exc).__name__
