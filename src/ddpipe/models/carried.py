"""The ddpipe a logged model carries, under a name of its own: the model always runs the code it was logged with.

A logged MLflow model (``ddpipe.models.served``, ``ddpipe.models.onnx_served``) carries the source of the part of
ddpipe it runs: ``models`` and the layers beneath it (``ddpipe.LAYERS``: a package imports only those). It carries it
as the package ``ddpipe_<digest>`` (:func:`carry`), the first 16 hex digits of the sha256 of those files
(:func:`code_digest`), with every absolute import of ``ddpipe`` in them renamed to it (:func:`renamed_imports`), and
the model's code imports its classes from there (:func:`model_code`). MLflow prepends a model's ``code/`` to
``sys.path`` for the rest of the process, so the copy could never be plain ``ddpipe``: it would shadow an installed
ddpipe for everything that process and the processes it spawns import later (why commit 8819018 reverted b54f132).
Under its own name it shadows nothing, and an installed ddpipe of another version never serves the model in place of
its own code; where ddpipe is not installed at all it serves just the same. The model's metadata records the digest,
the package's name and ddpipe's version (:meth:`Carried.metadata`).
"""

from __future__ import annotations

import ast
import contextlib
import hashlib
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ddpipe import LAYERS, __version__

NAME = "ddpipe"  # the package's name, which the copy's imports are renamed from
ROOT = Path(__file__).resolve().parents[1]  # the package's folder
_FROM = re.compile(rb"from\s+" + NAME.encode() + rb"\b")


@dataclass(frozen=True)
class Carried:
    """A copy of ddpipe's source made for a logged model: the package folder (``code_paths``), its name, the digest
    of the source it was copied from, and ddpipe's version."""

    path: Path
    package: str
    digest: str
    version: str

    def metadata(self) -> dict[str, str]:
        """What the logged model's metadata (its MLmodel file) records of the code it runs."""
        return {"ddpipe_version": self.version, "ddpipe_code_digest": self.digest, "ddpipe_package": self.package}


def carried_files() -> dict[str, bytes]:
    """The files of this ddpipe a served model runs, by path relative to the package (``models/served.py``), their
    bytes: its ``__init__.py``, ``models`` and the packages of the layers beneath it, no byte code."""
    home = Path(__file__).resolve().parent.name
    level = next(i for i, layer in enumerate(LAYERS) if home in layer)
    packages = sorted({name for layer in LAYERS[:level] for name in layer} | {home})
    files = [ROOT / "__init__.py", *(p for name in packages for p in sorted((ROOT / name).rglob("*")) if p.is_file())]
    return {p.relative_to(ROOT).as_posix(): p.read_bytes() for p in files
            if "__pycache__" not in p.parts and p.suffix != ".pyc"}


def code_digest(files: dict[str, bytes] | None = None) -> str:
    """The sha256 of ``files`` (default: :func:`carried_files`), each path with its length and bytes, in path order."""
    h = hashlib.sha256()
    for name, data in sorted((files if files is not None else carried_files()).items()):
        h.update(f"{name}\0{len(data)}\0".encode())
        h.update(data)
    return h.hexdigest()


def renamed_imports(source: bytes, package: str, where: str = "<source>") -> bytes:
    """``source`` with each absolute import of ddpipe (``from ddpipe[.x] import ...``, ``import ddpipe.x as y``) made
    an import of ``package``. A plain ``import ddpipe[.x]``, which binds the name ddpipe itself, is refused
    (``ValueError``, naming ``where``): no module of the carried part has one."""
    lines = source.splitlines(keepends=True)
    edits: list[tuple[int, int, int]] = []  # line (from 0), byte column, length of the name replaced
    for node in ast.walk(ast.parse(source, where)):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and _ours(node.module):
            found = _FROM.match(lines[node.lineno - 1], node.col_offset)
            if found is None:  # `from` and the module's name on two lines
                raise ValueError(f"{where}:{node.lineno}: write `from {node.module}` on one line")
            edits.append((node.lineno - 1, found.end() - len(NAME), len(NAME)))
        elif isinstance(node, ast.Import):
            for alias in (a for a in node.names if _ours(a.name)):
                if alias.asname is None:
                    raise ValueError(f"{where}:{node.lineno}: `import {alias.name}` binds the name {NAME}; "
                                     f"write `from {NAME}... import ...` or `import {alias.name} as ...`")
                edits.append((alias.lineno - 1, alias.col_offset, len(NAME)))
    for line, column, length in sorted(edits, reverse=True):  # from the end: earlier columns stay where they were
        lines[line] = lines[line][:column] + package.encode() + lines[line][column + length:]
    return b"".join(lines)


def _ours(module: str | None) -> bool:
    return module is not None and (module == NAME or module.startswith(NAME + "."))


def carry(directory: Path) -> Carried:
    """The part of this ddpipe a served model runs (:func:`carried_files`), copied into ``directory`` as the package
    ``ddpipe_<digest>`` with its imports renamed to it: the folder for a logged model's ``code_paths``."""
    files = carried_files()
    digest = code_digest(files)
    package = f"{NAME}_{digest[:16]}"
    target = Path(directory) / package
    for name, data in files.items():
        (target / name).parent.mkdir(parents=True, exist_ok=True)
        (target / name).write_bytes(renamed_imports(data, package, f"{NAME}/{name}") if name.endswith(".py") else data)
    return Carried(target, package, digest, __version__)


def model_code(carried: Carried, module: str, model_class: str, what: str) -> str:
    """The file MLflow runs to load a model (models-from-code): ``what``, the instance of ``model_class`` in the
    carried copy's ``module`` (``models.served``), never the installed ddpipe's."""
    return f'''"""{what} as MLflow loads it (models-from-code). It runs the ddpipe it was logged with
({carried.version}, code {carried.digest[:16]}), which it carries as {carried.package} (its code/{carried.package}):
an installed ddpipe is neither used nor shadowed."""
import mlflow.models

from {carried.package}.{module} import {model_class}

mlflow.models.set_model({model_class}())
'''


@contextlib.contextmanager
def importable(carried: Carried) -> Iterator[None]:
    """While a model is logged: the copy importable in this process, where MLflow runs the model's code to build the
    model and try its input example (so the copy itself is what that tries); then off ``sys.path`` and out of
    ``sys.modules`` again. Its folder holds nothing but the copy, which shadows nothing meanwhile."""
    folder = str(carried.path.parent)
    sys.path.insert(0, folder)
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):
            sys.path.remove(folder)
        for name in [m for m in sys.modules if m == carried.package or m.startswith(carried.package + ".")]:
            del sys.modules[name]
