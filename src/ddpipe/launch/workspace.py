"""An experiment's workspace of its own: a git clone of the user's repository at the experiment's baseline commit,
with the experiment's changes (a commit whose tree holds them: DVC's stash commit of a queued experiment, or ``git
stash create`` of the user's working tree) in its working tree, DVC's cache shared with the user's.

``dvc exp run --name NAME`` there runs with its own repository lock, its own ``params.yaml`` and its own DVC stash:
nothing it does can be taken by, or take, another experiment running beside it (``dvc exp run --temp`` runs share
one stash in the user's repository, and a run takes whichever entry is first in it). Its experiment ref then goes
back to the user's repository (:func:`send_back`); its outputs are in the shared cache already.

Used by a cluster job (:mod:`ddpipe.launch.cluster.job`) and by the search's trials on this host.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

# Runs a command in a directory; returns its exit code, and raises when ``check`` and it failed
Shell = Callable[..., int]
# A dvc.yaml template, ``${paths.model}``: a key of params.yaml
TEMPLATE = re.compile(r"\$\{([\w.]+)\}")
# The commit that ``git stash create`` writes needs a name: the user's git may have none configured
ANONYMOUS = ["-c", "user.name=ddpipe", "-c", "user.email=ddpipe@localhost"]


def quiet_shell(cmd: list[str], cwd: Path, env: dict | None = None, check: bool = True) -> int:
    """A :data:`Shell` that prints nothing; a failure raises with the command's stderr."""
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {done.returncode} in {cwd}: {done.stderr.strip()[-500:]}")
    return done.returncode


def working_tree(repo: Path) -> tuple[str, str]:
    """``repo``'s HEAD commit and, when its tracked files (or its index) differ from HEAD, a commit holding them
    (``git stash create``: nothing of ``repo`` changes, no stash entry is made); else ``""``. Untracked files are not
    in it, as they are not in ``dvc exp run --temp`` or ``--queue``."""
    said = [subprocess.run(["git", *ANONYMOUS, *args], cwd=repo, capture_output=True, text=True, check=True).stdout
            for args in (["rev-parse", "HEAD"], ["stash", "create"])]
    return said[0].strip(), said[1].strip()


def has_commit(repo: Path, rev: str) -> bool:
    return subprocess.run(["git", "cat-file", "-e", f"{rev}^{{commit}}"], cwd=repo, capture_output=True).returncode == 0


