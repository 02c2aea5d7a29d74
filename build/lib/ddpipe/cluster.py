"""``python -m ddpipe.cluster ...``: the command of :mod:`ddpipe.launch.cluster.cli`."""

from ddpipe.launch.cluster.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
