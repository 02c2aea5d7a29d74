"""How a schema field is declared: :func:`param` (its default, doc and what it accepts), and the error of a
value the schema does not accept."""

from dataclasses import field
from typing import Any


class ConfigError(ValueError):
    """A parameter the user set is unknown, of the wrong type, or out of range."""


def param(
    default: Any, doc: str, *, ge: float | None = None, gt: float | None = None, le: float | None = None,
    lt: float | None = None, choices: tuple[str, ...] | None = None, int_or: tuple[str, ...] | None = None,
    num_or: tuple[str, ...] | None = None, words: str | None = None, trajectory: bool = True,
) -> Any:
    """A schema field: its default and a one-line doc; what it accepts beyond its type (bounds
    ``ge``/``gt``/``le``/``lt``, ``choices``, ``int_or``: an integer (>= ``ge``, else >= 1) or one of these
    words, ``num_or``: a number within the bounds or one of these words, or ``words``: what a key checked in
    :func:`~ddpipe.config.checks.validate` accepts, in words); and
    whether it shapes the training trajectory (``trajectory=False``: a run may resume from a checkpoint written
    before a change to it)."""
    rules = {"ge": ge, "gt": gt, "le": le, "lt": lt, "choices": choices, "int_or": int_or, "num_or": num_or,
             "words": words}
    rules = {name: rule for name, rule in rules.items() if rule is not None}
    return field(default=default, metadata={"doc": doc, "trajectory": trajectory, **rules})