def make(ws: Path, source: str, baseline: str, changes: str = "", fetch: str = "", cache: str = "",
         sh: Shell = quiet_shell) -> None:
    """The workspace at ``ws`` (made whole or not at all: in ``ws.partial`` first): ``source`` cloned (``--shared``
    when it is a directory: its objects are not copied), ``fetch`` (a ref) fetched from it, ``baseline`` checked out,
    ``changes``' tree in the working tree with the index back at ``baseline`` (DVC sees them as the workspace's
    changes, as in the repository they come from); ``cache``: the DVC cache directory to share (outputs linked, not
    copied)."""
    partial = ws.with_name(ws.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.parent.mkdir(parents=True, exist_ok=True)
    shared = ["--shared"] if Path(source).is_dir() else []
    sh(["git", "clone", "--quiet", "--no-checkout", *shared, source, str(partial)], cwd=partial.parent)
    if fetch:
        sh(["git", "fetch", "--quiet", source, f"+{fetch}:{fetch}"], cwd=partial)
    sh(["git", "checkout", "--quiet", "--detach", baseline], cwd=partial)
    if changes:
        sh(["git", "read-tree", "--reset", "-u", changes], cwd=partial)
        sh(["git", "reset", "--quiet"], cwd=partial)
    if cache:
        sh(["dvc", "cache", "dir", "--local", cache], cwd=partial)
        sh(["dvc", "config", "--local", "cache.type", "hardlink,symlink,copy"], cwd=partial)
    partial.rename(ws)


def _pipeline(repo: Path) -> dict[str, dict]:
    """``repo``'s dvc.yaml stages, each ``deps``/``outs``/``metrics``/``plots`` list as a set of paths with DVC's
    ``${key}`` templates resolved from params.yaml (an entry is a path, or ``{path: options}``)."""
    import yaml

    params = yaml.safe_load((repo / "params.yaml").read_text()) if (repo / "params.yaml").is_file() else {}

    def value(match: re.Match) -> str:
        found: Any = params
        for part in match[1].split("."):
            found = found.get(part) if isinstance(found, dict) else None
        return match[0] if found is None else str(found)

    def paths(entries: list | None) -> set[str]:
        return {TEMPLATE.sub(value, e if isinstance(e, str) else next(iter(e))) for e in entries or []}

    return {name: {key: paths(st.get(key)) for key in ("deps", "outs", "metrics", "plots")}
            for name, st in yaml.safe_load((repo / "dvc.yaml").read_text())["stages"].items()}


def drop_downstream(ws: Path, stage: str) -> list[str]:
    """Remove from ``ws``'s dvc.lock the entries of the stages downstream of ``stage`` (those that read what it
    writes, directly or through another), which an experiment of ``stage`` alone never runs; their names. Carried from
    the baseline, those entries would name outputs the experiment did not make: ``dvc exp apply`` of it would fail
    where the cache lacks the baseline's (a fresh clone), and its record would show the baseline's figures as its own.
    Without them, ``dvc repro`` after the apply runs those stages on what the experiment made."""
    import yaml

    pipeline, lock_file = _pipeline(ws), ws / "dvc.lock"
    if not lock_file.is_file() or stage not in pipeline:
        return []

    def writes(st: dict) -> set[str]:
        return st["outs"] | st["metrics"] | st["plots"]

    made, downstream = writes(pipeline[stage]), []
    while more := [name for name, st in pipeline.items() if name != stage and name not in downstream and any(
            dep == out or dep.startswith(out.rstrip("/") + "/") for dep in st["deps"] for out in made)]:
        downstream += more
        made |= set().union(*(writes(pipeline[name]) for name in more))
    lock = yaml.safe_load(lock_file.read_text())
    if any(name in lock.get("stages", {}) for name in downstream):
        lock["stages"] = {k: v for k, v in lock["stages"].items() if k not in downstream}
        lock_file.write_text(yaml.safe_dump(lock, sort_keys=False))
    return downstream


def hold_out(ws: Path, paths: Sequence[str], note_file: str = "", name: str = "") -> None:
    """Take out of the experiment made in ``ws`` the files git tracks of the stages it never runs (``paths``, the
    evaluate and export stages' figures: the baseline's, which its row would show as its own), and write ``note_file``
    (one of them, the test metrics) with the one figure its row in ``dvc exp show`` then lists, ``apply``: how to
    apply experiment ``name``. ``dvc exp apply`` of it puts its params and the trained model in place, then exits 255
    on the export's cached outputs, which its dvc.lock has no entry for (:func:`drop_downstream`): DVC counts such an
    output as missing and fails the checkout (treeverse/dvc#5913), and ``dvc exp apply`` has no ``--allow-missing``
    (``dvc checkout`` has since treeverse/dvc#9919). ``dvc repro`` after it makes them."""
    if paths:
        quiet_shell(["git", "rm", "-r", "-q", "--ignore-unmatch", "--", *paths], cwd=ws)
    if note_file:
        how = f"dvc exp apply {name} (exits 255: evaluate and export never ran); dvc repro"
        (ws / note_file).parent.mkdir(parents=True, exist_ok=True)
        (ws / note_file).write_text(json.dumps({"test": {"apply": how}}, indent=2) + "\n")
        quiet_shell(["git", "add", "--", note_file], cwd=ws)


def unrun_outputs(repo: Path) -> set[str]:
    """The outputs of ``repo``'s stages that its dvc.lock has no entry for (never run in this commit: what an
    experiment of one stage leaves out, :func:`drop_downstream`), which ``dvc checkout`` cannot create."""
    import yaml

    lock_file = repo / "dvc.lock"
    locked = yaml.safe_load(lock_file.read_text()).get("stages", {}) if lock_file.is_file() else {}
    return set().union(*(st["outs"] for name, st in _pipeline(repo).items() if name not in locked))


def cache_dir(repo: Path) -> str:
    """The DVC cache directory of ``repo`` (as its config says, else ``.dvc/cache``)."""
    said = subprocess.run(["dvc", "cache", "dir"], cwd=repo, capture_output=True, text=True).stdout.strip()
    return said or str(repo / ".dvc" / "cache")


def send_back(ws: Path, repo: str, ref: str, sh: Shell = quiet_shell) -> bool:
    """Experiment ref ``ref`` of the workspace into ``repo`` (its outputs are in the shared cache); False when git
    refused."""
    return sh(["git", "push", "--quiet", repo, f"+{ref}:{ref}"], cwd=ws, check=False) == 0
