"""``python -m ddpipe ...``: the ``ddpipe`` command (ddpipe.console)."""

from ddpipe.console import main

if __name__ == "__main__":
    raise SystemExit(main())
