"""The environment's lock (uv.lock beside pyproject.toml, ``make lock``): every package at an exact version, with its
hashes. The venv, the image and a logged model's requirements are installed from it; each run records its digest and
whether the Python it ran in holds the lock's versions (``ddpipe.env_lock``, ``ddpipe.env_matches_lock``), and each
DVC stage depends on the locked packages it runs with (``ddpipe.config.stage_env`` writes them from this lock's
:func:`dependency_graph`), so a changed environment shows in ``dvc status`` instead of passing silently.

A Python holds the lock when every package of the set its venv was made from is installed, each at its locked version
(:func:`differences`). Two sets, both computed from the lock (:func:`locked_sets`): the runtime set, which ``make
repro``'s venv and the image hold (``uv sync``: the root project's dependencies and theirs, transitively), and the dev
set, which ``make test``'s holds (``uv sync --extra dev``: the runtime set and the ``dev`` extra's closure), each where
its environment markers hold on this Python. Which one a venv was made from is read from the venv itself, not from the
Makefile's markers (``.venv/.installed``, ``.installed-runtime``: the image and a hand-made venv have none): the dev
set where any package that only the dev extra brings (pytest, ruff, ...) is installed, else the runtime set. So a
runtime venv is not faulted for lacking pytest, and a dev venv is for lacking anything of either set. The root
project (ddpipe) is not judged: it is the code that runs, recorded by its commit. Dependency groups
(``[dependency-groups]``, which ``uv sync`` would add) are not read: the project has none.
"""

from __future__ import annotations

import functools
import hashlib
import re
import sys
from pathlib import Path

LOCK_FILE = "uv.lock"
DEV_EXTRA = "dev"  # the extra `make test`'s venv adds (`uv sync --extra dev`)

# A package of the lock as uv writes it: its table's first two keys (read so, not by tomllib: a tenth of the time, and
# every training's rank 0 reads it; tests/test_environment.py holds it equal to tomllib's reading)
_LOCKED = re.compile(r'^\[\[package\]\]\nname = "([^"]+)"\nversion = "([^"]+)"$', re.MULTILINE)
# The lines of a package's table that say what it depends on, as uv writes them (read so for the same reason, and held
# equal to tomllib's reading the same way): an array opened on a line of its own, one inline table a line in it
_ARRAY = re.compile(r"^([\w.-]+) = \[$")
_FIELD = re.compile(r'(\w+) = (?:"([^"]*)"|\[([^\]]*)\])')
_PROJECT = re.compile(r'^source = \{ (?:editable|virtual) = "\." \}$')  # the root project's source: this folder
# An installed distribution's metadata folder: {name}-{version}.dist-info (the wheel format's own naming)
_DIST_INFO = re.compile(r"^(?P<name>[^-]+)-(?P<version>[^-]+)\.dist-info$")

# A dependency: the package (canonical name), the extras it asks of it, the environment marker it holds under ("")
Dependency = tuple[str, tuple[str, ...], str]


def find_lock(start: str | Path | None = None) -> Path | None:
    """The nearest :data:`LOCK_FILE` from ``start`` (default: cwd) upwards, or None."""
    here = Path(start or Path.cwd()).resolve()
    return next((d / LOCK_FILE for d in (here, *here.parents) if (d / LOCK_FILE).is_file()), None)


def lock_digest(lock: Path) -> str:
    """The lock file's sha256."""
    return hashlib.sha256(Path(lock).read_bytes()).hexdigest()


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def locked_versions(lock: Path) -> dict[str, set[str]]:
    """Each package of the lock (canonical name) and its versions (one per set of environment markers)."""
    found: dict[str, set[str]] = {}
    for name, version in _LOCKED.findall(Path(lock).read_text()):
        found.setdefault(_canonical(name), set()).add(version)
    return found


def dependency_graph(lock: Path) -> tuple[str | None, dict[str, dict[str, list[Dependency]]]]:
    """The lock's root project (canonical name; None in a lock without one) and, for each package, what it depends on:
    under "" its dependencies, under an extra's name that extra's (``[package.optional-dependencies]``). A package
    locked at two versions (for two sets of markers) has the dependencies of both."""
    root, graph, package, section, into = None, {}, None, "", None
    for line in Path(lock).read_text().splitlines():
        if into is not None:  # inside an array: its items, to its closing line
            if line.startswith("]"):
                into = None
            elif isinstance(into, list) and (fields := _FIELD.findall(line)):
                into.append(_dependency(fields))
        elif line.startswith("["):
            section = line
            package = None if line == "[[package]]" else package
        elif section == "[[package]]" and package is None and line.startswith("name = "):
            package = _canonical(line.split('"')[1])
            graph.setdefault(package, {})
        elif section == "[[package]]" and _PROJECT.match(line):
            root = package
        elif array := _ARRAY.match(line):
            key = array[1]
            into = True  # an array of something else (wheels, requires-dist, resolution-markers): passed over
            if package is not None and section == "[[package]]" and key == "dependencies":
                into = graph[package].setdefault("", [])
            elif package is not None and section == "[package.optional-dependencies]":
                into = graph[package].setdefault(key, [])
    return root, graph


