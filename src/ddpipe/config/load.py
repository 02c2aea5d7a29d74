"""How a run's configuration is loaded: the schema's defaults, params.yaml, then overrides.

Loading order (later wins): the schema's defaults (:mod:`ddpipe.config.schema`) < ``params.yaml`` <
``key=value`` overrides on the command line. OmegaConf converts every value to its key's type; then each
key's bounds and choices, and the rules that tie keys together, are checked before any work starts. A
mistake raises :class:`ConfigError` whose message names where it was set, the key, the bad value and what
is accepted.
"""

import contextlib
import dataclasses
import difflib
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf._utils import get_yaml_loader
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

from ddpipe.config.checks import validate
from ddpipe.config.keys import FIELDS, RENAMED_KEYS, flatten_mapping, is_section
from ddpipe.config.rules import accepted, not_accepted
from ddpipe.config.schema import Config, ConfigError

DEFAULT_PARAMS_FILE = "params.yaml"

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def user_errors(*kinds: type[Exception], code: int = 2, context: str = "") -> Iterator[None]:
    """A command's exit on the user's mistakes: a :class:`ConfigError` (exit 2), or one of ``kinds`` (exit
    ``code``: a missing or corrupt file, data that cannot be read), raised inside, prints one line
    ``error: <message><context>`` on stderr and exits without a traceback. Wrap the checks made before any work
    starts, so that nothing is written yet when it exits."""
    try:
        yield
    except (ConfigError, *kinds) as exc:
        logger.error(f"error: {exc}{context}")
        raise SystemExit(2 if isinstance(exc, ConfigError) else code) from None


def load_config(
    overrides: list[str] | None = None, params_file: str | Path | None = DEFAULT_PARAMS_FILE
) -> Config:
    """Defaults < ``params_file`` (skipped when None or missing) < ``overrides`` (``key=value``)."""
    layers: list[tuple[str, dict]] = []
    if params_file is not None and Path(params_file).exists():
        layers.append((str(params_file), _read_yaml(Path(params_file))))
    if overrides:
        layers.append(("command line", _parse_overrides(overrides)))
    cfg = OmegaConf.structured(Config)
    set_in: dict[str, str] = {}  # key -> the file or "command line" that set it last
    for source, layer in layers:
        logger.debug(f"config: {source} sets {', '.join(flatten_mapping(layer)) or 'nothing'}")
        for key, value in flatten_mapping(layer).items():
            _set(cfg, key, value, source)
            set_in[key] = source
    try:
        obj = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as exc:  # a ${...} interpolation that does not resolve to a valid value
        reason = str(exc.msg).splitlines()[0]
        raise ConfigError(f"{set_in.get(exc.full_key, 'config')}: {exc.full_key}: {reason}") from None
    assert isinstance(obj, Config)
    validate(obj, set_in)
    return obj


# YAML 1.1 reads 1:4 as the base-60 integer 64; distributed.nnodes takes MIN:MAX. Digits joined by
# colons stay text, in params.yaml (where `dvc exp run -S distributed.nnodes=1:4` writes them unquoted)
# and on the command line.
_COLON_NUMBERS = re.compile(r"^[-+]?[0-9][0-9_]*(?::[0-9_]+)+$")


def _yaml_loader() -> type:
    loader = type("ParamsLoader", (get_yaml_loader(),), {})
    loader.yaml_implicit_resolvers = {first: [("tag:yaml.org,2002:str", _COLON_NUMBERS), *resolvers]
                                      if first in "-+0123456789" else resolvers
                                      for first, resolvers in loader.yaml_implicit_resolvers.items()}
    return loader


def _read_yaml(path: Path) -> dict:
    try:
        raw = yaml.load(path.read_text(), Loader=_yaml_loader())  # noqa: S506 (a SafeLoader subclass)
        data = OmegaConf.to_container(OmegaConf.create(raw if raw is not None else {}), resolve=True)
    except Exception as exc:  # yaml syntax errors, interpolation errors
        raise ConfigError(f"{path}: cannot be read as YAML: {exc}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of keys to values, got {type(data).__name__}")
    return data


