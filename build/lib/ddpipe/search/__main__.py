"""``python -m ddpipe.search run [search.key=value ...] | status | best [--json]`` (ddpipe.search.cli)."""

from ddpipe.search.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
