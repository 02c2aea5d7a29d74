"""The environment's lock (uv.lock beside pyproject.toml, ``make lock``): every package at an exact version, with its
hashes. The venv, the image and a logged model's requirements are installed from it; each run records its digest and
whether the Python it ran in holds the lock's versions (``ddpipe.env_lock``, ``ddpipe.env_matches_lock``), and every
DVC stage depends on it, so a changed environment shows in ``dvc status`` instead of passing silently."""

from __future__ import annotations

import hashlib
import re
import sys
from pathlib import Path

LOCK_FILE = "uv.lock"

# A package of the lock as uv writes it: its table's first two keys (read so, not by tomllib: a tenth of the time, and
# every training's rank 0 reads it; tests/test_environment.py holds it equal to tomllib's reading)
_LOCKED = re.compile(r'^\[\[package\]\]\nname = "([^"]+)"\nversion = "([^"]+)"$', re.MULTILINE)
# An installed distribution's metadata folder: {name}-{version}.dist-info (the wheel format's own naming)
_DIST_INFO = re.compile(r"^(?P<name>[^-]+)-(?P<version>[^-]+)\.dist-info$")


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


def differences(lock: Path) -> list[str]:
    """``name installed (lock: version)`` for each installed distribution the lock pins at another version (a local
    build's ``+cpu``/``+cu128`` suffix aside); packages the lock does not name (pip, uv itself) are not judged."""
    locked = locked_versions(lock)
    return [f"{name} {version} (lock: {', '.join(sorted(locked[name]))})"
            for name, version in sorted(installed_versions().items())
            if name in locked and version.split("+")[0] not in locked[name]]


def environment_tags(start: str | Path | None = None) -> dict[str, str]:
    """A run's record of its environment: the lock's digest and whether this Python holds it (else what differs)."""
    lock = find_lock(start)
    if lock is None:
        return {"ddpipe.env_lock": "none"}
    differ = differences(lock)
    return {"ddpipe.env_lock": lock_digest(lock),
            "ddpipe.env_matches_lock": "true" if not differ else f"false: {'; '.join(differ)}"[:4900]}
