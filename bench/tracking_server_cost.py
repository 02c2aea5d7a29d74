"""What an idle `mlflow server` costs to start, by how it is started: MLflow's defaults (4 workers and its job
runner), without the job runner (deploy/tracking_server.py's NO_JOB_RUNNER), and that with one worker (what the
tests start). For each: seconds until /health answers, then, 15 s later, the processes of its tree, the CPU seconds
they spent and their PSS.

    python bench/tracking_server_cost.py [--repeat 2]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from deploy.tracking_server import NO_JOB_RUNNER  # noqa: E402
from tests.conftest import free_port  # noqa: E402

SETTLE_S = 15  # after /health: the job runner's consumers are up and importing by then
CASES = {"MLflow's defaults": ({}, []), "without the job runner": (NO_JOB_RUNNER, []),
         "without the job runner, --workers 1": (NO_JOB_RUNNER, ["--workers", "1"])}


def measure(env: dict[str, str], extra: list[str]) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as d:
        port = free_port()
        mlflow = Path(sys.executable).with_name("mlflow")
        start = time.monotonic()
        proc = subprocess.Popen([str(mlflow), "server", "--host", "127.0.0.1", "--port", str(port),
                                 "--backend-store-uri", f"sqlite:///{d}/mlflow.db", "--artifacts-destination",
                                 f"{d}/artifacts", *extra], cwd=d, env={**os.environ, **env},
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            while True:
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1).close()
                    break
                except OSError:
                    if proc.poll() is not None:
                        raise SystemExit(f"mlflow server exited {proc.returncode}") from None
                    time.sleep(0.1)
            up = time.monotonic() - start
            time.sleep(SETTLE_S)
            top = psutil.Process(proc.pid)
            tree = [top, *top.children(recursive=True)]
            cpu = sum(p.cpu_times().user + p.cpu_times().system for p in tree)
            pss = sum(p.memory_full_info().pss for p in tree) / 2**20
        finally:
            os.killpg(proc.pid, 9)
            proc.wait()
    return {"up_s": up, "processes": len(tree), "cpu_s": cpu, "pss_mib": pss}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeat", type=int, default=2)
    args = p.parse_args()
    print(f"| how it starts | up (s) | processes | CPU from its start to {SETTLE_S} s after up (s) | PSS (MiB) |")
    print("| --- | --- | --- | --- | --- |")
    for name, (env, extra) in CASES.items():
        runs = [measure(env, extra) for _ in range(args.repeat)]
        span = {k: f"{min(r[k] for r in runs):.1f}-{max(r[k] for r in runs):.1f}" for k in ("up_s", "cpu_s")}
        print(f"| {name} | {span['up_s']} | {runs[0]['processes']} | {span['cpu_s']} | "
              f"{max(r['pss_mib'] for r in runs):,.0f} |", flush=True)


if __name__ == "__main__":
    main()
