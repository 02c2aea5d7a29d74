"""The whole parameter schema, and how a run's configuration is loaded and checked.

Loading order (later wins): the defaults below < ``params.yaml`` < ``key=value`` overrides on the
command line. Every value is checked before any work starts; a mistake raises :class:`ConfigError`
whose message names the key, the bad value and what is accepted.

Each field carries its documentation and its bounds in ``metadata`` so that one table drives the
checks and the printed schema (``python -m ddpipe.config``).
"""

from __future__ import annotations

import dataclasses
import difflib
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union, get_args, get_origin, get_type_hints

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

DEFAULT_PARAMS_FILE = "params.yaml"


class ConfigError(ValueError):
    """A parameter the user set is unknown, of the wrong type, or out of range."""


def _p(default: Any, doc: str, **rules: Any) -> Any:
    """A schema field: its default, a one-line doc, and optional rules
    (``ge``/``gt``/``le``/``lt`` bounds, ``choices``, ``int_or``: extra words an int field accepts)."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: default, metadata={"doc": doc, **rules})
    return field(default=default, metadata={"doc": doc, **rules})


DATASETS = ("fashion_mnist", "mnist", "cifar10", "imagefolder")
MODELS = ("resnet_small", "seed_cnn", "resnet18", "resnet34", "resnet50")


@dataclass
class DataConfig:
    dataset: str = _p("fashion_mnist", "Which dataset the fetch stage reads.", choices=DATASETS)
    source_dir: Optional[str] = _p(
        None,
        "Directory holding the dataset's files (the four *-ubyte.gz files for the MNISTs, "
        "cifar-10-python.tar.gz or its unpacked folder for CIFAR-10, class folders for imagefolder). "
        "null: the Debian package's directory, then a download.",
    )
    download: bool = _p(True, "Allow torchvision's download when no local copy is found.")
    val_fraction: float = _p(
        0.1, "Share of the official training set held out (stratified) for validation.", gt=0.0, lt=1.0
    )
    test_fraction: float = _p(
        0.1, "imagefolder only (it has no official test split): share held out for the test split.",
        gt=0.0, lt=1.0,
    )
    max_train_samples: Optional[int] = _p(
        None, "Keep a stratified subset of this many training samples (null = all).", ge=1
    )
    image_size: int = _p(32, "imagefolder only: images are resized to this square size.", ge=8)


@dataclass
class ModelConfig:
    name: str = _p("resnet_small", "Network to train.", choices=MODELS)
    width: int = _p(16, "resnet_small / seed_cnn: channels of the first stage.", ge=4)


@dataclass
class TrainConfig:
    optimizer: str = _p("adamw", "Optimizer.", choices=("adamw", "sgd"))
    base_lr: float = _p(3e-3, "Learning rate for one process, before lr_scaling.", gt=0.0)
    lr_scaling: str = _p(
        "sqrt", "How the lr grows with world size: base_lr x sqrt(W), x W, or unchanged.",
        choices=("sqrt", "linear", "none"),
    )
    momentum: float = _p(0.9, "SGD momentum (AdamW: beta1).", ge=0.0, lt=1.0)
    nesterov: bool = _p(True, "SGD only: Nesterov momentum.")
    weight_decay: float = _p(5e-4, "Decoupled weight decay (AdamW) or L2 (SGD).", ge=0.0)
    warmup_epochs: float = _p(0.5, "Linear warm-up length, in epochs (counted in optimizer steps).", ge=0.0)
    lr_schedule: str = _p("cosine", "After warm-up: cosine decay or constant.", choices=("cosine", "constant"))
    min_lr_ratio: float = _p(0.0, "Cosine floor as a share of the peak lr.", ge=0.0, le=1.0)
    label_smoothing: float = _p(0.1, "Cross-entropy label smoothing.", ge=0.0, lt=1.0)
    grad_clip_norm: Optional[float] = _p(None, "Clip the global gradient norm to this (null = off).", gt=0.0)
    grad_accum_steps: int = _p(1, "Micro-batches per optimizer step (no_sync on all but the last).", ge=1)
    batch_size_per_rank: int = _p(256, "Training micro-batch per process.", ge=1)
    eval_batch_size_per_rank: int = _p(1000, "Validation/test batch per process.", ge=1)
    precision: str = _p(
        "auto", "auto: bf16 where the device runs it fast, else fp32. fp16 needs CUDA.",
        choices=("auto", "fp32", "bf16", "fp16"),
    )
    channels_last: str = _p(
        "auto", "Memory format for conv nets: auto (on for CPU and for CUDA with bf16/fp16), on, off.",
        choices=("auto", "on", "off"),
    )
    compile: bool = _p(False, "Wrap the model in torch.compile.")
    random_crop_padding: int = _p(2, "Augmentation: pad by this many pixels, then crop back (0 = off).", ge=0)
    hflip: bool = _p(True, "Augmentation: random horizontal flips (turn off for digits).")
    checkpoint_every_steps: int = _p(
        0, "Also checkpoint every N optimizer steps within an epoch (0 = at epoch ends only).", ge=0
    )
    keep_checkpoints: int = _p(2, "How many newest checkpoints to keep.", ge=1)
    export: str = _p(
        "best", "Which weights become paths.model and the logged model: the epoch with the best validation "
        "accuracy (the earliest on ties) or the last epoch.", choices=("best", "last"),
    )
    early_stopping_patience: Optional[int] = _p(
        None, "Stop after this many epochs without a better validation accuracy (null = off).", ge=1
    )
    progress_bar: bool = _p(True, "tqdm progress bar on rank 0.")


@dataclass
class DistributedConfig:
    nproc_per_node: str = _p(
        "auto", "Processes per node: an int, or auto (one per GPU; on a CPU-only machine 1, using every core).",
        int_or=("auto",),
    )
    max_restarts: int = _p(0, "torchrun restarts of the worker group after a failure.", ge=0)
    nnodes: str = _p(
        "1", "Nodes (torchrun --nnodes): N, or MIN:MAX for elastic jobs. More than 1 needs rdzv_endpoint.",
    )
    rdzv_endpoint: str = _p("", "host:port of the c10d rendezvous (the first node), for multi-node runs.")
    rdzv_id: str = _p("ddpipe", "Rendezvous id: the same on every node of one job, new for each job.")
    backend: str = _p("auto", "auto: nccl on CUDA, gloo on CPU.", choices=("auto", "nccl", "gloo"))
    sync_batchnorm: bool = _p(True, "Synchronise BatchNorm statistics across processes.")
    exact: bool = _p(
        False, "World-size-exact arithmetic (CPU): every sum over the batch in fp64, so 1 and N processes with "
        "the same global batch end with the same weights; 2.6x (fp32) to 4.2x (bf16) slower per step.",
    )
    threads_per_process: Optional[int] = _p(
        None, "CPU threads per process (null = cores / local world size).", ge=1
    )
    timeout_s: int = _p(600, "Bound on every collective; a silent rank fails the job after this.", ge=1)
    shutdown_timeout_s: int = _p(
        60, "torchrun --shutdown-timeout: after forwarding a stop signal, seconds it gives the workers to "
        "checkpoint their step and exit before it kills them.", ge=1,
    )


@dataclass
class MlflowConfig:
    tracking_uri: Optional[str] = _p(
        None, "Where runs go. MLFLOW_TRACKING_URI wins; null: sqlite:///<repo root>/mlflow.db."
    )
    experiment_name: str = _p("ddpipe", "MLflow experiment the runs are filed under.")
    log_model: bool = _p(
        True, "Log the exported model (train.export) as an MLflow pyfunc model that takes images as clients have "
        "them and returns class probabilities and names.")
    registered_model_name: Optional[str] = _p(
        None, "Also register the logged model under this name (a version tagged with the DVC experiment and "
        "git commit); null: no registration.")
    sweep: Optional[str] = _p(
        None, "Name of the sweep this run belongs to: runs with the same name are nested under one parent run "
        "of that name (dvc exp run --queue -S mlflow.sweep=NAME ...); null: a top-level run.")
    log_system_metrics: bool = _p(
        True, "MLflow's system metrics (CPU, memory, GPU) every 10 s: rank 0's node into a local store, every "
        "node into a tracking server.")


@dataclass
class PathsConfig:
    raw: str = _p("data/raw", "Fetch stage output: verified copies of the dataset's files.")
    prepared: str = _p("data/prepared", "Prepare stage output: uint8 tensors per split plus meta.json.")
    checkpoints: str = _p("checkpoints", "Training checkpoints (persist: true in dvc.yaml).")
    model: str = _p("models/model.pt", "Final weights plus what rebuilds the model.")
    run_info: str = _p("models/run.json", "The MLflow run id the evaluate stage logs to.")
    train_metrics: str = _p("metrics/train.json", "Final training metrics (DVC metrics).")
    history: str = _p("metrics/history.csv", "Per-epoch training curves (DVC plots).")
    test_metrics: str = _p("metrics/test.json", "Test-split accuracy, macro-F1, loss (DVC metrics).")
    per_class: str = _p("metrics/per_class.csv", "Test-split precision, recall and F1 per class (DVC plots).")
    confusion: str = _p("metrics/confusion.csv", "Test predictions for DVC's confusion plot.")
    reports: str = _p("reports", "Evaluate stage images: confusion matrix, misclassified samples.")


@dataclass
class Config:
    seed: int = _p(42, "Seeds weights, splits and augmentation.", ge=0)
    num_epochs: int = _p(10, "Training epochs.", ge=1)
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)
    paths: PathsConfig = field(default_factory=PathsConfig)


# ---------------------------------------------------------------------------------------------
# Loading


def load_config(
    overrides: list[str] | None = None, params_file: str | Path | None = DEFAULT_PARAMS_FILE
) -> Config:
    """Defaults < ``params_file`` (skipped when None or missing) < ``overrides`` (``key=value``)."""
    layers: list[tuple[str, dict]] = []
    if params_file is not None and Path(params_file).exists():
        layers.append((str(params_file), _read_yaml(Path(params_file))))
    if overrides:
        layers.append(("command line", _parse_overrides(overrides)))
    for source, layer in layers:
        _check_keys(layer, Config, source, prefix="")
    cfg = OmegaConf.structured(Config)
    for source, layer in layers:
        for key, value in flatten_mapping(layer).items():
            _set(cfg, key, value, source)
    obj = OmegaConf.to_object(cfg)
    assert isinstance(obj, Config)
    validate(obj)
    return obj


def _read_yaml(path: Path) -> dict:
    try:
        data = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
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
    try:
        return OmegaConf.to_container(OmegaConf.from_dotlist(list(overrides)))  # type: ignore[return-value]
    except OmegaConfBaseException as exc:
        raise ConfigError(f"command line: cannot parse overrides {overrides}: {exc}") from exc


def _check_keys(layer: dict, schema: type, source: str, prefix: str) -> None:
    hints = get_type_hints(schema)
    for key, value in layer.items():
        full = f"{prefix}{key}"
        if key not in hints:
            known = list(hints)
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f" Did you mean '{prefix}{close[0]}'?" if close else ""
            where = f"'{prefix[:-1]}'" if prefix else "the top level"
            raise ConfigError(
                f"{source}: unknown key '{full}'.{hint} Keys at {where}: {', '.join(known)}"
            )
        if dataclasses.is_dataclass(hints[key]):
            if not isinstance(value, dict):
                raise ConfigError(f"{source}: '{full}' is a section; expected a mapping, got {value!r}")
            _check_keys(value, hints[key], source, prefix=f"{full}.")


def flatten_mapping(d: dict, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten_mapping(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _set(cfg: Any, key: str, value: Any, source: str) -> None:
    spec = _field_spec(key)
    value = _coerce(key, value, spec, source)
    try:
        OmegaConf.update(cfg, key, value, merge=True)
    except OmegaConfBaseException as exc:
        raise ConfigError(f"{source}: {key} = {value!r} is not accepted: {exc.msg}") from exc


def _field_spec(key: str) -> tuple[Any, dict]:
    schema: type = Config
    parts = key.split(".")
    for part in parts[:-1]:
        schema = get_type_hints(schema)[part]
    f = {f.name: f for f in dataclasses.fields(schema)}[parts[-1]]
    return get_type_hints(schema)[parts[-1]], dict(f.metadata)


def _describe(tp: Any, meta: dict) -> str:
    base, optional = _unwrap_optional(tp)
    if "choices" in meta:
        desc = "one of " + ", ".join(meta["choices"])
    elif "int_or" in meta:
        desc = "a positive integer or " + " or ".join(meta["int_or"])
    else:
        desc = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}[base]
        bounds = [f"{op} {meta[k]}" for k, op in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"))
                  if k in meta]
        if bounds:
            desc += " " + " and ".join(bounds)
    return desc + (" (or null)" if optional else "")


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    if get_origin(tp) is Union:
        args = [a for a in get_args(tp) if a is not type(None)]
        return args[0], True
    return tp, False


def _coerce(key: str, value: Any, spec: tuple[Any, dict], source: str) -> Any:
    """Turn a YAML/command-line value into the field's type, or raise naming key, value and type."""
    tp, meta = spec
    base, optional = _unwrap_optional(tp)

    def bad() -> ConfigError:
        shown = "null" if value is None else repr(value)
        return ConfigError(f"{source}: {key} = {shown} is not accepted; expected {_describe(tp, meta)}")

    if value is None or (isinstance(value, str) and value.strip().lower() in ("null", "~")):
        if optional:
            return None
        raise bad()
    if base is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in ("true", "false"):
            return value.strip().lower() == "true"
        raise bad()
    if base is int:
        if isinstance(value, bool):
            raise bad()
        if isinstance(value, int):
            return value
        if isinstance(value, str) and value.strip().lstrip("+-").isdigit():
            return int(value.strip())
        raise bad()
    if base is float:
        if isinstance(value, bool):
            raise bad()
        if isinstance(value, (int, float)):
            return float(value)
        try:
            return float(str(value).strip())
        except ValueError:
            raise bad() from None
    if base is str:
        if "int_or" in meta:
            text = str(value).strip()
            if isinstance(value, bool) or not (text in meta["int_or"] or text.isdigit()):
                raise bad()
            return text
        if isinstance(value, (dict, list)):
            raise bad()
        if isinstance(value, bool) and "on" in meta.get("choices", ()):
            return "on" if value else "off"  # YAML 1.1 reads a bare on/off as a boolean
        return str(value)
    raise AssertionError(f"unsupported schema type for {key}: {tp}")


