"""dvc.yaml against the code: each stage lists exactly the library modules it runs, so an edit to
shared code re-runs the stages that use it and no other."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import yaml

from tests.conftest import ROOT

SRC = ROOT / "src" / "ddpipe"


def _imported_modules(path: Path) -> set[str]:
    """The ddpipe modules ``path`` imports (at any depth in the file, lazily or not)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "ddpipe":
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "ddpipe" and len(parts) > 1 and (SRC / f"{parts[1]}.py").is_file():
                found.add(parts[1])
    return found


def _closure(entry: Path) -> set[str]:
    seen: set[str] = set()
    todo = list(_imported_modules(entry))
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo += _imported_modules(SRC / f"{module}.py")
    return seen


@pytest.mark.parametrize("stage", ["fetch", "prepare", "train", "evaluate"])
def test_each_stage_depends_on_exactly_the_library_modules_it_imports(stage: str) -> None:
    spec = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"][stage]
    cmd = " ".join(spec["cmd"].split())
    entry = ROOT / "stages" / f"{stage}.py"
    modules = _closure(entry) | ({"launch"} | _closure(SRC / "launch.py") if "ddpipe.launch" in cmd else set())
    listed = {d for d in spec["deps"] if d.startswith("src/ddpipe/")}
    assert listed == {f"src/ddpipe/{m}.py" for m in modules}
    assert f"stages/{stage}.py" in spec["deps"]


def test_imports_only_point_down_the_readme_map() -> None:
    """README's map lists src/ddpipe's modules from the entry points down to the ground floor; a module
    may import only modules listed below it (so evaluation never reaches into training, models never
    into the process group)."""
    readme = (ROOT / "README.md").read_text()
    block = readme[readme.index("src/ddpipe/ "):readme.index("\ntests/ ")]
    order = [line.split()[0][:-3] for line in block.splitlines()[1:] if line.startswith("  ") and
             line.split()[0].endswith(".py")]
    assert sorted(order) == sorted(p.stem for p in SRC.glob("*.py") if p.stem != "__init__")
    for i, module in enumerate(order):
        above = set(order[:i + 1])
        assert not _imported_modules(SRC / f"{module}.py") & above, f"{module} imports a module listed above it"
