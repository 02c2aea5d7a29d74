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
    assert f"${{paths.stage_env}}/{stage}.txt" in spec["deps"]  # the locked packages it runs with (test_stage_env.py)


def test_dvc_plots_show_draws_each_declared_plot_once(tmp_path: Path) -> None:
    """The loss and accuracy curves, the confusion matrix, the per-class bars and the evaluation's images, each once:
    the curves' file is an output of the train stage, not a plot there too (DVC would draw it again as a default plot
    of the raw file); the evaluate stage's plots carry their own templates (a file of a plot there keeps the stage's
    run cache: DVC saves none for a stage with an uncached output that is neither a metric nor a plot)."""
    import shutil
    import subprocess

    from ddpipe.config.load import load_config
    from tests.conftest import run

    paths = load_config([], params_file=ROOT / "params.yaml").paths
    for name in ("dvc.yaml", "params.yaml", paths.history, paths.confusion, paths.per_class):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, tmp_path / name)
    images = subprocess.run(["git", "ls-files", paths.reports], cwd=ROOT, capture_output=True, text=True).stdout.split()
    assert images, f"{paths.reports}: the evaluate stage's images, tracked by git"
    shutil.copytree(ROOT / paths.reports, tmp_path / paths.reports)
    for cmd in (["git", "init", "-q"], ["dvc", "init", "-q"]):
        run(cmd, cwd=tmp_path)
    shown = yaml.safe_load(run(["dvc", "plots", "show", "--json"], cwd=tmp_path).stdout)["data"]
    assert {name: [p["type"] for p in plots] for name, plots in shown.items()} == {
        "loss": ["vega"], "accuracy": ["vega"], paths.confusion: ["vega"], paths.per_class: ["vega"],
        **{image: ["image"] for image in images}}
    matrix = shown[paths.confusion][0]["content"]["spec"]
    assert (matrix["encoding"]["x"]["field"], matrix["encoding"]["y"]["field"]) == ("actual", "predicted")
    assert {layer.get("mark") for layer in matrix["layer"]} >= {"rect"}
    evaluate = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]["evaluate"]  # its run cache kept: a trial
    assert not [o for o in evaluate.get("outs", []) if isinstance(o, dict)  # applied again is not evaluated again
                and next(iter(o.values())).get("cache") is False]


@pytest.mark.slow
def test_two_runs_of_one_config_differ_in_no_dvc_metric_but_the_training_time(repro_clone: Path) -> None:
    """The same training again (seeded, CPU, one thread; from no checkpoint), evaluated and exported with its
    latencies timed: `dvc exp show --only-changed` shows no metric but train_seconds, since the latencies, the threads
    and the host's load went to paths.export_host, which DVC does not read as a metric."""
    import json
    import shutil

    from tests.conftest import CLONE_ENV, run

    shutil.rmtree(repro_clone / "checkpoints", ignore_errors=True)  # a training from scratch, not a resumed one
    run(["dvc", "exp", "run", "-n", "again", "--force", "--downstream", "train", "-S", "export.latency_runs=3"],
        cwd=repro_clone, env=CLONE_ENV, timeout=900)
    host = json.loads((repro_clone / "metrics" / "export_host.json").read_text())["export"]
    assert host["onnx"]["latency_ms"] and "latency_host" in host  # timed this time, and kept apart
    rows = json.loads(run(["dvc", "exp", "show", "--json"], cwd=repro_clone, env=CLONE_ENV).stdout)

    def leaves(tree: dict, prefix: str = "") -> set[str]:
        return set().union(*(leaves(v, f"{prefix}{k}.") if isinstance(v, dict) else {prefix + k}
                             for k, v in tree.items()))

    metrics = set().union(*(leaves(f.get("data", {})) for row in [*rows, *(r for b in rows for e in
                            b.get("experiments") or [] for r in e["revs"])] for f in row["data"]["metrics"].values()))
    changed = run(["dvc", "exp", "show", "--only-changed", "--csv"], cwd=repro_clone, env=CLONE_ENV).stdout
    assert set(changed.splitlines()[0].split(",")) & metrics == {"train.train_seconds"}, changed


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
