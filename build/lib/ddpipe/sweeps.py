"""``python -m ddpipe.sweeps ...``: the command of :mod:`ddpipe.tracking.sweeps`."""

from ddpipe.tracking.sweeps import main

if __name__ == "__main__":
    raise SystemExit(main())
