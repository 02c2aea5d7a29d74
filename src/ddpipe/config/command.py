"""What every stage script shares: load and check the config from ``sys.argv``, turn the user's
mistakes into one clear line on stderr and a non-zero exit, before any work starts."""

from __future__ import annotations

import sys
from collections.abc import Callable

from ddpipe.config.load import load_config, user_errors
from ddpipe.config.schema import Config

USAGE = "usage: python {script} [key=value ...]   (keys as in params.yaml, e.g. num_epochs=20)"


def load_or_exit(argv: list[str], script: str) -> Config:
    """The checked config (defaults < params.yaml < argv), or exit 2 naming the bad key."""
    if any(a in ("-h", "--help") for a in argv):
        print(USAGE.format(script=script))
        print("Every parameter, its default and accepted values: ddpipe config --schema")
        raise SystemExit(0)
    with user_errors():
        return load_config(argv)


def execute_stage(work: Callable[[Config], object], script: str, errors: tuple[type[Exception], ...] = ()) -> None:
    """Load the config from the command line and run ``work``; errors the user can fix (bad
    parameters, missing or corrupt data) print one message and exit non-zero, without a traceback."""
    cfg = load_or_exit(sys.argv[1:], script)
    with user_errors(*errors, code=1):
        work(cfg)
