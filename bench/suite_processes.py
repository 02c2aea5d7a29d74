"""Where the suite's CPU goes, process by process: every Python process a command starts (pytest, DVC, the stages,
torchrun and its workers, mlflow server) writes its argv, parent, wall and CPU seconds when it exits, and the
summary adds them up by kind.

    python bench/suite_processes.py run OUT.jsonl -- python -m pytest -n 2 --dist loadfile tests/test_tracking.py
    python bench/suite_processes.py summary OUT.jsonl

A process that ends without running its exit handlers (SIGKILL, ``os._exit``) and one that is not Python (git,
SLURM's daemons, PostgreSQL, SeaweedFS) write nothing: for those, the kernel's process accounting (Debian's ``acct``:
``accton FILE``, the command, ``accton off``, ``sa -a -c FILE``) counts every process by its command name.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

OUT_ENV = "DDPIPE_PROCESS_LOG"
# Imported by every Python started with its folder on PYTHONPATH (the site module imports ``sitecustomize``)
SITECUSTOMIZE = f'''
import atexit, json, os, sys, time
_started = time.time()
def _log():
    t = os.times()
    line = json.dumps({{"pid": os.getpid(), "ppid": os.getppid(), "wall": time.time() - _started,
                       "cpu": t.user + t.system, "argv": sys.argv[:4]}})
    with open(os.environ["{OUT_ENV}"], "a") as f:
        f.write(line + "\\n")
atexit.register(_log)
'''
# (kind, what its argv holds), the first that matches
KINDS = (("training worker", ("ddpipe.launch.worker", "launch/worker.py", "train_worker.py")),
         ("torchrun agent", ("torch/distributed/run.py", "torch.distributed.run")),
         ("launcher", ("ddpipe/launch/__main__.py", "stages/train.py", "ddpipe.launch")),
         ("evaluate stage", ("stages/evaluate.py",)), ("export stage", ("stages/export.py",)),
         ("fetch, prepare stages", ("stages/fetch.py", "stages/prepare.py")),
         ("mlflow server's job runner", ("huey_consumer",)),
         ("mlflow server", ("mlflow server", "uvicorn", "mlflow ui")),
         ("dvc", ("bin/dvc",)), ("ddpipe command", ("bin/ddpipe", "ddpipe.search", "ddpipe/search", "cluster/job.py")),
         ("pytest", ("pytest",)))


def kind(argv: list[str]) -> str:
    text = " ".join(argv)
    for name, marks in KINDS:
        if any(m in text for m in marks):
            return name
    return "python -c (pytest-xdist workers, multiprocessing children)" if argv[:1] == ["-c"] else "other Python"


def run(out: Path, cmd: list[str]) -> int:
    with tempfile.TemporaryDirectory(prefix="ddpipe-processes-") as folder:
        (Path(folder) / "sitecustomize.py").write_text(SITECUSTOMIZE)
        path = os.pathsep.join(p for p in (folder, os.environ.get("PYTHONPATH", "")) if p)
        return subprocess.call(cmd, env={**os.environ, "PYTHONPATH": path, OUT_ENV: str(out.resolve())})


def summary(out: Path) -> None:
    rows = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    cpu, count = collections.Counter(), collections.Counter()
    for r in rows:
        cpu[kind(r["argv"])] += r["cpu"]
        count[kind(r["argv"])] += 1
    total = sum(cpu.values())
    print(f"{len(rows)} Python processes, {total / 60:.1f} CPU minutes\n")
    print("| kind | processes | CPU (s) | share | CPU per process (s) |\n| --- | --- | --- | --- | --- |")
    for name, seconds in cpu.most_common():
        print(f"| {name} | {count[name]} | {seconds:,.0f} | {seconds / total:.0%} | {seconds / count[name]:.2f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    r = sub.add_parser("run", help="run a command, every Python process of it logging to OUT")
    r.add_argument("out", type=Path)
    r.add_argument("cmd", nargs=argparse.REMAINDER)
    sub.add_parser("summary", help="CPU by kind of process").add_argument("out", type=Path)
    args = p.parse_args()
    if args.what == "run":
        cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
        sys.exit(run(args.out, cmd))
    summary(args.out)


if __name__ == "__main__":
    main()
