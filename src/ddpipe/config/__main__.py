"""``ddpipe config [key=value ...]``, ``ddpipe config --schema`` and
``ddpipe config --docs > docs/parameters.md``."""

import sys

from ddpipe.config.load import load_config, parameters_page, schema_table, to_yaml, user_errors


def main(argv: list[str] | None = None) -> int:
    """``ddpipe config [key=value ...]``: check params.yaml (+ overrides), print the result;
    ``--schema`` prints the documented schema instead, ``--docs`` the page docs/parameters.md (the schema's
    tables after which stage of dvc.yaml reads which keys; run from the repository root)."""
    argv = sys.argv[1:] if argv is None else argv
    if "-h" in argv or "--help" in argv:
        print("usage: ddpipe config [key=value ...] | --schema | --docs\n\n" + (main.__doc__ or ""))
        return 0
    if "--schema" in argv:
        print(schema_table())
        return 0
    if "--docs" in argv:
        with user_errors(OSError):
            print(parameters_page(), end="")
        return 0
    with user_errors():
        print(to_yaml(load_config(argv)), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