def _parse_overrides(overrides: list[str]) -> dict:
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise ConfigError(f"command line: {item!r} is not of the form key=value (e.g. num_epochs=20)")
    quoted = [f'{key}="{value}"' if _COLON_NUMBERS.match(value) else f"{key}={value}"
              for key, value in (item.split("=", 1) for item in overrides)]
    try:
        return OmegaConf.to_container(OmegaConf.from_dotlist(quoted))  # type: ignore[return-value]
    except OmegaConfBaseException as exc:
        raise ConfigError(f"command line: cannot parse overrides {overrides}: {exc}") from exc


def _set(cfg: DictConfig, key: str, value: Any, source: str) -> None:
    """Set one dotted key; OmegaConf converts the value to the key's type (3 -> 3.0, "20" -> 20) or
    refuses it (an unknown key, true for an integer, a section given a value), and we say why."""
    if isinstance(value, bool) and key in FIELDS and "on" in FIELDS[key].metadata.get("choices", ()):
        value = "on" if value else "off"  # YAML 1.1 reads a bare on/off as a boolean
    if isinstance(value, str) and value.strip().lower() in ("null", "~"):
        value = None  # a quoted null is null too, as it always was here (OmegaConf keeps the string)
    field_type = FIELDS[key].type if key in FIELDS else None
    if field_type in (bool, Optional[bool]) and not (value is None or isinstance(value, bool) or (
            isinstance(value, str) and value.strip().lower() in ("true", "false"))):
        # OmegaConf would read 1, 2, yes, y, on as true: a typo must not pass as a switch turned on
        raise not_accepted(key, value, accepted(FIELDS[key]), source)
    try:
        OmegaConf.update(cfg, key, value, merge=True)
    except (ConfigKeyError, ConfigAttributeError) as exc:
        raise ConfigError(_unknown_key(cfg, exc.full_key, source)) from None
    except OmegaConfBaseException as exc:
        refused = exc.full_key or key
        if is_section(refused):
            raise ConfigError(f"{source}: '{refused}' is a section; expected a mapping, got {value!r}") from None
        if refused != key:  # key runs on past a value: a mapping was given where a value belongs
            raise ConfigError(f"{source}: '{refused}' is a value, not a section: got {key} = {value!r}; "
                              f"expected {accepted(FIELDS[refused])}") from None
        raise not_accepted(key, value, accepted(FIELDS[key]), source) from None


def _unknown_key(cfg: DictConfig, key: str, source: str) -> str:
    """The message for a key the schema lacks, with the closest known key at its level (OmegaConf
    says only "Key 'base_lrr' not in 'TrainConfig'"), or its new name when it was renamed."""
    if key in RENAMED_KEYS:
        return (f"{source}: '{key}' is now '{RENAMED_KEYS[key]}' (the same values); set {RENAMED_KEYS[key]} "
                "instead")
    section, _, name = key.rpartition(".")
    known = list(OmegaConf.select(cfg, section) if section else cfg)
    prefix = f"{section}." if section else ""
    close = difflib.get_close_matches(name, known, n=1)
    hint = f" Did you mean '{prefix}{close[0]}'?" if close else ""
    where = f"'{section}'" if section else "the top level"
    return f"{source}: unknown key '{key}'.{hint} Keys at {where}: {', '.join(known)}"


# ---------------------------------------------------------------------------------------------
# Views of a loaded config


def to_yaml(cfg: Config) -> str:
    """The config as YAML, in params.yaml's layout."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def schema_table(section: str | None = None) -> str:
    """A Markdown table of every parameter (or of one section's; ``""``: the top-level keys): key, default,
    accepted values, meaning."""
    rows = ["| key | default | accepted | meaning |", "| --- | --- | --- | --- |"]
    for key, f in FIELDS.items():
        if is_section(key) or (section is not None and key.rpartition(".")[0] != section):
            continue
        cells = (f"`{_shown(default_of(f))}`", accepted(f), f.metadata["doc"])
        rows.append(f"| `{key}` | " + " | ".join(_cell(cell) for cell in cells) + " |")
    return "\n".join(rows)


def _cell(text: str) -> str:
    """Text in a Markdown table's cell: a | would end the cell, a <word> would be taken for HTML."""
    return re.sub(r"<(?=[A-Za-z/])", r"\\<", text.replace("|", "\\|"))


def default_of(f: dataclasses.Field) -> Any:
    """A schema field's default (a fresh one for a field with a default factory)."""
    return f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]


