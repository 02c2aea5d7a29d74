"""Helpers shared by the benchmark scripts: machine info, results files, Markdown tables, timed
subprocesses, and the data the benchmarks need (prepared subsets, torchvision's raw files).

Not a benchmark itself; the scripts beside it import it (``python bench/<script>.py`` puts
``bench/`` first on ``sys.path``).
"""

from __future__ import annotations

import datetime
import gzip
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
VENV_BIN = Path(sys.executable).parent
FASHION_DIR = Path("/usr/share/datasets/fashion-mnist")
FASHION_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte",
                 "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")


# ---------------------------------------------------------------------------------------------
# Machine and results


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (platform's guess elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cores() -> int:
    """Cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def machine_info() -> dict[str, Any]:
    import torch

    return {
        "cpu": cpu_model(), "cores": cores(), "torch": torch.__version__,
        "python": platform.python_version(), "host": platform.node(),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "loadavg_1min": os.getloadavg()[0],
    }


def append_jsonl(name: str, records: Sequence[dict[str, Any]]) -> Path:
    """Append ``records``, each with the machine info, to ``bench/results/<name>.jsonl``."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.jsonl"
    info = machine_info()
    with path.open("a") as f:
        for record in records:
            f.write(json.dumps({**record, "machine": info}) + "\n")
    return path


def write_json(path: str | Path | None, obj: dict[str, Any]) -> None:
    """Write ``obj`` to ``path`` (for a parent process to read); nothing when ``path`` is None."""
    if path:
        Path(path).write_text(json.dumps(obj))


def fmt(value: Any) -> str:
    if isinstance(value, float):
        if value != value:  # nan
            return "-"
        return f"{value:.4f}" if abs(value) < 10 else f"{value:.1f}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join("---" for _ in headers) + " |"]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def summary(values: Sequence[float]) -> tuple[float, float, float]:
    """(median, min, max)."""
    return statistics.median(values), min(values), max(values)


# ---------------------------------------------------------------------------------------------
# Processes


@dataclass
class Completed:
    seconds: float
    stdout: str
    stderr: str


class BenchError(RuntimeError):
    """A benchmarked command failed."""


def clean_env(**extra: str) -> dict[str, str]:
    """This environment with the venv's bin/ first on PATH (as the Makefile does), without the
    variables that would redirect ddpipe's outputs or tracking, plus ``extra``."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("MLFLOW_TRACKING_URI", "DVC_ROOT", "DVC_EXP_NAME", "PYTHONPATH")}
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    env.update(extra)
    return env


def run_timed(cmd: Sequence[str] | str, cwd: str | Path = REPO, env: dict[str, str] | None = None,
              timeout: float | None = None) -> Completed:
    """Run ``cmd`` (a shell string runs under ``sh -c``), return its wall seconds and output;
    raise :class:`BenchError` with the output's tail when it fails."""
    shell = isinstance(cmd, str)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, shell=shell, cwd=cwd, env=env or clean_env(), capture_output=True,
                          text=True, timeout=timeout)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        shown = cmd if shell else " ".join(map(str, cmd))
        raise BenchError(f"exit {proc.returncode}: {shown}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return Completed(seconds, proc.stdout, proc.stderr)


def torchrun(nproc: int) -> list[str]:
    """The venv's torchrun, single node, a free port."""
    exe = VENV_BIN / "torchrun"
    base = [str(exe)] if exe.exists() else [sys.executable, "-m", "torch.distributed.run"]
    return [*base, "--standalone", f"--nproc-per-node={nproc}"]


def temp_dir(prefix: str) -> Path:
    """A fresh directory under bench/results/tmp (git-ignored); the caller removes it."""
    root = RESULTS / "tmp"
    root.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=prefix, dir=root))


def remove(path: str | Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# Data


def ensure_prepared(max_train_samples: int | None, name: str) -> Path:
    """A prepared copy (``stages/prepare.py``) in ``bench/results/<name>`` with that many training
    samples; made once, reused while its meta.json says the size matches."""
    out = RESULTS / name
    meta = out / "meta.json"
    if meta.is_file():
        sizes = json.loads(meta.read_text())["sizes"]
        if max_train_samples is None or sizes["train"] == max_train_samples:
            return out
    args = [f"paths.prepared={out}"]
    if max_train_samples is not None:
        args.append(f"data.max_train_samples={max_train_samples}")
    run_timed([sys.executable, "stages/prepare.py", *args])
    return out


def fashion_mnist_root(root: str | Path = RESULTS / "torchvision") -> Path:
    """A torchvision root with FashionMNIST/raw/ holding the four extracted files.

    Debian's files are re-gzipped, so torchvision's MD5 check of the .gz files fails; extracted
    files pass ``FashionMNIST(root, download=False)``, which only checks they exist. Extraction is
    atomic (temp file + rename), so several ranks may call this at once."""
    raw = Path(root) / "FashionMNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    for name in FASHION_FILES:
        target = raw / name
        if target.exists():
            continue
        source = next((d / f"{name}.gz" for d in (FASHION_DIR, REPO / "data" / "raw")
                       if (d / f"{name}.gz").is_file()), None)
        if source is None:
            raise FileNotFoundError(f"{name}.gz: neither in {FASHION_DIR} (apt-get install "
                                    "dataset-fashion-mnist) nor in data/raw (dvc repro fetch)")
        tmp = raw / f".{name}.{os.getpid()}.tmp"
        with gzip.open(source, "rb") as src, tmp.open("wb") as dst:
            shutil.copyfileobj(src, dst)
        os.replace(tmp, target)
    return Path(root)