# ---------------------------------------------------------------------------------------------
# Checks


def validate(cfg: Config) -> None:
    """Check every bound and choice of the schema, plus the rules that tie fields together."""
    _validate_section(cfg, Config, prefix="")
    nnodes = cfg.distributed.nnodes.split(":")
    if not (1 <= len(nnodes) <= 2 and all(n.isdigit() and int(n) >= 1 for n in nnodes)):
        raise ConfigError(f"distributed.nnodes = {cfg.distributed.nnodes!r} is not accepted; expected a "
                          "positive integer N or MIN:MAX")
    if nnodes != ["1"] and ":" not in cfg.distributed.rdzv_endpoint:
        raise ConfigError(f"distributed.rdzv_endpoint = {cfg.distributed.rdzv_endpoint!r} is not accepted "
                          f"with distributed.nnodes = {cfg.distributed.nnodes!r}; expected host:port of "
                          "the first node")
    if cfg.distributed.exact and not cfg.distributed.sync_batchnorm:
        raise ConfigError("distributed.sync_batchnorm = False is not accepted with distributed.exact = True "
                          "(exact mode normalises over the global batch); accepted: true")
    if cfg.distributed.exact and cfg.train.compile:
        raise ConfigError("train.compile = True is not accepted with distributed.exact = True (compiled "
                          "kernels may reorder the per-sample arithmetic); accepted: false")
    if cfg.distributed.nproc_per_node != "auto" and int(cfg.distributed.nproc_per_node) < 1:
        raise ConfigError(
            f"distributed.nproc_per_node = {cfg.distributed.nproc_per_node!r} is not accepted; "
            "expected a positive integer or auto"
        )


