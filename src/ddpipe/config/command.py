"""What every command shares: its arguments as argparse reads them (:class:`CommandParser`: ``-q``/``-v``,
``key=value`` overrides anywhere on the line, an unknown option refused naming it), its messages set up before it runs
(:func:`execute`), and the config loaded and checked from its overrides, the user's mistakes turned into one clear
line on stderr and a non-zero exit before any work starts (:func:`load_or_exit`, the stage scripts'
:func:`execute_stage`)."""

from __future__ import annotations

import argparse
import sys
import textwrap
from collections.abc import Callable, Sequence
from typing import Any

from ddpipe.config.load import load_config, user_errors
from ddpipe.config.schema import Config
from ddpipe.core.logs import configure

USAGE = "usage: python {script} [key=value ...]   (keys as in params.yaml, e.g. num_epochs=20)"
OVERRIDES_HELP = "params.yaml's keys set for this command, e.g. num_epochs=20 (ddpipe config --schema lists them)"


def is_override(arg: str) -> bool:
    """Whether ``arg`` is a ``key=value`` override (an option such as ``--keep=3`` is not)."""
    return "=" in arg and not arg.startswith("-")


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """A description's or epilog's paragraphs (a module's docstring, its ``literals`` shown plain) wrapped to the
    terminal, an indented one (a docstring's command lines) kept as written."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return "\n\n".join(textwrap.indent(paragraph, indent) if paragraph.startswith(" ") else
                            textwrap.fill(" ".join(paragraph.split()), width, initial_indent=indent,
                                          subsequent_indent=indent)
                            for paragraph in textwrap.dedent(text.replace("``", "")).strip("\n").split("\n\n"))


class CommandParser(argparse.ArgumentParser):
    """argparse as ddpipe's commands read their arguments: ``-q`` (warnings and errors only) and ``-v`` (debug
    messages too) at every level of a command, ``key=value`` overrides (:meth:`add_overrides`) anywhere on the line,
    options before them or after, and any other argument it does not know refused: exit 2, naming it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _Formatter)
        super().__init__(*args, **kwargs)
        self._overrides: str | None = None
        level = self.add_mutually_exclusive_group()
        # SUPPRESS: a subcommand's parser that was not given one keeps the command's (ddpipe -q search status)
        level.add_argument("-q", "--quiet", dest="log_level", action="store_const", const="WARNING",
                           default=argparse.SUPPRESS, help="only warnings and errors on stderr")
        level.add_argument("-v", "--verbose", dest="log_level", action="store_const", const="DEBUG",
                           default=argparse.SUPPRESS, help="debug messages too")

    def add_overrides(self, help: str = OVERRIDES_HELP) -> None:
        """The positional ``key=value ...`` (``args.overrides``), taken wherever they stand on the line."""
        self.add_argument("overrides", nargs="*", metavar="key=value", help=help)
        self._overrides = "overrides"

    def add_subparsers(self, **kwargs: Any) -> Any:
        kwargs.setdefault("parser_class", CommandParser)
        return super().add_subparsers(**kwargs)

    def parse_known_args(self, args: Sequence[str] | None = None,
                         namespace: argparse.Namespace | None = None) -> tuple[argparse.Namespace, list[str]]:
        """As argparse's, where an override after an option joins the others (argparse leaves it over: a ``*``
        positional is taken once) and anything else left over exits 2 naming it, with this (sub)command's usage."""
        parsed, extras = super().parse_known_args(args, namespace)
        if self._overrides is not None:
            setattr(parsed, self._overrides, [*getattr(parsed, self._overrides, []),
                                              *(a for a in extras if is_override(a))])
            extras = [a for a in extras if not is_override(a)]
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed, extras


def execute(args: argparse.Namespace) -> int:
    """Run the command ``args`` were parsed for (``args.run``, set by its parser), its messages set up first at the
    level ``-q``/``-v`` asked (else ``DDPIPE_LOG_LEVEL``'s); its exit code."""
    configure(getattr(args, "log_level", None))
    code = args.run(args)
    return code if isinstance(code, int) else 0


def run_command(prog: str, arguments: Callable[[CommandParser], None], argv: Sequence[str] | None = None) -> int:
    """A command on its own (``python -m ddpipe.launch``, the stages' ``python stages/train.py``): its parser named
    ``prog``, its arguments and what it runs added by ``arguments`` (as ``ddpipe SUBCOMMAND`` adds them), ``argv``
    (default: the command line) parsed and run; its exit code."""
    parser = CommandParser(prog=prog)
    arguments(parser)
    return execute(parser.parse_args(sys.argv[1:] if argv is None else list(argv)))


def load_or_exit(argv: list[str], script: str) -> Config:
    """The checked config (defaults < params.yaml < argv), or exit 2 naming the bad key."""
    if any(a in ("-h", "--help") for a in argv):
        print(USAGE.format(script=script))
        print("Every parameter, its default and accepted values: ddpipe config --schema")
        raise SystemExit(0)
    with user_errors():
        return load_config(argv)


def execute_stage(work: Callable[[Config], object], script: str, errors: tuple[type[Exception], ...] = ()) -> None:
    """Set up the messages (the level ``DDPIPE_LOG_LEVEL`` names, INFO without it), load the config from the command
    line and run ``work``; errors the user can fix (bad parameters, missing or corrupt data) print one message and exit
    non-zero, without a traceback."""
    configure()
    cfg = load_or_exit(sys.argv[1:], script)
    with user_errors(*errors, code=1):
        work(cfg)
