"""Helpers shared by the benchmark scripts: the machine line every script prints beside its figures,
results files, Markdown tables, timed subprocesses, params.yaml, and the data the benchmarks need.

Not a benchmark itself: ``python bench/<script>.py`` puts bench/ first on ``sys.path``, so the scripts import it.
"""

from __future__ import annotations

import contextlib
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
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from ddpipe.config.load import load_config
from ddpipe.config.schema import Config
from ddpipe.core.devices import cpu_count
from ddpipe.data.store import load_meta

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
FASHION_DIR = Path("/usr/share/datasets/fashion-mnist")
FASHION_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte",
                 "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")


class BenchError(RuntimeError):
    """A benchmarked command failed."""


# ---------------------------------------------------------------------------------------------
# Machine and results


def machine() -> str:
    """What a figure was measured on: CPU model, cores, and the flags that decide ddpipe's precision
    (bf16 where AVX512-BF16 or AMX exist), e.g. 'AMD EPYC, 2 cores, AVX2 yes, AVX512-BF16 yes, AMX no'."""
    try:
        first_cpu = Path("/proc/cpuinfo").read_text().split("\n\n")[0]
    except OSError:  # not Linux
        first_cpu = ""
    info = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in first_cpu.splitlines())}
    flags = set(info.get("flags", "").split())
    shown = ", ".join(f"{name} {'yes' if flags & probes else 'no'}" for name, probes in (
        ("AVX2", {"avx2"}), ("AVX512-BF16", {"avx512_bf16"}), ("AMX", {"amx_tile", "amx_bf16"})))
    return (f"{info.get('model name') or platform.processor() or platform.machine()}, {cpu_count()} cores, {shown}; "
            f"torch {torch.__version__}, Python {platform.python_version()}")


def print_machine() -> None:
    """The machine line, with the load average (on a 2-core machine any other load distorts timings)."""
    print(f"machine: {machine()}; load average {os.getloadavg()[0]:.2f}", flush=True)


def append_jsonl(name: str, records: Sequence[dict[str, Any]]) -> Path:
    """Append ``records``, each with the machine, date and load, to ``bench/results/<name>.jsonl``."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.jsonl"
    info = {"cpu": machine(), "host": platform.node(), "loadavg_1min": os.getloadavg()[0],
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}
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
    return "\n".join(lines + ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows])


def summary(values: Sequence[float]) -> tuple[float, float, float]:
    """(median, min, max)."""
    return statistics.median(values), min(values), max(values)


# ---------------------------------------------------------------------------------------------
# Processes


def clean_env(**extra: str) -> dict[str, str]:
    """This environment with the venv's bin/ first on PATH (as the Makefile does), without the
    variables that would redirect ddpipe's outputs or tracking, plus ``extra``."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("MLFLOW_TRACKING_URI", "DVC_ROOT", "DVC_EXP_NAME", "PYTHONPATH")}
    env["PATH"] = f"{Path(sys.executable).absolute().parent}{os.pathsep}{env.get('PATH', '')}"  # absolute: runs chdir
    return {**env, **extra}


