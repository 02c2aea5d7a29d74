"""``ddpipe``: one command with subcommands, as ``dvc`` and ``mlflow`` are (``python -m ddpipe`` is the same).

    ddpipe launch [--print] [key=value ...]              check, then train under torchrun (the train stage's command)
    ddpipe search run | status | best | remove [...]     a hyperparameter study, each trial a DVC experiment
    ddpipe cluster submit | wait | status [...]          DVC's queued experiments as SLURM or Kubernetes jobs
    ddpipe sweeps NAME [key=value ...]                   a sweep's runs summarised: mean and std per configuration
    ddpipe outbox deliver | status                       MLflow records that wait for their store
    ddpipe config [key=value ...] | --schema | --docs    params.yaml checked and shown; every parameter

``ddpipe SUBCOMMAND --help`` says more. ``-q`` (before the subcommand or after it) shows only warnings and errors,
``-v`` debug messages too; under ``dvc repro`` and ``dvc exp run``, ``DDPIPE_LOG_LEVEL`` (DEBUG, INFO, WARNING, ERROR)
sets the same level. Messages go to stderr, results (tables, JSON, ``--print``'s command) to stdout.

Each subcommand is a module's ``arguments(parser)``, which adds its options to the subcommand's parser and what it
runs; that module is imported when its subcommand is parsed, not before (``ddpipe config`` never imports torch).
``python -m ddpipe.launch``, ``python -m ddpipe.search`` and ``python -m ddpipe.config`` are the same commands as
before. ``python -m ddpipe.cluster``, ``ddpipe.outbox`` and ``ddpipe.sweeps`` (shims at the package root, before this
command) are gone: Python answers "No module named ddpipe.cluster", before any code of ours runs, so nothing can name
the new spelling there: ``ddpipe cluster`` (or ``python -m ddpipe cluster``).
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Sequence
from typing import Any

from ddpipe import __version__
from ddpipe.config.command import CommandParser, execute

# subcommand: (the module whose arguments(parser) it runs, what it does)
SUBCOMMANDS = {
    "launch": ("ddpipe.launch.torchrun", "check the params, this node and the data, then train under torchrun"),
    "search": ("ddpipe.search.study_commands", "a hyperparameter study: run, status, best, remove"),
    "cluster": ("ddpipe.launch.cluster.submission", "DVC's queued experiments as scheduler jobs: submit, wait, status"),
    "sweeps": ("ddpipe.tracking.sweeps", "a sweep's runs summarised per configuration, logged to its parent run"),
    "outbox": ("ddpipe.tracking.outbox", "MLflow records that wait for their store: deliver, status"),
    "config": ("ddpipe.config.__main__", "params.yaml with overrides, checked and shown; --schema, --docs"),
}


class _Subcommand(CommandParser):
    """A subcommand's parser, whose options its module adds when it parses (``--help`` included): the module, and
    what it imports (torch, MLflow), is imported for its own subcommand only."""

    def __init__(self, *args: Any, module: str = "", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.module = module

    def parse_known_args(self, args: Sequence[str] | None = None,
                         namespace: argparse.Namespace | None = None) -> tuple[argparse.Namespace, list[str]]:
        if self.module:
            module, self.module = self.module, ""
            importlib.import_module(module).arguments(self)
        return super().parse_known_args(args, namespace)


class _Ddpipe(CommandParser):
    """The ``ddpipe`` command's own parser: a subcommand it does not have is refused naming the ones it has."""

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        if isinstance(action, argparse._SubParsersAction) and value not in action.choices:
            raise argparse.ArgumentError(None, f"ddpipe has no subcommand {value!r}; expected one of "
                                               f"{', '.join(action.choices)}")
        super()._check_value(action, value)


def parser() -> CommandParser:
    """The ``ddpipe`` command: ``--version``, ``-q``/``-v``, and a subparser per subcommand."""
    summary, table, levels = __doc__.split("\n\n")[:3]
    top = _Ddpipe(prog="ddpipe", description=summary, epilog=f"{table}\n\n{levels}")
    top.add_argument("--version", action="version", version=f"%(prog)s {__version__}",
                     help="the installed ddpipe's version")
    sub = top.add_subparsers(dest="subcommand", metavar="SUBCOMMAND", required=True, parser_class=_Subcommand)
    for name, (module, what) in SUBCOMMANDS.items():
        sub.add_parser(name, help=what, description=what, module=module)
    return top


def main(argv: Sequence[str] | None = None) -> int:
    """``ddpipe [-q|-v] SUBCOMMAND ...``: its exit code (2 for a mistake on the command line, naming it)."""
    return execute(parser().parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
