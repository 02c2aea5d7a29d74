"""The library's shape, read from the code itself: packages in the layers ddpipe.LAYERS states (every import
counts: at the top, inside functions, under TYPE_CHECKING), thin entry points at the package root, no file or
class too long to read at a glance, each rule's number and each environment variable's name written once."""

from __future__ import annotations

import ast
from pathlib import Path

import ddpipe
from tests.conftest import ROOT

SRC = ROOT / "src" / "ddpipe"


def _imports(path: Path) -> list[tuple[str, int]]:
    """Every ddpipe module ``path`` imports, at any depth of the file, dotted below ``ddpipe`` ('' for the package's
    face), with its line."""
    rel = path.relative_to(SRC).parts if path.is_relative_to(SRC) else ()
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = list(rel[:-1])[: len(rel) - node.level]
            found.append((".".join(base + (node.module or "").split(".")).strip("."), node.lineno))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "ddpipe":
            found.append((node.module.partition(".")[2], node.lineno))
        elif isinstance(node, ast.Import):
            found += [(a.name.partition(".")[2], node.lineno) for a in node.names if a.name.split(".")[0] == "ddpipe"]
    return found


def _layer_of() -> dict[str, int]:
    return {pkg: i for i, layer in enumerate(ddpipe.LAYERS) for pkg in layer}


def test_every_package_has_a_layer() -> None:
    packages = {p.parent.name for p in SRC.glob("*/__init__.py")}
    assert packages == set(_layer_of())


def test_packages_import_only_packages_below_their_layer() -> None:
    layer = _layer_of()
    wrong = []
    for path in SRC.glob("*/**/*.py"):
        own = path.relative_to(SRC).parts[0]
        for module, line in _imports(path):
            target = module.split(".")[0]
            # '' is ``from ddpipe import __version__``: the face's values, which import nothing
            if target and target != own and not layer[target] < layer[own]:
                wrong.append(f"{path.relative_to(SRC)}:{line} imports ddpipe.{module}")
    assert wrong == []


def test_no_two_packages_import_each_other() -> None:
    edges = {(path.relative_to(SRC).parts[0], module.split(".")[0]) for path in SRC.glob("*/**/*.py")
             for module, _ in _imports(path) if module}
    assert {(a, b) for a, b in edges if a != b and (b, a) in edges} == set()


def test_the_package_root_holds_thin_entry_points_that_nothing_imports() -> None:
    """``python -m ddpipe`` (__main__.py, a few lines calling the ``ddpipe`` command of ddpipe.console): nothing else
    lives at the root, and nothing imports it."""
    entries = {p.stem for p in SRC.glob("*.py") if p.name != "__init__.py"}
    assert entries == {"__main__"}
    for name in entries:
        text = (SRC / f"{name}.py").read_text()
        assert len(text.splitlines()) < 10 and 'if __name__ == "__main__":' in text, name
    for path in [*SRC.rglob("*.py"), *(ROOT / "stages").glob("*.py")]:
        for module, line in _imports(path):
            assert module.split(".")[0] not in entries, f"{path.relative_to(ROOT)}:{line} imports ddpipe.{module}"


def test_every_module_name_is_used_once() -> None:
    """One word, one thing: no two modules under src/ddpipe share a file name (__init__ and __main__ apart)."""
    names = [p.name for p in SRC.rglob("*.py") if p.name not in ("__init__.py", "__main__.py")]
    assert sorted(n for n in set(names) if names.count(n) > 1) == []


def test_files_and_classes_stay_readable() -> None:
    long_files, long_classes = {}, {}
    for path in SRC.rglob("*.py"):
        text = path.read_text()
        if len(text.splitlines()) > 400:
            long_files[path.relative_to(SRC).as_posix()] = len(text.splitlines())
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > 200:
                long_classes[f"{path.relative_to(SRC)}:{node.name}"] = node.end_lineno - node.lineno + 1
    assert (long_files, long_classes) == ({}, {})


def _numbers_in_code(value: float) -> list[str]:
    """Where src/'s code (not its docstrings or comments) writes the number ``value``."""
    found = []
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and type(node.value) in (int, float) and node.value == value:
                found.append(f"{path.relative_to(SRC)}:{node.lineno}")
    return found


def test_each_rules_number_is_written_once() -> None:
    """The evaluation crop of ImageNet's recipe, the exit code that says "resume" and the rendezvous port: one
    named constant each, which everything else imports."""
    for value in (0.875, 75, 29400):
        assert len(_numbers_in_code(value)) == 1, (value, _numbers_in_code(value))


def test_each_environment_variable_is_named_once() -> None:
    """The DDPIPE_* variables ddpipe passes to the processes it starts: each name a constant of
    ddpipe.core.environment, which the setter and the reader both import (a string elsewhere is a second spelling)."""
    home = SRC / "core" / "environment.py"
    found = [f"{path.relative_to(ROOT)}:{node.lineno}" for path in SRC.rglob("*.py") if path != home
             for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("DDPIPE_")]
    assert found == []
    named = [n.value for n in ast.walk(ast.parse(home.read_text())) if isinstance(n, ast.Constant)
             and isinstance(n.value, str) and n.value.startswith("DDPIPE_")]
    assert len(named) == len(set(named)) >= 8


def test_the_test_metrics_are_named_once() -> None:
    """test_accuracy and its kin: logged by the evaluate stage, tagged on model versions and compared by the champion
    gate, averaged by the sweeps; one constant each in ddpipe.core.metric_names, never a bare string elsewhere."""
    from ddpipe.core import metric_names

    names = {v for k, v in vars(metric_names).items() if k.isupper()}
    home = SRC / "core" / "metric_names.py"
    found = [f"{path.relative_to(ROOT)}:{node.lineno}" for path in SRC.rglob("*.py") if path != home
             for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names]
    assert found == [] and names >= {"test_accuracy", "test_split"}


def _fenced_lines(text: str) -> list[tuple[int, str]]:
    """The lines inside the ``` code blocks of a markdown text, with their line numbers (from 1)."""
    inside, found = False, []
    for number, line in enumerate(text.splitlines(), start=1):
        if line.lstrip().startswith("```"):
            inside = not inside
        elif inside:
            found.append((number, line))
    return found


def test_the_readme_is_a_newcomers_page() -> None:
    """README.md is read in five minutes: under 300 lines, every reference page of docs/ linked from it, and the two
    command lines a newcomer looks for first (training on their own folders, training on several nodes) in code
    blocks within its first 120 lines."""
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) < 300, len(text.splitlines())
    pages = sorted(p.name for p in (ROOT / "docs").glob("*.md"))
    assert pages, "docs/ holds the reference pages"
    assert [p for p in pages if f"](docs/{p}" not in text] == []
    early = [line for number, line in _fenced_lines(text) if number <= 120]
    for command in ("data.dataset=imagefolder", "distributed.nnodes="):
        assert any(command in line for line in early), f"no command line with {command} in README's first 120 lines"
