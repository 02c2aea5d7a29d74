"""``ddpipe search run [search.key=value ...] | status | best [--json]`` (ddpipe.search.study_commands)."""

from ddpipe.search.study_commands import main

if __name__ == "__main__":
    raise SystemExit(main())
