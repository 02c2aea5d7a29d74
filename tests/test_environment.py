"""The locked environment (uv.lock): this Python holds it, it agrees with pyproject.toml, and it is read right."""

from __future__ import annotations

import re
import tomllib

import pytest

from ddpipe.core.lockfile import LOCK_FILE, differences, find_lock, installed_versions, locked_versions
from tests.conftest import ROOT, VENV_BIN, run


def test_the_lock_is_found_from_any_folder_of_the_checkout() -> None:
    assert find_lock(ROOT / "src" / "ddpipe") == ROOT / LOCK_FILE


def test_the_lock_is_read_as_tomllib_reads_it() -> None:
    canonical = {}
    for package in tomllib.loads((ROOT / LOCK_FILE).read_text())["package"]:
        if "version" in package:
            canonical.setdefault(re.sub(r"[-_.]+", "-", package["name"]).lower(), set()).add(package["version"])
    assert locked_versions(ROOT / LOCK_FILE) == canonical and len(canonical) > 100


def test_this_python_holds_the_locks_versions() -> None:
    assert {"torch", "mlflow", "dvc", "optuna", "omegaconf", "onnxruntime"} <= set(installed_versions())
    assert differences(ROOT / LOCK_FILE) == []


def test_a_version_the_lock_does_not_hold_is_named(tmp_path) -> None:  # noqa: ANN001
    lock = tmp_path / LOCK_FILE
    text = (ROOT / LOCK_FILE).read_text()
    torch = installed_versions()["torch"].split("+")[0]
    lock.write_text(text.replace(f'name = "torch"\nversion = "{torch}"', 'name = "torch"\nversion = "1.0.0"'))
    assert differences(lock) == [f"torch {installed_versions()['torch']} (lock: 1.0.0)"]


def test_the_lock_agrees_with_pyproject() -> None:
    uv = VENV_BIN / "uv"
    if not uv.exists():
        pytest.skip(f"{uv} missing: the venv was not made by `make venv`")
    run([str(uv), "lock", "--check", "--offline"], cwd=ROOT)
