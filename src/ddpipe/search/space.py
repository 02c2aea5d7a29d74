"""The ``search`` section made concrete and checked before any trial starts: each distribution parsed from its text
and its values held to the schema's own checks, the ``first`` trials, the metric, the storage's place. Every mistake
is a :class:`~ddpipe.config.schema.ConfigError` naming the key, the value and what is accepted."""

from __future__ import annotations

import difflib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_args

import yaml

from ddpipe.config.keys import FIELDS, flatten, flatten_mapping, is_section, trajectory
from ddpipe.config.load import load_config
from ddpipe.config.rules import not_accepted
from ddpipe.config.schema import Config, ConfigError
from ddpipe.config.search import STUDY_NAME, SearchConfig
from ddpipe.core.history import EPOCH_METRICS

KINDS = ("loguniform", "uniform", "int", "choice")
ACCEPTED = "loguniform(low, high) with 0 < low < high, uniform(low, high) or int(low, high) with low < high, or " \
           "choice(x, y, ...)"
# What a search never varies: where files go, how runs are tracked (mlflow.sweep is the study's), the search itself
NOT_SEARCHED = ("paths.", "mlflow.", "cluster.", "search.")
# What would make the trials' values incomparable: the seed and the data section decide the validation split (the
# prepare stage's), so two trials varying them are judged on different images (issue 47)
SPLIT_KEYS = ("seed", "data.")
# What the pruner's steps are (validations: ddpipe.engine.pruning.validation_number): one value for the whole study
PRUNER_STEPS = "train.val_every_n_steps"
# Which way each kind of epoch metric is better, by the end of its name (lr has no better way: either is accepted)
BETTER = {"loss": "minimize", "accuracy": "maximize", "seconds": "minimize", "images_per_s": "maximize"}
_TEXT = re.compile(r"^\s*([a-z]+)\s*\((.*)\)\s*$", re.S)


@dataclass(frozen=True)
class Distribution:
    """One key's distribution: ``kind`` (one of :data:`KINDS`), its bounds or its choices, and the text it came from."""

    key: str
    kind: str
    text: str
    low: float = 0.0
    high: float = 0.0
    choices: tuple = ()

    def to_optuna(self) -> Any:
        import optuna.distributions as d

        if self.kind == "choice":
            return d.CategoricalDistribution(list(self.choices))
        if self.kind == "int":
            return d.IntDistribution(int(self.low), int(self.high))
        return d.FloatDistribution(self.low, self.high, log=self.kind == "loguniform")

    def contains(self, value: Any) -> bool:
        if self.kind == "choice":
            return value in self.choices
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        return self.low <= value <= self.high and (self.kind != "int" or float(value).is_integer())

    def grid(self) -> list:
        """Every value, for the grid sampler (choice and int only)."""
        return list(self.choices) if self.kind == "choice" else list(range(int(self.low), int(self.high) + 1))


@dataclass
class Plan:
    """A checked search: the section's settings, the study's storage (a journal file's path or a database URL),
    the space, the trials to run first, and notes for the user."""

    settings: SearchConfig
    seed: int
    storage: str
    folder: Path
    space: dict[str, Distribution]
    first: list[dict[str, Any]]
    notes: list[str] = field(default_factory=list)
    # The evaluate and export stages' files that git tracks (paths.*): a trial runs the train stage only, and its
    # experiment must not carry the baseline's test figures as if they were its own (issue 47)
    held_out: tuple[str, ...] = ()
    # The params every trial shares (those that shape a training, but the space's): a continued study must keep them
    fixed: dict[str, Any] = field(default_factory=dict)
    # One of held_out, the test metrics: a trial's experiment says there how to apply it (launch.workspace.hold_out)
    apply_note: str = ""


