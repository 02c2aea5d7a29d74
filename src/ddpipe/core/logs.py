"""ddpipe's messages: each module's logger (``logging.getLogger(__name__)``) under one ``ddpipe`` logger, which
:func:`configure` shows on stderr. Each command calls it first (``ddpipe`` and its subcommands, the stage scripts,
the torchrun workers); the library never does, on import or after: a program that imports ddpipe routes or silences
its messages through ``logging.getLogger("ddpipe")`` as it would any library's. A command's results (a table, JSON,
``--print``'s command, ``ddpipe config``'s YAML) are its own ``print`` on stdout, apart from the messages.

A message is shown as written, one line as before ddpipe logged them: its text carries its ``note:``, ``warning:``
or ``error:``, so the handler adds nothing.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable

from ddpipe.core.environment import LOG_LEVEL_ENV

LOGGER = "ddpipe"
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
DEFAULT_LEVEL = "INFO"

logger = logging.getLogger(__name__)


class _Stderr(logging.StreamHandler):
    """Writes to ``sys.stderr`` as it is when a message comes, not as it was when the handler was made (a test's
    capture, a stream a command redirected since), flushed after each message as the ``print``s before it were."""

    def __init__(self) -> None:
        logging.Handler.__init__(self)  # no stream of its own: the property below

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr


def configure(level: str | None = None) -> int:
    """Show ddpipe's messages on stderr from ``level`` up (a command's ``-q``: WARNING, ``-v``: DEBUG), else from
    :data:`LOG_LEVEL_ENV`'s level, else from INFO; the level set. A ``level`` given is put in the environment, for the
    processes this one starts (torchrun's workers, a search's trials, the stages of ``dvc exp run``). Off global rank 0
    (torchrun's ``RANK``) WARNING at least: only rank 0 says what the whole job does. Called again, it replaces the
    handler it added before."""
    if level is not None:
        os.environ[LOG_LEVEL_ENV] = level
    given = level or os.environ.get(LOG_LEVEL_ENV) or DEFAULT_LEVEL
    asked = given.strip().upper()
    chosen = logging.getLevelName(asked if asked in LEVELS else DEFAULT_LEVEL)
    if _global_rank() != 0:
        chosen = max(chosen, logging.WARNING)
    top = logging.getLogger(LOGGER)
    for old in [h for h in top.handlers if isinstance(h, _Stderr)]:
        top.removeHandler(old)
    handler = _Stderr()
    handler.setFormatter(logging.Formatter("%(message)s"))
    top.addHandler(handler)
    top.setLevel(chosen)
    top.propagate = False  # shown once, here, whatever a library did to the root logger
    if asked not in LEVELS:
        logger.warning(f"warning: {LOG_LEVEL_ENV} = {given!r} is not a level; accepted: {', '.join(LEVELS)} "
                       f"(case does not matter); {DEFAULT_LEVEL} it is")
    return chosen


def say_to(log: logging.Logger) -> Callable[[str], None]:
    """A ``say`` (what some functions are given to say things with, a test's list.append among them) that logs to
    ``log``: a text that begins with ``warning:`` or ``error:`` at that level, any other at INFO."""

    def say(text: str) -> None:
        head = text.split(":", 1)[0].strip().lower()
        log.log({"warning": logging.WARNING, "error": logging.ERROR}.get(head, logging.INFO), text)

    return say


def _global_rank() -> int:
    try:
        return int(os.environ.get("RANK") or 0)
    except ValueError:
        return 0