def _dependency(fields: list[tuple[str, str, str]]) -> Dependency:
    """A dependency from its inline table's ``key = "text"`` / ``key = [...]`` fields."""
    found = {key: (text, items) for key, text, items in fields}
    extras = tuple(re.findall(r'"([^"]*)"', found.get("extra", ("", ""))[1]))
    return _canonical(found["name"][0]), extras, found.get("marker", ("", ""))[0]


@functools.cache
def _holds(marker: str) -> bool:
    """Whether an environment marker holds on this Python (no extra asked); one it cannot read or judge requires
    nothing (a run's record must not fail on it)."""
    if not marker:
        return True
    try:
        from packaging.markers import Marker

        return Marker(marker).evaluate({"extra": ""})
    except Exception:  # packaging's InvalidMarker, UndefinedComparison, ...; ImportError where it is not installed
        return False


def _closure(graph: dict[str, dict[str, list[Dependency]]], roots: list[Dependency]) -> set[str]:
    """The packages ``roots`` bring, with the extras they ask, transitively, where their markers hold here."""
    names, seen, todo = set(), set(), list(roots)
    while todo:
        name, extras, marker = todo.pop()
        if not _holds(marker):
            continue
        names.add(name)
        for extra in ("", *extras):
            if (name, extra) not in seen:
                seen.add((name, extra))
                todo += graph.get(name, {}).get(extra, [])
    return names


def locked_sets(lock: Path) -> tuple[set[str], set[str]]:
    """The runtime set and the dev set of the lock on this Python (see the module doc), the root project left out."""
    root, graph = dependency_graph(lock)
    if root is None:
        return set(), set()
    runtime = _closure(graph, graph[root].get("", []))
    dev = runtime | _closure(graph, graph[root].get(DEV_EXTRA, []))
    return runtime - {root}, dev - {root}


def venv_set(lock: Path, installed: dict[str, str]) -> tuple[str, set[str]]:
    """Which set the venv holding ``installed`` was made from, "dev" or "runtime", and that set (the module doc)."""
    runtime, dev = locked_sets(lock)
    return ("dev", dev) if (dev - runtime) & installed.keys() else ("runtime", runtime)


def installed_versions() -> dict[str, str]:
    """Each distribution installed on this Python's path (canonical name) and its version, from the names of their
    ``.dist-info`` folders (the first on ``sys.path`` wins, as imports do)."""
    found: dict[str, str] = {}
    for entry in sys.path:
        try:
            names = sorted(p.name for p in Path(entry or ".").iterdir() if p.name.endswith(".dist-info"))
        except OSError:
            continue
        for folder in names:
            match = _DIST_INFO.match(folder)
            if match:
                found.setdefault(_canonical(match["name"]), match["version"])
    return found


def differences(lock: Path, installed: dict[str, str] | None = None) -> list[str]:
    """Where this Python (or ``installed``: canonical name -> version) departs from the lock: ``name installed (lock:
    version)`` for each installed distribution the lock pins at another version (a local build's ``+cpu``/``+cu128``
    suffix aside), then ``name missing (lock: version, SET set)`` for each package of the set the venv was made from
    (:func:`venv_set`) that is not installed. Packages the lock does not name (pip, uv itself) are not judged."""
    installed = installed_versions() if installed is None else installed
    locked = locked_versions(lock)
    differ = [f"{name} {version} (lock: {', '.join(sorted(locked[name]))})"
              for name, version in sorted(installed.items())
              if name in locked and version.split("+")[0] not in locked[name]]
    kind, wanted = venv_set(lock, installed)
    return differ + [f"{name} missing (lock: {', '.join(sorted(locked.get(name, ())))}, {kind} set)"
                     for name in sorted(wanted - installed.keys())]


def environment_tags(start: str | Path | None = None, installed: dict[str, str] | None = None) -> dict[str, str]:
    """A run's record of its environment: the lock's digest and whether this Python (or ``installed``, as
    :func:`differences` takes it) holds it, else what differs."""
    lock = find_lock(start)
    if lock is None:
        return {"ddpipe.env_lock": "none"}
    differ = differences(lock, installed)
    return {"ddpipe.env_lock": lock_digest(lock),
            "ddpipe.env_matches_lock": "true" if not differ else f"false: {'; '.join(differ)}"[:4900]}