def make_plan(cfg: Config, root: Path, params_file: str | Path | None) -> Plan:
    """The checked plan of ``cfg.search`` for the repository at ``root``; ``params_file``: what the values of a
    distribution are checked against (with each value set on top of it)."""
    s = cfg.search
    if not STUDY_NAME.match(s.study):
        raise not_accepted("search.study", s.study, FIELDS["search.study"].metadata["words"])
    if not s.space:
        raise ConfigError("search.space = {} is not accepted: nothing to search; expected a mapping of dotted keys to "
                          f"distributions, e.g. {{train.base_lr: 'loguniform(1e-4, 1e-1)'}} ({ACCEPTED})")
    space = {key: parse(key, text, params_file) for key, text in flatten_mapping(s.space).items()}
    _check_metric(cfg, space)
    if s.sampler == "grid" and (wide := [d for d in space.values() if d.kind not in ("choice", "int")]):
        raise ConfigError(f"search.sampler = 'grid' is not accepted with search.space.{wide[0].key} = "
                          f"{wide[0].text!r}; expected choice(...) or int(low, high) for every key of a grid")
    notes: list[str] = []
    first = _first_trials(cfg, space, params_file, notes)
    held_out = (cfg.paths.test_metrics, cfg.paths.per_class, cfg.paths.confusion, cfg.paths.reports,
                cfg.paths.export_host, cfg.paths.export_metrics)
    fixed = json.loads(json.dumps({**{k: v for k, v in trajectory(cfg).items() if k not in space},
                                   PRUNER_STEPS: cfg.train.val_every_n_steps}, default=str))
    return Plan(s, cfg.seed, storage_place(s, root), root / "search" / s.study, space, first, notes, held_out, fixed,
                cfg.paths.test_metrics)


def parse(key: str, text: Any, params_file: str | Path | None) -> Distribution:
    """``key``'s distribution from its ``text``; the key must be a training parameter of the schema and every value
    the distribution can take one the schema accepts for it."""
    where = f"search.space.{key}"
    if key not in FIELDS or is_section(key):
        close = difflib.get_close_matches(key, [k for k in FIELDS if not is_section(k)], n=1)
        hint = f" Did you mean '{close[0]}'?" if close else ""
        raise ConfigError(f"{where}: unknown key '{key}'; expected a dotted key of the schema (ddpipe config "
                          f"--schema), e.g. train.base_lr.{hint}")
    if key.startswith(NOT_SEARCHED):
        raise ConfigError(f"{where}: '{key}' is not accepted; expected a training parameter (not under "
                          f"{', '.join(p.rstrip('.') for p in NOT_SEARCHED)})")
    if key == SPLIT_KEYS[0] or key.startswith(SPLIT_KEYS[1:]):
        raise ConfigError(f"{where} = {text!r} is not accepted: {key} decides the validation split (the prepare "
                          "stage's), so trials varying it would be judged on different images and their values "
                          "would not compare; expected a training parameter (model.*, train.*, num_epochs, "
                          "distributed.*); to try other data, run one study per setting")
    if key == PRUNER_STEPS:
        raise ConfigError(f"{where} = {text!r} is not accepted: {key} decides what the pruner's steps are (the "
                          "validations inside epochs), so trials varying it would be compared at different points of "
                          "their training; expected it set once, in the train section, for the whole study")
    found = _TEXT.match(str(text))
    if not found or found[1] not in KINDS:
        raise not_accepted(where, text, ACCEPTED)
    kind, args = found[1], [a.strip() for a in found[2].split(",")]
    if kind == "choice":
        try:
            choices = tuple(_scalar(a) for a in args if a)
        except yaml.YAMLError:
            raise not_accepted(where, text, "choice(x, y, ...) of plain values: numbers, words, true or false, "
                               "separated by commas") from None
        if not choices or len(set(map(repr, choices))) != len(choices):
            raise not_accepted(where, text, "choice(x, y, ...) of at least one value, each once")
        for value in choices:
            check_value(key, value, params_file, where)
        return Distribution(key, kind, str(text), choices=choices)
    try:
        low, high = (int(a) if kind == "int" else float(a) for a in args)
    except ValueError:
        raise not_accepted(where, text, f"{kind}(low, high) of two {'integers' if kind == 'int' else 'numbers'}"
                           ) from None
    if not (math.isfinite(low) and math.isfinite(high) and low < high):
        raise not_accepted(where, text, f"{kind}(low, high) with low < high")
    if kind == "loguniform" and low <= 0:
        raise not_accepted(where, text, "loguniform(low, high) with 0 < low (a log scale has no zero)")
    takes = next((t for t in (FIELDS[key].type, *get_args(FIELDS[key].type)) if t in (int, bool, float, str)), None)
    if takes is bool or (takes is int and kind != "int"):
        raise not_accepted(where, text, f"{'choice(true, false)' if takes is bool else 'int(low, high) or choice(...)'}"
                           f" for {key}")
    for value in (low, high):
        check_value(key, value, params_file, where)
    return Distribution(key, kind, str(text), low, high)


