"""Every assertion kept (issue 72): the tests and checks of two commits, side by side, each difference with its reason.

    python bench/suite_census.py f75d7ee HEAD          # the suite of f75d7ee against this one's
    python bench/suite_census.py f75d7ee HEAD --list   # and every added test id

For each commit, in a detached worktree of this repository: the test ids pytest collects there (``--collect-only``,
every marker, with this venv) and, from the tests' source, the checks of each test function and helper (``assert``
statements, ``pytest.raises`` and ``pytest.warns``). Then what differs:

- a test id only in the older commit: removed, merged or renamed. Its reason must be in ``bench/suite_census.txt``
  (``<id or file::function>: <reason>``), or the census fails (exit 1);
- a test function with fewer checks in the newer commit: the same; a helper (a function not named ``test_*``, in the
  tests or conftest) with fewer checks likewise;
- a test id only in the newer commit: added, with the commit that added its function (``git log -S``).

Prints the totals of both, each difference and its reason; appends them to ``bench/results/suite_census.jsonl``.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from common import REPO, append_jsonl

REASONS = REPO / "bench" / "suite_census.txt"
CHECK_CALLS = ("raises", "warns")  # pytest.raises / pytest.warns count as checks


@dataclass
class Suite:
    """What one commit's suite holds: its collected test ids and the checks of each function of its tests."""

    commit: str
    ids: list[str]
    checks: dict[str, int] = field(default_factory=dict)  # "tests/test_x.py::function" -> its checks

    def tests(self) -> dict[str, int]:
        return {name: n for name, n in self.checks.items() if name.split("::")[-1].startswith("test")}

    def helpers(self) -> dict[str, int]:
        return {name: n for name, n in self.checks.items() if not name.split("::")[-1].startswith("test")}


def git(*args: str, cwd: Path = REPO) -> str:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True).stdout.strip()


@contextlib.contextmanager
def worktree(commit: str) -> Iterator[Path]:
    """``commit``'s files in a detached worktree, removed on leaving."""
    with tempfile.TemporaryDirectory(prefix="census-") as tmp:
        tree = Path(tmp) / "tree"
        git("worktree", "add", "--detach", "-q", str(tree), commit)
        try:
            yield tree
        finally:
            git("worktree", "remove", "--force", str(tree))


def collected(tree: Path) -> list[str]:
    """The test ids pytest collects in ``tree``, every marker included, its own ``src`` imported."""
    env = {**os.environ, "PYTHONPATH": f"{tree / 'src'}{os.pathsep}{tree}"}
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m", "",
                          "-n", "0", "tests"], cwd=tree, env=env, capture_output=True, text=True)
    ids = [line for line in out.stdout.splitlines() if line.startswith("tests/") and "::" in line]
    if out.returncode != 0 or not ids:
        raise SystemExit(f"pytest --collect-only failed in {tree} (exit {out.returncode}):\n{out.stdout[-3000:]}"
                         f"{out.stderr[-3000:]}")
    return ids


def checks_of(tree: Path) -> dict[str, int]:
    """Each function of ``tree``'s tests (``file::function``, ``file::Class::method``): its checks."""
    found: dict[str, int] = {}
    for path in sorted((tree / "tests").glob("**/*.py")):
        rel = path.relative_to(tree).as_posix()
        module = ast.parse(path.read_text(), filename=rel)
        for node, owner in _functions(module):
            found[f"{rel}::{owner}{node.name}"] = sum(_is_check(n) for n in ast.walk(node))
    return found


def _functions(module: ast.Module) -> Iterator[tuple[ast.FunctionDef | ast.AsyncFunctionDef, str]]:
    for node in module.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node, ""
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    yield item, f"{node.name}::"


def _is_check(node: ast.AST) -> bool:
    if isinstance(node, ast.Assert):
        return True
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in CHECK_CALLS \
        and isinstance(node.func.value, ast.Name) and node.func.value.id == "pytest"