def _validate_section(obj: Any, schema: type, prefix: str) -> None:
    hints = get_type_hints(schema)
    for f in dataclasses.fields(schema):
        key, value, meta = f"{prefix}{f.name}", getattr(obj, f.name), f.metadata
        if dataclasses.is_dataclass(hints[f.name]):
            _validate_section(value, hints[f.name], f"{key}.")
            continue
        if value is None:
            continue
        ok = True
        if "choices" in meta:
            ok = value in meta["choices"]
        if "ge" in meta and value < meta["ge"]:
            ok = False
        if "gt" in meta and value <= meta["gt"]:
            ok = False
        if "le" in meta and value > meta["le"]:
            ok = False
        if "lt" in meta and value >= meta["lt"]:
            ok = False
        if not ok:
            raise ConfigError(
                f"{key} = {value!r} is not accepted; expected {_describe(hints[f.name], meta)}"
            )


# ---------------------------------------------------------------------------------------------
# Views of a loaded config


def to_dict(cfg: Config) -> dict:
    """The config as nested plain containers."""
    return dataclasses.asdict(cfg)


def flatten(cfg: Config) -> dict[str, Any]:
    """The config as ``{"train.base_lr": 0.002, ...}``."""
    return flatten_mapping(to_dict(cfg))


def to_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def schema_table() -> str:
    """A Markdown table of every parameter: key, default, accepted values, meaning."""
    rows = ["| key | default | accepted | meaning |", "| --- | --- | --- | --- |"]

    def walk(schema: type, prefix: str) -> None:
        hints = get_type_hints(schema)
        defaults = schema()
        for f in dataclasses.fields(schema):
            if dataclasses.is_dataclass(hints[f.name]):
                walk(hints[f.name], f"{prefix}{f.name}.")
                continue
            default = getattr(defaults, f.name)
            shown = "null" if default is None else str(default).lower() if isinstance(default, bool) else default
            rows.append(
                f"| `{prefix}{f.name}` | `{shown}` | {_describe(hints[f.name], f.metadata)} "
                f"| {f.metadata['doc']} |"
            )

    walk(Config, "")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    """``python -m ddpipe.config [key=value ...]``: check params.yaml (+ overrides), print the result;
    ``--schema`` prints the documented schema instead."""
    argv = sys.argv[1:] if argv is None else argv
    if "--schema" in argv:
        print(schema_table())
        return 0
    try:
        print(to_yaml(load_config(argv)), end="")
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
