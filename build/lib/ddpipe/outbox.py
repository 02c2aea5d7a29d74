"""``python -m ddpipe.outbox ...``: the command of :mod:`ddpipe.tracking.outbox`."""

from ddpipe.tracking.outbox import main

if __name__ == "__main__":
    raise SystemExit(main())
