"""The locked environment (uv.lock): this Python holds it (its versions, and every package of the set its venv was made
from), it agrees with pyproject.toml, and it is read right."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from ddpipe.core.lockfile import (
    DEV_EXTRA,
    LOCK_FILE,
    dependency_graph,
    differences,
    environment_tags,
    find_lock,
    installed_versions,
    locked_sets,
    locked_versions,
    venv_set,
)
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
    assert venv_set(ROOT / LOCK_FILE, installed_versions())[0] == "dev"  # `make venv`'s: uv sync --extra dev


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


def test_the_dependency_graph_is_read_as_tomllib_reads_it() -> None:
    def dependency(d: dict) -> tuple[str, tuple[str, ...], str]:
        return re.sub(r"[-_.]+", "-", d["name"]).lower(), tuple(d.get("extra", ())), d.get("marker", "")

    graph, root = {}, None
    for package in tomllib.loads((ROOT / LOCK_FILE).read_text())["package"]:
        name = re.sub(r"[-_.]+", "-", package["name"]).lower()
        if package.get("source") in ({"editable": "."}, {"virtual": "."}):
            root = name
        deps = graph.setdefault(name, {})
        if "dependencies" in package:
            deps.setdefault("", []).extend(dependency(d) for d in package["dependencies"])
        for extra, listed in package.get("optional-dependencies", {}).items():
            deps.setdefault(extra, []).extend(dependency(d) for d in listed)
    assert dependency_graph(ROOT / LOCK_FILE) == (root, graph) and root == "ddpipe"
    assert graph[root][DEV_EXTRA] and any(extras for _, extras, _ in graph[root][DEV_EXTRA])  # mlflow[auth]


# A lock as uv writes it: a project whose runtime set is alpha, beta and beta's extra `fast` (gamma), not winonly (its
# marker excludes Linux); its dev extra adds pytest and pytest's pluggy
SMALL_LOCK = """version = 1
revision = 5
requires-python = ">=3.11"

[[package]]
name = "app"
version = "0.1.0"
source = { editable = "." }
dependencies = [
    { name = "alpha" },
    { name = "winonly", marker = "sys_platform == 'win32'" },
]

[package.optional-dependencies]
dev = [
    { name = "pytest" },
]

[package.metadata]
requires-dist = [
    { name = "alpha" },
    { name = "pytest", marker = "extra == 'dev'" },
    { name = "winonly", marker = "sys_platform == 'win32'" },
]
provides-extras = ["dev"]

[[package]]
name = "alpha"
version = "1.0"
source = { registry = "https://pypi.org/simple" }
dependencies = [
    { name = "beta", extra = ["fast"] },
]
wheels = [
    { url = "https://files.example/alpha-1.0-py3-none-any.whl", hash = "sha256:00", size = 1 },
]
"""
SMALL_LOCK += "".join(f"""
[[package]]
name = "{name}"
version = "{version}"
source = {{ registry = "https://pypi.org/simple" }}
{more}""" for name, version, more in [
    ("beta", "2.0", '\n[package.optional-dependencies]\nfast = [\n    { name = "gamma" },\n]\n'),
    ("gamma", "3.0", ""), ("pytest", "8.0", 'dependencies = [\n    { name = "pluggy" },\n]\n'), ("pluggy", "1.5", ""),
    ("winonly", "1.0", "")])
RUNTIME = {"app": "0.1.0", "alpha": "1.0", "beta": "2.0", "gamma": "3.0"}


def test_a_missing_package_of_the_venvs_set_is_named_and_a_dev_one_missing_from_a_runtime_venv_is_not(
        tmp_path: Path) -> None:
    (tmp_path / LOCK_FILE).write_text(SMALL_LOCK)
    assert locked_sets(tmp_path / LOCK_FILE) == ({"alpha", "beta", "gamma"}, {"alpha", "beta", "gamma", "pytest",
                                                                                "pluggy"})
    tags = environment_tags(tmp_path, installed=RUNTIME)  # a runtime venv: no pytest, no pluggy
    assert tags["ddpipe.env_matches_lock"] == "true"
    tags = environment_tags(tmp_path, installed={k: v for k, v in RUNTIME.items() if k != "gamma"})
    assert tags["ddpipe.env_matches_lock"] == "false: gamma missing (lock: 3.0, runtime set)"
    tags = environment_tags(tmp_path, installed={**RUNTIME, "pytest": "8.0"})  # a dev venv without pytest's pluggy
    assert tags["ddpipe.env_matches_lock"] == "false: pluggy missing (lock: 1.5, dev set)"
    tags = environment_tags(tmp_path, installed={**RUNTIME, "alpha": "0.9", "pytest": "8.0", "pluggy": "1.5"})
    assert tags["ddpipe.env_matches_lock"] == "false: alpha 0.9 (lock: 1.0)"
