"""dvc.yaml against the code: each stage lists exactly the library modules it runs, so an edit to
shared code re-runs the stages that use it and no other."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import yaml

from tests.conftest import ROOT

SRC = ROOT / "src" / "ddpipe"


def _module_file(module: str) -> Path | None:
    """``data.loading`` -> src/ddpipe/data/loaders.py; ``data`` -> src/ddpipe/data/__init__.py."""
    base = SRC.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _imported_modules(path: Path) -> set[str]:
    """The ddpipe modules ``path`` imports (at any depth in the file, lazily or not), as dotted names below
    ``ddpipe``; importing a module of a package imports the package's ``__init__`` too."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "ddpipe":
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] != "ddpipe":
                continue
            for n in range(2, len(parts) + 1):
                module = ".".join(parts[1:n])
                if _module_file(module) is not None:
                    found.add(module)
    return found


def _closure(entry: Path) -> set[str]:
    seen: set[str] = set()
    todo = list(_imported_modules(entry))
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo += _imported_modules(_module_file(module))
    return seen


def _dep(module: str) -> str:
    return _module_file(module).relative_to(ROOT).as_posix()


def _all_modules() -> list[str]:
    """Every module of src/ddpipe below the package itself, dotted (``data`` for data/__init__.py)."""
    names = []
    for p in SRC.rglob("*.py"):
        rel = p.relative_to(SRC).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        if parts:
            names.append(".".join(parts))
    return names


@pytest.mark.parametrize("stage", ["fetch", "prepare", "train", "evaluate", "export"])
def test_each_stage_depends_on_exactly_the_library_modules_it_imports(stage: str) -> None:
    spec = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"][stage]
    cmd = " ".join(spec["cmd"].split())
    assert cmd == f"python stages/{stage}.py"
    scripts = [ROOT / "stages" / f"{stage}.py"]
    modules = _closure(scripts[0])
    if stage == "train":  # the stage's launcher runs torchrun over the worker module, whose imports count too
        from ddpipe.launch.torchrun import WORKER_MODULE

        worker = WORKER_MODULE.partition(".")[2]
        modules |= {worker} | _closure(_module_file(worker))
    listed = {d for d in spec["deps"] if d.startswith("src/ddpipe/")}
    assert listed == {_dep(m) for m in modules}
    assert {s.relative_to(ROOT).as_posix() for s in scripts} <= set(spec["deps"])
    assert "uv.lock" in spec["deps"]  # the environment it ran in: a changed lock runs it again


# ---------------------------------------------------------------------------------------------
# The code's shape (README's map): what a newcomer relies on finding where it is said to be

def test_classes_stay_small_and_the_trainer_smaller() -> None:
    sizes = {}
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                sizes[f"{path.relative_to(SRC)}:{node.name}"] = node.end_lineno - node.lineno + 1
    assert {name: n for name, n in sizes.items() if n > 200} == {}
    assert sizes["engine/loop.py:Trainer"] <= 170


def test_files_stay_small() -> None:
    lengths = {path.relative_to(SRC).as_posix(): len(path.read_text().splitlines()) for path in SRC.rglob("*.py")}
    assert {name: n for name, n in lengths.items() if n > 400} == {}


def test_auto_is_resolved_in_the_resolver_only() -> None:
    """No module but the resolver (ddpipe.engine.resolved, and ddpipe.data.encoding for the prepare stage's own
    format) compares a value with the word ``auto``: the run is resolved once, typed, and everything else reads what
    it became."""
    def says_auto(node: ast.AST) -> bool:  # "auto", or a tuple, list or set holding it (x in ("auto", ...))
        items = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
        return any(isinstance(c, ast.Constant) and c.value == "auto" for c in items)

    found = []
    for path in [*SRC.rglob("*.py"), *(ROOT / "stages").glob("*.py"), *(ROOT / "bench").glob("*.py")]:
        if path in (SRC / "engine" / "resolved.py", SRC / "data" / "encoding.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare) and any(says_auto(c) for c in [node.left, *node.comparators]):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert found == []


def test_train_takes_the_resolved_run_alone() -> None:
    (train,) = [n for n in ast.parse((SRC / "engine" / "loop.py").read_text()).body
                if isinstance(n, ast.FunctionDef) and n.name == "train"]
    assert [a.arg for a in train.args.args] == ["run"] and not train.args.kwonlyargs


def test_the_evaluation_and_the_served_model_import_nothing_of_the_process_group() -> None:
    """The evaluate stage (and the pyfunc model, which ships models/served.py) runs in one process: editing how ranks
    sum or stop must not re-run it, and the served model carries nothing of the run store either."""
    collectives = {"distributed.group", "distributed.host_sums", "distributed.preemption"}
    assert not _closure(ROOT / "stages" / "evaluate.py") & collectives
    assert not {m.split(".")[0] for m in _closure(SRC / "models" / "served.py")} & {"distributed", "tracking"}


def test_the_tracker_records_a_run_and_writes_no_output_of_the_train_stage() -> None:
    text = (SRC / "tracking" / "tracker.py").read_text()  # its length: every module's bound (test_layout)
    for key in ("paths.model", "paths.train_metrics", "paths.history", "paths.run_info", "save_model"):
        assert key not in text, key


def test_collectives_are_called_only_by_distributed_and_its_transport() -> None:
    """torch.distributed's collectives (and its import) appear in distributed/group.py and distributed/host_sums.py
    only; everything else sums, broadcasts and waits through ddpipe.distributed.group."""
    allowed = {SRC / "distributed" / "group.py", SRC / "distributed" / "host_sums.py"}
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            if any(n == "torch.distributed" or n.startswith("torch.distributed.") and not n.startswith(
                    ("torch.distributed.run", "torch.distributed.elastic")) for n in names):
                assert path in allowed, f"{path.relative_to(SRC)} imports torch.distributed"


def test_importing_any_module_sets_no_environment_variable() -> None:
    """Settings a module needs are applied where they are used (e.g. MLflow's HTTP bounds when a tracker is
    made), never as a side effect of an import."""
    import subprocess
    import sys

    modules = sorted({".".join(p.relative_to(SRC).with_suffix("").parts).removesuffix(".__init__")
                      for p in SRC.rglob("*.py")} - {"__init__", ""})
    code = ("import os, importlib, json, mlflow, mlflow.pyfunc, torch, torchvision\n"  # what they set themselves
            "before = dict(os.environ)\n"
            f"for m in {modules!r}: importlib.import_module('ddpipe.' + m)\n"
            "print(json.dumps(sorted(k for k in os.environ if os.environ.get(k) != before.get(k))))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert yaml.safe_load(out.stdout.strip().splitlines()[-1]) == []


def test_the_docs_speak_of_what_the_code_does_not_of_issue_numbers() -> None:
    import re

    pages = sorted((ROOT / "docs").glob("*.md"))
    assert pages, "docs/ holds the reference pages the README links to"
    for doc in (ROOT / "README.md", ROOT / "BENCHMARKS.md", *pages):
        found = re.findall(r"\bissues? #?\d+", doc.read_text(), flags=re.IGNORECASE)
        assert found == [], f"{doc.relative_to(ROOT)}: {found}"
