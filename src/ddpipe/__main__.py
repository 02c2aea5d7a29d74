"""``python -m ddpipe ...``: the ``ddpipe`` command (ddpipe.console.subcommands)."""

from ddpipe.console.subcommands import main

if __name__ == "__main__":
    raise SystemExit(main())
