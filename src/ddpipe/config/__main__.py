"""``ddpipe config [key=value ...]``, ``ddpipe config --schema``,
``ddpipe config --docs > docs/parameters.md`` and ``ddpipe config --stage-env``."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from ddpipe.config.command import CommandParser, run_command
from ddpipe.config.load import load_config, parameters_page, schema_table, to_yaml, user_errors
from ddpipe.config.schema import Config
from ddpipe.core.lockfile import LOCK_FILE


def arguments(parser: CommandParser) -> None:
    """``ddpipe config``'s arguments: what it shows, the overrides it checks."""
    parser.description = ("params.yaml (+ overrides) checked, then printed as the run would see it; --schema: every "
                          "parameter, its default and accepted values; --docs: the page docs/parameters.md (the "
                          "schema's tables after which stage of dvc.yaml reads which keys; run from the repository "
                          "root); --stage-env: each stage's locked packages written (make lock runs it)")
    shown = parser.add_mutually_exclusive_group()
    shown.add_argument("--schema", action="store_true", help="the documented schema instead")
    shown.add_argument("--docs", action="store_true", help="the page docs/parameters.md instead")
    shown.add_argument("--stage-env", action="store_true", help="write each stage's locked packages "
                       "(paths.stage_env/<stage>.txt, from uv.lock and dvc.yaml; run from the repository root) where "
                       "they changed, and print the files written")
    parser.add_overrides()
    parser.set_defaults(run=show)


def show(args: argparse.Namespace) -> int:
    """Print the checked config, the schema or the parameters' page, or write the stages' package files (the
    command's result, on stdout)."""
    if args.schema:
        print(schema_table())
        return 0
    if args.docs:
        with user_errors(OSError):
            print(parameters_page(), end="")
        return 0
    if args.stage_env:
        with user_errors(OSError):
            return stage_env(load_config(args.overrides))
    with user_errors():
        print(to_yaml(load_config(args.overrides)), end="")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m ddpipe.config``: the same as ``ddpipe config``."""
    return run_command("python -m ddpipe.config", arguments, argv)


def stage_env(cfg: Config) -> int:
    """``--stage-env``: the stage files of dvc.yaml and uv.lock here written where stale; each one written printed."""
    from ddpipe.config.stage_env import write_stage_env

    for path in write_stage_env(Path("dvc.yaml").resolve(), Path(LOCK_FILE).resolve(), cfg.paths.stage_env):
        print(f"{path.relative_to(Path.cwd().resolve())}: written")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
