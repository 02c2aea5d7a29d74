"""What one key accepts beyond its type (bounds, choices, finiteness), in words and as a check, and the one
message shape for a value that is not accepted. The rules themselves sit in each field (see
:func:`ddpipe.config.param.param`)."""

import dataclasses
import math
import operator
from typing import Any, get_args

from ddpipe.config.param import ConfigError

# ---------------------------------------------------------------------------------------------
# What each key accepts (OmegaConf checks types only; bounds, choices and finiteness are ours)

_TYPE_WORDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}
_BOUNDS = {"ge": (">=", operator.ge), "gt": (">", operator.gt), "le": ("<=", operator.le), "lt": ("<", operator.lt)}


def accepted(f: dataclasses.Field) -> str:
    """What a key accepts, in words: 'an integer >= 1', 'one of sqrt, linear, none', '... (or null)'."""
    rules, optional = f.metadata, type(None) in get_args(f.type)
    if "words" in rules:
        return rules["words"]
    if "choices" in rules:
        words = "one of " + ", ".join(rules["choices"])
    elif "int_or" in rules:
        low = rules.get("ge", 1)
        words = ("a positive integer" if low == 1 else f"an integer >= {low}") + " or " + " or ".join(rules["int_or"])
    else:
        words = "a number" if "num_or" in rules else _TYPE_WORDS[get_args(f.type)[0] if optional else f.type]
        bounds = [f"{sign} {rules[name]}" for name, (sign, _) in _BOUNDS.items() if name in rules]
        if bounds:
            words += " " + " and ".join(bounds)
        if "num_or" in rules:
            words += " or " + " or ".join(rules["num_or"])
    return words + (" (or null)" if optional else "")


def accepts(f: dataclasses.Field, value: Any) -> bool:
    """Whether a value of the key's type is within the key's choices and bounds (numbers: finite)."""
    rules = f.metadata
    if value is None:  # OmegaConf has already refused null for keys that are not Optional
        return True
    if "words" in rules:  # checked in validate()
        return True
    if "choices" in rules:
        return value in rules["choices"]
    if "int_or" in rules:
        return value in rules["int_or"] or (str(value).isdigit() and int(value) >= rules.get("ge", 1))
    if "num_or" in rules:
        if value in rules["num_or"]:
            return True
        try:
            value = float(value)
        except ValueError:
            return False
    if isinstance(value, float) and not math.isfinite(value):
        return False
    return all(holds(value, rules[name]) for name, (_, holds) in _BOUNDS.items() if name in rules)


def not_accepted(key: str, value: Any, accepted: str, source: str | None = None) -> ConfigError:
    """The one message shape: ``{source}: {key} = {value} is not accepted; expected {accepted}``."""
    shown = "null" if value is None else repr(value)
    return ConfigError(f"{source + ': ' if source else ''}{key} = {shown} is not accepted; expected {accepted}")
