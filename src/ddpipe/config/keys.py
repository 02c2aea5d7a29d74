"""The schema's dotted keys (``train.base_lr``): each with its field, and a loaded config as keys and values."""

import dataclasses
from typing import Any

from ddpipe.config.schema import Config


def _schema_fields(schema: type = Config, prefix: str = "") -> dict[str, dataclasses.Field]:
    """Every dotted key of the schema, sections included, with its field, in schema order."""
    fields: dict[str, dataclasses.Field] = {}
    for f in dataclasses.fields(schema):
        fields[prefix + f.name] = f
        if dataclasses.is_dataclass(f.type):
            fields.update(_schema_fields(f.type, f"{prefix}{f.name}."))
    return fields


FIELDS = _schema_fields()

# Keys that were renamed: the old name is refused with the new one (same values, same meaning), never silently read
RENAMED_KEYS = {"train.export": "train.model_epoch"}


def is_section(key: str) -> bool:
    return key in FIELDS and dataclasses.is_dataclass(FIELDS[key].type)


def flatten_mapping(d: dict, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten_mapping(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def flatten(cfg: Config) -> dict[str, Any]:
    """The config as ``{"train.base_lr": 0.002, ...}``."""
    return flatten_mapping(dataclasses.asdict(cfg))


def trajectory(cfg: Config) -> dict[str, Any]:
    """:func:`flatten` restricted to the keys that shape the training trajectory: what a checkpoint's
    fingerprint covers, so a run resumes across a change to any other key (paths, MLflow, launch
    and checkpoint settings: those declared with ``trajectory=False``, or in such a section)."""
    return {key: value for key, value in flatten(cfg).items() if _shapes_trajectory(key)}


def _shapes_trajectory(key: str) -> bool:
    parts = key.split(".")
    prefixes = [".".join(parts[:n]) for n in range(1, len(parts) + 1)]
    return all(FIELDS[p].metadata.get("trajectory", True) for p in prefixes if p in FIELDS)
