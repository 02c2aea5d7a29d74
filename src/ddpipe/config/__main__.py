"""``python -m ddpipe.config [key=value ...]`` and ``python -m ddpipe.config --schema``."""

import sys

from ddpipe.config.loading import load_config, schema_table, to_yaml, user_errors


def main(argv: list[str] | None = None) -> int:
    """``python -m ddpipe.config [key=value ...]``: check params.yaml (+ overrides), print the result;
    ``--schema`` prints the documented schema instead."""
    argv = sys.argv[1:] if argv is None else argv
    if "--schema" in argv:
        print(schema_table())
        return 0
    with user_errors():
        print(to_yaml(load_config(argv)), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
