"""What each DVC stage runs with: the locked packages its code imports and every package those depend on, one file per
stage (``paths.stage_env``/<stage>.txt, ``name==version`` a line), each a dependency of its stage in dvc.yaml.

uv.lock pins the dev tools too (pytest, ruff, the schemas' checkers): a stage that depended on the whole lock ran again
for a new ruff. A stage depends on its file instead, so a new version of a package changes the stages that import it,
directly or through another package, and ``dvc status`` names the file that moved; a dev tool's changes none.

The packages a stage imports are read from its code: every ``import`` (at any depth of a file, lazily or not) of the
Python files dvc.yaml lists among the stage's deps, which tests/test_pipeline.py holds equal to the ddpipe modules the
stage imports. A top-level module is the distribution(s) installed under it
(:func:`importlib.metadata.packages_distributions`), else the lock's package of its name (``timm``, an extra, where it
is not installed); the standard library and modules the lock does not pin are not packages of the lock. Then every
package the lock says those depend on, transitively, under every environment marker: the files are the same whichever
machine writes them. ``make lock`` rewrites them; tests/test_stage_env.py fails while one is stale.
"""

from __future__ import annotations

import ast
import sys
from importlib.metadata import packages_distributions
from pathlib import Path

import yaml
from packaging.utils import canonicalize_name

from ddpipe.core.files import atomic_write_text
from ddpipe.core.lockfile import Dependency, dependency_graph, locked_versions

STAGE_ENV_COMMAND = "ddpipe config --stage-env"
HEADER = (f"# The locked packages this stage runs with: what its code imports, and what those depend on (from uv.lock "
          f"and dvc.yaml by `{STAGE_ENV_COMMAND}`: edit those, not this file)")


def imported_modules(files: list[Path]) -> set[str]:
    """The top-level modules ``files`` import that are neither the standard library's nor ddpipe's."""
    found: set[str] = set()
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {alias.name.partition(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                found.add(node.module.partition(".")[0])
    return found - set(sys.stdlib_module_names) - {"ddpipe", "__future__"}


def packages(modules: set[str], locked: set[str], installed: dict[str, list[str]]) -> set[str]:
    """The lock's packages (canonical names, of ``locked``) that provide ``modules``; ``installed``: each top-level
    module and the distributions installed under it (:func:`importlib.metadata.packages_distributions`)."""
    found = set()
    for module in modules:
        names = {canonicalize_name(n) for n in installed.get(module, ())} or {canonicalize_name(module)}
        found |= names & locked
    return found


def requirements(graph: dict[str, dict[str, list[Dependency]]], roots: set[str]) -> set[str]:
    """``roots`` and every package they depend on in ``graph`` (:func:`ddpipe.core.lockfile.dependency_graph`),
    transitively, with the extras each asks of another, whatever the environment markers say (the same on every
    machine)."""
    names, seen, todo = set(), set(), [(root, "") for root in roots]
    while todo:
        name, extra = todo.pop()
        if (name, extra) in seen:
            continue
        seen.add((name, extra))
        names.add(name)
        todo += [(dep, asked) for dep, extras, _ in graph.get(name, {}).get(extra, []) for asked in ("", *extras)]
    return names


def stage_env_files(dvc_file: Path, lock: Path, folder: str | Path) -> dict[Path, str]:
    """Each stage of ``dvc_file``'s file under ``folder`` (relative to ``dvc_file``'s directory) and its text."""
    root = dvc_file.parent
    locked, graph, installed = locked_versions(lock), dependency_graph(lock)[1], packages_distributions()
    files = {}
    for stage, spec in yaml.safe_load(dvc_file.read_text())["stages"].items():
        code = [root / dep for dep in spec.get("deps", []) if isinstance(dep, str) and dep.endswith(".py")]
        names = requirements(graph, packages(imported_modules(code), set(locked), installed))
        lines = [f"{name}=={version}" for name in sorted(names) for version in sorted(locked[name])]
        files[root / folder / f"{stage}.txt"] = "\n".join([HEADER, *lines]) + "\n"
    return files


def stale_files(dvc_file: Path, lock: Path, folder: str | Path) -> dict[Path, str]:
    """The stage files that differ from what the lock and dvc.yaml say (missing ones included), and their text."""
    return {path: text for path, text in stage_env_files(dvc_file, lock, folder).items()
            if not path.is_file() or path.read_text() != text}


def write_stage_env(dvc_file: Path, lock: Path, folder: str | Path) -> list[Path]:
    """The stale stage files (:func:`stale_files`) written; their paths."""
    stale = stale_files(dvc_file, lock, folder)
    for path, text in stale.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, text)
    return list(stale)
