"""The parameter schema: load order, and every class of invalid input rejected with a message that
names the key, the value and what is accepted, before any work starts."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from ddpipe.config.keys import FIELDS, flatten, is_section, trajectory
from ddpipe.config.load import DOCS_COMMAND, default_of, load_config, parameters_page, schema_table
from ddpipe.config.schema import Config, ConfigError
from tests.conftest import PARAMS, ROOT, run

SCHEMA_DEFAULTS = {key: default_of(f) for key, f in FIELDS.items() if not is_section(key)}


def _leaves(mapping: dict, prefix: str = "") -> dict[str, Any]:
    """A YAML mapping's dotted leaf keys and values; an empty mapping (model.kwargs: {}) is a leaf."""
    out: dict[str, Any] = {}
    for key, value in mapping.items():
        if isinstance(value, dict) and value:
            out.update(_leaves(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def test_params_yaml_matches_the_schema_keys() -> None:
    """params.yaml spells out every key (so `dvc exp run -S key=...` can set any of them), and no other."""
    on_disk = _leaves(yaml.safe_load(PARAMS.read_text()))
    assert set(on_disk) == set(SCHEMA_DEFAULTS), (
        f"only in params.yaml: {sorted(set(on_disk) - set(SCHEMA_DEFAULTS))}; "
        f"only in the schema: {sorted(set(SCHEMA_DEFAULTS) - set(on_disk))}")


def _is_default(value: Any, default: Any) -> bool:
    """A value as params.yaml writes it is the schema's default: equal and of its type, or the digits of a key
    the schema holds as text (an int-or-word key such as train.freeze_body_epochs: 0, or distributed.nnodes: 1)."""
    if isinstance(default, str) and isinstance(value, int) and not isinstance(value, bool):
        return str(value) == default
    return type(value) is type(default) and value == default


def test_params_yaml_values_are_the_schema_defaults() -> None:
    """The schema is the one home of every default: params.yaml shows them, and never says otherwise."""
    on_disk = _leaves(yaml.safe_load(PARAMS.read_text()))
    differ = {key: (value, SCHEMA_DEFAULTS[key]) for key, value in on_disk.items()
              if key in SCHEMA_DEFAULTS and not _is_default(value, SCHEMA_DEFAULTS[key])}
    assert not differ, f"params.yaml values that are not the schema's defaults, as (params.yaml, schema): {differ}"
    assert load_config(params_file=PARAMS) == Config()


KEY_LINE = re.compile(r"^\s*([A-Za-z_]\w*):(?=\s|$)")


def test_every_key_of_params_yaml_has_a_comment() -> None:
    """Each key, sections included, says what it is: a trailing comment, or a comment line just above it (a
    `# --- group ---` banner names a group, not the key)."""
    lines = PARAMS.read_text().splitlines()
    keys, bare = [], []
    for n, line in enumerate(lines):
        if not (match := KEY_LINE.match(line)):
            continue
        keys.append(match.group(1))
        above = lines[n - 1].strip() if n else ""
        if not re.search(r"\s#", line[match.end():]) and not (above.startswith("#") and not above.startswith("# ---")):
            bare.append(f"line {n + 1}: {line.strip()}")
    assert len(keys) == len(FIELDS), "every key of the schema, sections included, on a line of its own"
    assert not bare, "params.yaml keys without a comment (trailing, or on the line above):\n" + "\n".join(bare)


def test_docs_parameters_md_is_generated_from_the_schema() -> None:
    page = ROOT / "docs" / "parameters.md"
    expected = parameters_page(ROOT / "dvc.yaml")
    assert page.exists() and page.read_text() == expected, (
        f"docs/parameters.md is stale (the schema or dvc.yaml changed): run `{DOCS_COMMAND}` from the repository root")
    for key in SCHEMA_DEFAULTS:
        assert f"| `{key}` |" in expected, key
    assert "Listed under `params:` by no stage." in expected.split("## `cluster`")[1]  # the submit command's own


def test_load_order_defaults_file_command_line(tmp_path: Path) -> None:
    params = tmp_path / "params.yaml"
    params.write_text("num_epochs: 5\ntrain:\n  base_lr: 0.01\n")
    cfg = load_config(["num_epochs=7"], params_file=params)
    assert cfg.num_epochs == 7  # command line beats the file
    assert cfg.train.base_lr == 0.01  # file beats the default
    assert cfg.train.batch_size_per_rank == Config().train.batch_size_per_rank  # default


def test_relied_on_keys_exist() -> None:
    keys = set(flatten(Config()))
    for key in ("num_epochs", "seed", "data.dataset", "data.source_dir", "data.val_fraction",
                "data.max_train_samples", "model.name", "train.base_lr", "train.lr_scaling",
                "train.batch_size_per_rank", "distributed.nproc_per_node", "distributed.max_restarts",
                "mlflow.tracking_uri", "mlflow.experiment_name", "paths.model", "paths.checkpoints"):
        assert key in keys, key


def test_every_field_is_documented() -> None:
    def walk(schema: type) -> None:
        for f in dataclasses.fields(schema):
            if dataclasses.is_dataclass(f.type) or f.name in ("data", "model", "train", "distributed",
                                                              "mlflow", "paths"):
                continue
            assert f.metadata.get("doc"), f"{schema.__name__}.{f.name} has no doc"

    for section in dataclasses.fields(Config):
        sub = getattr(Config(), section.name)
        if dataclasses.is_dataclass(sub):
            walk(type(sub))
    assert "`train.base_lr`" in schema_table()


def test_string_numbers_are_accepted() -> None:
    cfg = load_config(["num_epochs=20", "train.base_lr=3e-3", "data.max_train_samples=null",
                       "distributed.nproc_per_node=4", "train.hflip=false"], params_file=None)
    assert cfg.num_epochs == 20 and cfg.train.base_lr == 0.003 and cfg.data.max_train_samples is None
    assert cfg.distributed.nproc_per_node == "4" and cfg.train.hflip is False
    assert load_config(['num_epochs="20"'], params_file=None).num_epochs == 20
    assert load_config(["train.channels_last=off"], params_file=None).train.channels_last == "off"
    assert load_config(["train.channels_last=on"], params_file=None).train.channels_last == "on"


@pytest.mark.parametrize("override, key, accepted", [
    ("num_epochs=abc", "num_epochs", "an integer >= 1"),
    ("num_epochs=2.5", "num_epochs", "an integer >= 1"),
    ("num_epochs=-3", "num_epochs", "an integer >= 1"),
    ("num_epochs=0", "num_epochs", "an integer >= 1"),
    ("num_epochs=true", "num_epochs", "an integer"),
    ("data.val_fraction=1.5", "data.val_fraction", "a number > 0.0 and < 1.0"),
    ("data.val_fraction=abc", "data.val_fraction", "a number"),
    ("data.max_train_samples=0", "data.max_train_samples", ">= 1"),
    ("train.batch_size_per_rank=0", "train.batch_size_per_rank", "a positive integer or auto"),
    ("train.eval_batch_size_per_rank=-1", "train.eval_batch_size_per_rank", "a positive integer or auto"),
    ("train.base_lr=0", "train.base_lr", "> 0.0"),
    ("train.base_lr=-0.1", "train.base_lr", "> 0.0"),
    ("train.grad_accum_steps=0", "train.grad_accum_steps", ">= 1"),
    ("train.label_smoothing=1", "train.label_smoothing", "< 1.0"),
    ("data.dataset=imagenet", "data.dataset", "one of fashion_mnist, mnist, cifar10, imagefolder"),
    ("model.name=my-net", "model.name", "auto, a network's name, or module.path:ClassName"),
    ("model.name=nets:My:Net", "model.name", "auto, a network's name, or module.path:ClassName"),
    ("train.freeze_body_epochs=some", "train.freeze_body_epochs", "an integer >= 0 or all"),
    ("train.body_lr_ratio=0", "train.body_lr_ratio", "> 0.0 and <= 1.0"),
    ("train.optimizer=adam", "train.optimizer", "one of adamw, sgd"),
    ("train.precision=fp8", "train.precision", "one of auto, fp32, bf16, fp16"),
    ("train.lr_scaling=cubic", "train.lr_scaling", "one of sqrt, linear, none"),
    ("distributed.backend=mpi", "distributed.backend", "one of auto, nccl, gloo"),
    ("distributed.nproc_per_node=many", "distributed.nproc_per_node", "a positive integer or auto"),
    ("distributed.nproc_per_node=0", "distributed.nproc_per_node", "a positive integer or auto"),
    ("train.hflip=maybe", "train.hflip", "true or false"),
    ("num_epochs=null", "num_epochs", "an integer"),
])
def test_invalid_values_name_key_value_and_accepted(override: str, key: str, accepted: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config([override], params_file=PARAMS)
    message = str(err.value)
    assert message.startswith(f"command line: {key} = ")  # where it was set, and the key
    assert accepted in message
    assert override.split("=", 1)[1].lower() in message.lower()  # the bad value is shown


@pytest.mark.parametrize("override, shown, accepted", [
    ("train.base_lr=nan", "nan", "a number > 0.0"),
    ("train.base_lr=inf", "inf", "a number > 0.0"),
    ("train.base_lr=.inf", "inf", "a number > 0.0"),
    ("train.weight_decay=.nan", "nan", "a number >= 0.0"),
    ("data.val_fraction=-inf", "-inf", "a number > 0.0 and < 1.0"),
    ("train.grad_clip_norm=inf", "inf", "a number > 0.0 (or null)"),
])
def test_no_number_key_accepts_nan_or_inf(override: str, shown: str, accepted: str) -> None:
    key = override.split("=")[0]
    with pytest.raises(ConfigError) as err:
        load_config([override], params_file=None)
    assert str(err.value) == f"command line: {key} = {shown} is not accepted; expected {accepted}"


def test_nan_in_params_file_names_the_file(tmp_path: Path) -> None:
    params = tmp_path / "params.yaml"
    params.write_text("train:\n  momentum: .nan\n")
    with pytest.raises(ConfigError) as err:
        load_config([], params_file=params)
    assert str(err.value) == f"{params}: train.momentum = nan is not accepted; expected a number >= 0.0 and < 1.0"


def test_yaml_quirks_keep_their_meaning(tmp_path: Path) -> None:
    """Bare on/off (YAML 1.1 booleans) mean the words; an int given to a number key stays a float;
    process and node counts are stored as text; a quoted null is null."""
    params = tmp_path / "params.yaml"
    params.write_text("train:\n  channels_last: off\n  base_lr: 1\n  momentum: 0\n"
                      "distributed:\n  nproc_per_node: 2\n  nnodes: 1\nmlflow:\n  sweep: 'null'\n")
    cfg = load_config([], params_file=params)
    assert cfg.train.channels_last == "off"
    assert type(cfg.train.base_lr) is float and cfg.train.base_lr == 1.0
    assert type(cfg.train.momentum) is float
    assert cfg.distributed.nproc_per_node == "2" and cfg.distributed.nnodes == "1"
    assert cfg.mlflow.sweep is None
    cfg = load_config(["train.base_lr=3", "distributed.nproc_per_node=auto", "mlflow.tracking_uri=~"],
                      params_file=params)
    assert type(cfg.train.base_lr) is float and cfg.distributed.nproc_per_node == "auto"
    assert cfg.mlflow.tracking_uri is None


@pytest.mark.parametrize("override", ["train.hflip=1", "train.hflip=2", "distributed.exact=0"])
def test_a_switch_takes_only_true_or_false(override: str) -> None:
    with pytest.raises(ConfigError, match=f"command line: {override.split('=')[0]} = .* expected true or false"):
        load_config([override], params_file=None)


def test_elastic_nnodes_stays_min_colon_max_in_the_file_and_on_the_command_line(tmp_path: Path) -> None:
    """YAML 1.1 would read an unquoted 1:4 as the base-60 integer 64 (what `dvc exp run -S` writes)."""
    params = tmp_path / "params.yaml"
    params.write_text("distributed:\n  nnodes: 1:4\n  rdzv_endpoint: node0:29400\n")
    assert load_config([], params_file=params).distributed.nnodes == "1:4"
    assert load_config(["distributed.nnodes=2:8", "distributed.rdzv_endpoint=node0:29400"],
                       params_file=None).distributed.nnodes == "2:8"
    assert load_config(["num_epochs=20"], params_file=None).num_epochs == 20


def test_a_later_layer_may_correct_an_earlier_one(tmp_path: Path) -> None:
    params = tmp_path / "params.yaml"
    params.write_text("num_epochs: 0\n")
    with pytest.raises(ConfigError) as err:
        load_config([], params_file=params)
    assert str(err.value) == f"{params}: num_epochs = 0 is not accepted; expected an integer >= 1"
    assert load_config(["num_epochs=3"], params_file=params).num_epochs == 3


@pytest.mark.parametrize("yaml_text, message", [
    ("data: 5\n", "'data' is a section; expected a mapping, got 5"),
    ("data:\n", "'data' is a section; expected a mapping, got None"),
    ("train:\n  base_lr:\n    value: 0.1\n",
     "'train.base_lr' is a value, not a section: got train.base_lr.value = 0.1; expected a number > 0.0"),
])
def test_section_and_value_mix_ups_are_named(tmp_path: Path, yaml_text: str, message: str) -> None:
    params = tmp_path / "params.yaml"
    params.write_text(yaml_text)
    with pytest.raises(ConfigError) as err:
        load_config([], params_file=params)
    assert str(err.value) == f"{params}: {message}"


def test_trajectory_leaves_out_exactly_the_keys_a_run_may_resume_across() -> None:
    """Checkpoint fingerprints hash trajectory(cfg): its keys, values and types must not drift."""
    cfg = load_config(["train.base_lr=1", "distributed.nproc_per_node=2"], params_file=PARAMS)
    flat = flatten(cfg)
    resumable = {k for k in flat if k.startswith(("paths.", "mlflow.", "cluster.", "search.", "export."))} | {
        "distributed.max_restarts", "distributed.timeout_s", "distributed.nproc_per_node", "distributed.nnodes",
        "distributed.rdzv_endpoint", "distributed.rdzv_id", "distributed.shutdown_timeout_s",
        "distributed.shared_memory", "train.progress_bar", "train.log_every_n_steps", "train.val_every_n_steps",
        "train.checkpoint_every_steps", "train.keep_checkpoints",
        "train.eval_batch_size_per_rank", "train.model_epoch", "data.num_workers", "data.decode_on", "train.auto_by",
        "data.max_test_samples"}  # the test split: no training reads it
    expected = {k: v for k, v in flat.items() if k not in resumable}
    assert trajectory(cfg) == expected and list(trajectory(cfg)) == list(expected)
    assert json.dumps(trajectory(cfg)) == json.dumps(expected)  # same types: 1.0 stays 1.0
    assert "train.base_lr" in trajectory(cfg) and "paths.raw" not in trajectory(cfg)


@pytest.mark.parametrize("override, unknown, suggestion", [
    ("data.no_such_key=1", "data.no_such_key", None),
    ("num_epoch=3", "num_epoch", "num_epochs"),
    ("train.base_lrr=0.1", "train.base_lrr", "train.base_lr"),
    ("trian.base_lr=0.1", "trian", "train"),
])
def test_unknown_keys_are_rejected_with_did_you_mean(override: str, unknown: str, suggestion: str | None) -> None:
    with pytest.raises(ConfigError) as err:
        load_config([override], params_file=PARAMS)
    message = str(err.value)
    assert f"unknown key '{unknown}'" in message
    if suggestion:
        assert f"Did you mean '{suggestion}'" in message


def test_a_renamed_key_is_refused_with_its_new_name_from_the_command_line_and_a_params_file(tmp_path: Path) -> None:
    """train.export (which epoch's weights leave the run) is train.model_epoch: an old params.yaml or override is
    refused naming the new key, never read as the new one nor met with a guess."""
    old = tmp_path / "params.yaml"
    old.write_text("train:\n  export: last\n")
    for overrides, params_file, source in ((["train.export=last"], PARAMS, "command line"), ([], old, str(old))):
        with pytest.raises(ConfigError) as err:
            load_config(overrides, params_file=params_file)
        assert str(err.value) == (f"{source}: 'train.export' is now 'train.model_epoch' (the same values); "
                                  "set train.model_epoch instead")
    assert load_config(["train.model_epoch=last"], params_file=PARAMS).train.model_epoch == "last"


def test_bad_params_file_is_named(tmp_path: Path) -> None:
    bad = tmp_path / "params.yaml"
    bad.write_text("num_epochs: [1, 2\n")
    with pytest.raises(ConfigError, match=str(bad)):
        load_config([], params_file=bad)
    bad.write_text("num_epochs: 2\ntrain:\n  batch_size: 3\n")
    with pytest.raises(ConfigError, match=r"params.yaml: unknown key 'train.batch_size'"):
        load_config([], params_file=bad)


def test_override_without_equals_is_rejected() -> None:
    with pytest.raises(ConfigError, match="key=value"):
        load_config(["num_epochs"], params_file=None)


@pytest.mark.parametrize("stage, bad", [
    *[("prepare", b) for b in ("num_epochs=abc", "num_epochs=-3", "num_epochs=2.5",
                               "data.val_fraction=1.5", "data.no_such_key=1")],
    ("fetch", "num_epochs=abc"), ("train", "train.base_lr=0"), ("evaluate", "data.no_such_key=1"),
])
def test_stage_scripts_fail_before_work_naming_the_key(tmp_path: Path, stage: str, bad: str) -> None:
    """Each stage exits non-zero with one line naming the key; nothing is written or touched."""
    sentinel = tmp_path / "raw"
    sentinel.mkdir()
    (sentinel / "keep.txt").write_text("precious")
    result = run(["python", f"stages/{stage}.py", bad, f"paths.raw={sentinel}",
                  f"paths.prepared={tmp_path}/prepared", f"paths.model={tmp_path}/m.pt"],
                 check=False, timeout=120)
    assert result.returncode == 2, result.stderr
    assert bad.split("=")[0] in result.stderr and "Traceback" not in result.stderr
    assert (sentinel / "keep.txt").read_text() == "precious"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["raw"]


def test_config_module_prints_schema_and_resolved_config() -> None:
    out = run(["ddpipe", "config", "num_epochs=3"], cwd=ROOT).stdout  # as python -m ddpipe.config
    assert "num_epochs: 3" in out
    assert "| `data.val_fraction` |" in run(["python", "-m", "ddpipe.config", "--schema"]).stdout
    assert run(["python", "-m", "ddpipe.config", "--docs"], cwd=ROOT).stdout == parameters_page(ROOT / "dvc.yaml")


@pytest.mark.parametrize("weights", ["models/model.pt", "/tmp/resnet50.pth", "pretrained/../models/model.pt",
                                     "pretrained"])
def test_a_weights_file_outside_paths_pretrained_is_refused(weights: str) -> None:
    """DVC re-trains when a weights file changes only if it lies in the train stage's dependency."""
    with pytest.raises(ConfigError) as err:
        load_config([f"model.weights={weights}"])
    assert f"model.weights = {weights!r} is not accepted" in str(err.value)
    assert "paths.pretrained (pretrained/...)" in str(err.value)


def test_weights_under_paths_pretrained_or_a_torchvision_name_and_kwargs_are_accepted() -> None:
    cfg = load_config(["model.weights=pretrained/exp1.pt", "model.name=mynets:TinyNet", "model.kwargs.depth=3",
                       "train.freeze_body_epochs=all"])
    assert cfg.model.kwargs == {"depth": 3} and cfg.train.freeze_body_epochs == "all"
    assert flatten(cfg)["model.kwargs.depth"] == 3 and trajectory(cfg)["model.kwargs.depth"] == 3
    assert load_config(["model.weights=ResNet50_Weights.IMAGENET1K_V2"]).model.weights.startswith("ResNet50")