def suite(commit: str) -> Suite:
    sha = git("rev-parse", "--short", commit)
    with worktree(sha) as tree:
        return Suite(sha, collected(tree), checks_of(tree))


def function_of(test_id: str) -> str:
    """``tests/x.py::test_f[param]`` -> ``tests/x.py::test_f``."""
    return re.sub(r"\[.*\]$", "", test_id)


def reasons() -> dict[str, str]:
    """``bench/suite_census.txt``: ``<test id or file::function>: <reason>`` per line; # starts a comment."""
    if not REASONS.is_file():
        return {}
    found = {}
    for line in REASONS.read_text().splitlines():
        line = line.split(" #", 1)[0].strip()
        if line and not line.startswith("#"):
            key, _, why = line.partition(": ")
            found[key.strip()] = why.strip()
    return found


def added_by(name: str, old: str, new: str) -> str:
    """The commit (``old..new``) that added the function ``file::function``: its short hash and subject."""
    path, func = name.split("::")[0], name.split("::")[-1]
    log = git("log", "--reverse", "--format=%h %s", "-S", f"def {func}(", f"{old}..{new}", "--", path)
    first = log.splitlines()[0] if log else "not found by git log -S"
    return first[:110]


def compare(old: Suite, new: Suite, why: dict[str, str], list_added: bool) -> int:
    """Print the census; the count of differences with no reason."""
    unexplained = 0

    def say(kind: str, key: str, detail: str, function: str | None = None) -> None:
        nonlocal unexplained
        reason = why.get(key) or (why.get(function) if function else None)
        if reason is None:
            unexplained += 1
        print(f"  {kind}: {key} ({detail}): {reason or 'NO REASON GIVEN'}")

    for s in (old, new):
        tests, helpers = s.tests(), s.helpers()
        print(f"{s.commit}: {len(s.ids)} test ids, {len(tests)} test functions with {sum(tests.values())} checks, "
              f"{len(helpers)} helpers with {sum(helpers.values())} checks")
    old_ids, new_ids = set(old.ids), set(new.ids)
    removed, added = sorted(old_ids - new_ids), sorted(new_ids - old_ids)
    print(f"test ids: {len(removed)} only in {old.commit}, {len(added)} only in {new.commit}")
    for test_id in removed:
        say("removed", test_id, "collected in the older commit only", function_of(test_id))
    for kind, mine, theirs in (("test", old.tests(), new.tests()), ("helper", old.helpers(), new.helpers())):
        for name, n in sorted(mine.items()):
            if name in theirs and theirs[name] < n:
                say(f"fewer checks in a {kind}", name, f"{n} -> {theirs[name]}")
            elif name not in theirs and kind == "helper" and n:
                say("helper gone", name, f"{n} checks")
    added_functions = sorted({function_of(i) for i in added} - set(old.tests()))
    print(f"added test functions: {len(added_functions)} (the commit that added each: git log -S)")
    if list_added:
        for name in added_functions:
            print(f"  added: {name}: {added_by(name, old.commit, new.commit)}")
    return unexplained


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("old", help="the older commit (e.g. f75d7ee)")
    parser.add_argument("new", nargs="?", default="HEAD", help="the newer commit (default: HEAD)")
    parser.add_argument("--list", action="store_true", help="list every added test function and its commit")
    args = parser.parse_args(argv)
    old, new = suite(args.old), suite(args.new)
    unexplained = compare(old, new, reasons(), args.list)
    append_jsonl("suite_census", [{"old": old.commit, "new": new.commit, "old_ids": len(old.ids),
                                         "new_ids": len(new.ids), "old_checks": sum(old.checks.values()),
                                         "new_checks": sum(new.checks.values()), "unexplained": unexplained}])
    if unexplained:
        print(f"{unexplained} difference(s) without a reason: give each in {REASONS.relative_to(REPO)}")
        return 1
    print("every difference has its reason")
    return 0


if __name__ == "__main__":
    sys.exit(main())
