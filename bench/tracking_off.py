"""What MLflow costs a short training: the CPU seconds of one tiny training worker (``stages/train_worker.py`` on the
tests' shrunk config and generated data, 2 epochs) with ``mlflow.enabled`` true (a run in a sqlite store: MLflow's
import, the store's opening, the courier's deliveries) and false (no run, MLflow never imported), alternating.

    python bench/tracking_off.py [--repeat 3]
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import REPO, print_machine

sys.path.insert(0, str(REPO))
from tests.conftest import args_for, prepare_mnist_like, subprocess_env  # noqa: E402


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    print_machine()
    base = Path(tempfile.mkdtemp(prefix="ddpipe-tracking-off-"))
    prepared = prepare_mnist_like(base / "data", 1200, 200)
    for i in range(args.repeat):
        for enabled in ("true", "false"):
            cmd = [sys.executable, "stages/train_worker.py",
                   *args_for(base / f"{enabled}{i}", prepared, f"mlflow.enabled={enabled}")]
            cpu, start = children_cpu(), time.perf_counter()
            subprocess.run(cmd, cwd=REPO, env=subprocess_env(), check=True, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
            print(f"mlflow.enabled={enabled}: {time.perf_counter() - start:.2f} s wall, "
                  f"{children_cpu() - cpu:.2f} s CPU", flush=True)


if __name__ == "__main__":
    main()