def run_timed(cmd: Sequence[str] | str, cwd: str | Path = REPO,
              env: dict[str, str] | None = None) -> float:
    """Run ``cmd`` (a shell string runs under ``sh -c``); its wall seconds. :class:`BenchError` with the
    output's tail when it fails."""
    shell = isinstance(cmd, str)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, shell=shell, cwd=cwd, env=env or clean_env(), capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        shown = cmd if shell else " ".join(map(str, cmd))
        raise BenchError(f"exit {proc.returncode}: {shown}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return seconds


GIT_IDENTITY = {"GIT_AUTHOR_NAME": "bench", "GIT_AUTHOR_EMAIL": "bench@ddpipe.invalid", "GIT_COMMITTER_NAME": "bench",
                "GIT_COMMITTER_EMAIL": "bench@ddpipe.invalid"}


def clone_env(clone: Path) -> dict[str, str]:
    """A clone's own code (its src/, not the editable install's), its own mlflow.db, a git identity."""
    return clean_env(**GIT_IDENTITY, MLFLOW_TRACKING_URI="", PYTHONPATH=str(clone / "src"))


def run_in_clone(cmd: list[str], clone: Path) -> tuple[str, float]:
    """Run ``cmd`` in ``clone``: (its stdout, its wall seconds); :class:`BenchError` when it fails."""
    t0 = time.perf_counter()
    out = subprocess.run(cmd, cwd=clone, env=clone_env(clone), capture_output=True, text=True,
                         stdin=subprocess.DEVNULL)
    seconds = time.perf_counter() - t0
    if out.returncode != 0:
        raise BenchError(f"{' '.join(cmd)} exited {out.returncode}:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return out.stdout, seconds


def clone_checkout(dest: Path, params: dict[str, Any], message: str) -> None:
    """This checkout's files (tracked and unignored) as a fresh git repo at ``dest`` with ``params`` (dotted keys)
    in its params.yaml, committed, reproduced with `dvc repro` and committed again."""
    from omegaconf import OmegaConf

    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True, text=True,
                           check=True).stdout.split()
    for f in files:
        if (REPO / f).is_file():
            (dest / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / f, dest / f)
    cfg = OmegaConf.load(dest / "params.yaml")
    for key, value in params.items():
        OmegaConf.update(cfg, key, value, merge=False)
    OmegaConf.save(cfg, dest / "params.yaml")
    for cmd in (["git", "init", "-q"], ["git", "add", "-A"], ["git", "commit", "-qm", message],
                ["dvc", "repro"], ["git", "add", "-A"], ["git", "commit", "-qm", "reproduced"]):
        run_in_clone(cmd, dest)


@contextlib.contextmanager
def mlflow_server(store: str, cwd: Path | None = None, env: dict[str, str] | None = None,
                  wait_s: float = 120) -> Iterator[str]:
    """`mlflow server` on a free port of 127.0.0.1 with ``store`` as its backend store: its base URL once /health
    answers (or ``wait_s`` passed); its process group killed on exit (its job-queue workers may ignore SIGTERM)."""
    import socket
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mlflow = Path(os.path.abspath(sys.executable)).with_name("mlflow")  # cwd may be another directory
    server = subprocess.Popen([str(mlflow), "server", "--host", "127.0.0.1",
                               "--port", str(port), "--backend-store-uri", store], cwd=cwd, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(f"{base}/health", timeout=2)
                break
            except OSError:
                time.sleep(0.5)
        yield base
    finally:
        os.killpg(server.pid, 9)
        server.wait(timeout=30)


def config(overrides: Sequence[str] = ()) -> Config:
    """The repository's params.yaml with ``key=value`` overrides, wherever the script runs from."""
    return load_config(list(overrides), params_file=REPO / "params.yaml")


@contextlib.contextmanager
def temp_dir(prefix: str) -> Iterator[Path]:
    """A fresh directory under bench/results/tmp (git-ignored), removed afterwards."""
    (RESULTS / "tmp").mkdir(parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=RESULTS / "tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# Data


def ensure_prepared(max_train_samples: int, name: str) -> Path:
    """A prepared copy (``stages/prepare.py``) with that many training samples in ``bench/results/<name>``;
    made once, reused while its meta.json says the size matches."""
    out = RESULTS / name
    if (out / "meta.json").is_file() and load_meta(out).sizes["train"] == max_train_samples:
        return out
    run_timed([sys.executable, "stages/prepare.py", f"paths.prepared={out}",
               f"data.max_train_samples={max_train_samples}"])
    return out


def fashion_mnist_root(root: str | Path = RESULTS / "torchvision") -> Path:
    """A torchvision root with FashionMNIST/raw/ holding the four extracted files.

    Debian's files are re-gzipped, so torchvision's MD5 check of the .gz files fails; extracted
    files pass ``FashionMNIST(root, download=False)``, which only checks they exist. Extraction is
    atomic (temp file + rename), so several ranks may call this at once."""
    raw = Path(root) / "FashionMNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    for name in FASHION_FILES:
        if (raw / name).exists():
            continue
        source = next((d / f"{name}.gz" for d in (FASHION_DIR, REPO / "data" / "raw")
                       if (d / f"{name}.gz").is_file()), None)
        if source is None:
            raise FileNotFoundError(f"{name}.gz: neither in {FASHION_DIR} (apt-get install "
                                    "dataset-fashion-mnist) nor in data/raw (dvc repro fetch)")
        tmp = raw / f".{name}.{os.getpid()}.tmp"
        with gzip.open(source, "rb") as src, tmp.open("wb") as dst:
            shutil.copyfileobj(src, dst)
        os.replace(tmp, raw / name)
    return Path(root)