def check_value(key: str, value: Any, params_file: str | Path | None, where: str) -> None:
    """Whether the schema accepts ``key = value`` (on top of ``params_file``), by its own checks; a network's name
    must name a network (ddpipe.models.catalog)."""
    try:
        load_config([f"{key}={override_text(value)}"], params_file=params_file)
        if key == "model.name" and value != Config().model.name:
            from ddpipe.models.catalog import kind

            kind(str(value))
    except ConfigError as exc:
        raise ConfigError(f"{where}: {value!r} is not accepted: {str(exc).removeprefix('command line: ')}") from None


def override_text(value: Any) -> str:
    """``value`` as the text of a ``key=value`` override (and of ``dvc exp run -S``): numbers and words bare, true and
    false, other text quoted."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (int, float)):
        return repr(value)
    text = str(value)
    return text if re.fullmatch(r"[A-Za-z_][\w.:/-]*", text) else "'" + text.replace("'", "\\'") + "'"


def _scalar(text: str) -> Any:
    """A choice as YAML reads it: 0.1 a number, true a boolean, resnet18 a word."""
    value = yaml.safe_load(text)
    return value if isinstance(value, (str, int, float, bool)) else text


def _check_metric(cfg: Config, space: dict[str, Distribution]) -> None:
    metric = cfg.search.metric
    if metric not in EPOCH_METRICS:
        raise not_accepted("search.metric", metric, "an epoch metric the training logs: " + ", ".join(EPOCH_METRICS))
    better = next((way for end, way in BETTER.items() if metric.endswith(end)), cfg.search.direction)
    if cfg.search.direction != better:
        raise ConfigError(f"search.direction = {cfg.search.direction!r} is not accepted with search.metric = "
                          f"{metric!r} ({'lower' if better == 'minimize' else 'higher'} is better); expected "
                          f"{better!r}")
    if metric.startswith("ema_") and cfg.train.ema_decay is None and "train.ema_decay" not in space:
        raise ConfigError(f"search.metric = {metric!r} is not accepted with train.ema_decay = null (no weight "
                          "average, so the training never logs it); expected val_accuracy or val_loss, or set "
                          "train.ema_decay")


def _first_trials(cfg: Config, space: dict[str, Distribution], params_file: str | Path | None,
                  notes: list[str]) -> list[dict[str, Any]]:
    """``search.first``, checked; null: one trial at the params as they stand (when the space holds them)."""
    first = cfg.search.first
    if first is None:
        now = {key: value for key, value in flatten(cfg).items() if key in space}
        outside = [f"{k} = {v!r}" for k, v in now.items() if not space[k].contains(v)]
        if outside:
            notes.append(f"search.first = null: the params as they stand are not in the space ({', '.join(outside)}), "
                         "so the study starts with the sampler's own trials")
            return []
        return [now]
    if not isinstance(first, list) or not all(isinstance(t, dict) for t in first):
        raise not_accepted("search.first", first, FIELDS["search.first"].metadata["words"])
    trials = []
    for n, raw in enumerate(first):
        trial = flatten_mapping(raw)
        for key, value in trial.items():
            where = f"search.first[{n}].{key}"
            if key not in space:
                raise ConfigError(f"{where}: '{key}' is not accepted; expected a key of search.space "
                                  f"({', '.join(space)})")
            check_value(key, value, params_file, where)
            if space[key].kind == "choice" and not space[key].contains(value):
                raise not_accepted(where, value, f"one of {space[key].text}")
            if not space[key].contains(value):
                notes.append(f"{where} = {value!r} lies outside {space[key].text}: run as given (Optuna's "
                             "enqueue_trial)")
        trials.append(trial)
    return trials


def storage_place(s: SearchConfig, root: Path) -> str:
    """The study's storage: its journal file in the repository (null), or the database URL, a relative sqlite path
    made absolute against ``root`` (every trial's workspace and the driver then open the same file)."""
    if s.storage is None:
        return str(root / "search" / s.study / "study.journal")
    url = s.storage
    scheme, sep, rest = url.partition("://")
    if scheme == "sqlite" and sep and rest.startswith("/"):
        path = Path(rest[1:])
        return url if path.is_absolute() or rest == "/:memory:" else f"sqlite:///{(root / path).resolve()}"
    if sep and scheme.split("+")[0] in ("postgresql", "mysql"):
        if ":" in rest.split("/", 1)[0].rpartition("@")[0]:  # never a password in params.yaml or the logs
            raise ConfigError("search.storage holds a password (user:password@host); not accepted: give "
                              "postgresql://user@host/db and the password as PGPASSWORD or in ~/.pgpass")
        return url
    raise not_accepted("search.storage", url, "null (a journal file in the repository), sqlite:///path.db or "
                       "postgresql://user@host/db")