def _shown(default: Any) -> str:
    """A default as params.yaml writes it: null, true, "", {}."""
    if isinstance(default, (str, dict)) and not default:
        return '""' if isinstance(default, str) else "{}"
    return "null" if default is None else str(default).lower() if isinstance(default, bool) else str(default)


DOCS_COMMAND = "ddpipe config --docs > docs/parameters.md"


def parameters_page(dvc_file: str | Path = "dvc.yaml") -> str:
    """docs/parameters.md: the override order, which keys each stage of ``dvc_file`` lists under ``params:``,
    then one table per section of the schema (its class docstring above it)."""
    listed = _stage_params(Path(dvc_file))
    sections = [("", Config)] + [(key, FIELDS[key].type) for key in FIELDS if is_section(key)]
    page = [
        "# Parameters", "",
        f"<!-- Generated from src/ddpipe/config/schema.py and dvc.yaml by `{DOCS_COMMAND}`: edit those, "
        "not this page. -->", "",
        "Every key of `params.yaml`: its default, what it accepts and what it means, one table per section. The "
        "schema (`src/ddpipe/config/schema.py`, a doc per field) is the one source: `params.yaml` spells out "
        f"every key at its default, and this page is written from it (and from `dvc.yaml`) by `{DOCS_COMMAND}` "
        "(a test fails while it is stale). `ddpipe config --schema` prints the tables as one, and "
        "`ddpipe config [key=value ...]` the configuration a run would get.", "",
        "## Where a value comes from", "",
        "Later wins: the schema's defaults < `params.yaml` < the command line. `dvc exp run -S num_epochs=20 -S "
        "train.base_lr=0.003` sets values for one experiment (DVC writes them into that experiment's "
        "`params.yaml`); a stage script takes `key=value` after it (`python stages/prepare.py "
        "data.val_fraction=0.2`, `python stages/train.py num_epochs=2`). Every value is checked before any work "
        "starts: an unknown key, a wrong type, an out-of-range number or an unknown choice fails with one message "
        "that names the key, the value and what is accepted.", "",
        "## Which stage reads what", "",
        "A stage re-runs when a key it lists under `params:` in `dvc.yaml` changes (a section: any of its keys).", "",
        "| stage | params |", "| --- | --- |",
        *(f"| {stage} | " + ", ".join(f"`{key}`" for key in keys) + " |" for stage, keys in listed.items()),
        "",
    ]
    for section, schema in sections:
        keys = [key for key in FIELDS if not is_section(key) and key.rpartition(".")[0] == section]
        readers = [f"{stage} ({_covered(keys, stage_keys)})" for stage, stage_keys in listed.items()
                   if _covered(keys, stage_keys)]
        page += [f"## `{section}`" if section else "## Top level", "", _markdown(schema.__doc__ or ""), "",
                 "Listed under `params:` by " + (", ".join(readers) if readers else "no stage") + ".", "",
                 schema_table(section), ""]
    return "\n".join(page)


def _stage_params(dvc_file: Path) -> dict[str, list[str]]:
    """Each stage of ``dvc_file`` and the params.yaml keys it lists under ``params:``."""
    stages = yaml.safe_load(dvc_file.read_text())["stages"]
    listed: dict[str, list[str]] = {}
    for name, stage in stages.items():
        entries = stage.get("params", [])
        listed[name] = [e for e in entries if isinstance(e, str)] + [
            key for e in entries if isinstance(e, dict) for key in e.get(DEFAULT_PARAMS_FILE) or []]
    return listed


def _covered(keys: list[str], stage_keys: list[str]) -> str:
    """Which of a section's ``keys`` a stage's list names, in words: "every key", a list, or ""."""
    named = [key for key in keys if any(key == k or key.startswith(k + ".") for k in stage_keys)]
    if named and named == keys:
        return "every key"
    return ", ".join(f"`{key.rpartition('.')[2]}`" for key in named)


def _markdown(docstring: str) -> str:
    """A class docstring as one Markdown paragraph."""
    return " ".join(line.strip() for line in docstring.strip().splitlines()).replace("``", "`")
