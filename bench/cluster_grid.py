"""A 2 x 2 grid queued with `dvc exp run --queue`, run two ways on this host: `dvc queue start -j 2`, and
`ddpipe cluster submit --max-running 2` on a throwaway two-node SLURM cluster (tests/slurm_cluster.py,
both nodes on this host); the wall time of each, and per SLURM job what it adds before `dvc exp run` starts.

    python bench/cluster_grid.py [--samples 4096] [--epochs 1]      # as root, with slurm-wlm and munge installed

A clone of this checkout (its tracked files) with the default params but ``--samples`` training images and
``--epochs`` epochs, reproduced once; then the same four experiments (seed 1, 2 x train.base_lr 0.003, 0.01) each
way, two at a time. Prints the machine and a Markdown table; appends to bench/results/cluster_grid.jsonl.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

from common import REPO, append_jsonl, clean_env, markdown_table, print_machine, temp_dir

sys.path.insert(0, str(REPO))
from tests.slurm_cluster import SlurmCluster, unavailable  # noqa: E402

GRID = [("seed=1", "train.base_lr=0.003"), ("seed=1", "train.base_lr=0.01"), ("seed=2", "train.base_lr=0.003"),
        ("seed=2", "train.base_lr=0.01")]
GIT = {"GIT_AUTHOR_NAME": "bench", "GIT_AUTHOR_EMAIL": "bench@ddpipe.invalid", "GIT_COMMITTER_NAME": "bench",
       "GIT_COMMITTER_EMAIL": "bench@ddpipe.invalid", "MLFLOW_TRACKING_URI": ""}


def sh(cmd: list[str] | str, cwd: Path, env: dict | None = None) -> str:
    out = subprocess.run(cmd, cwd=cwd, env=clean_env(**GIT, **(env or {})), capture_output=True, text=True,
                         shell=isinstance(cmd, str))
    if out.returncode != 0:
        raise SystemExit(f"{cmd} exited {out.returncode}:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return out.stdout


def clone(dest: Path, samples: int, epochs: int) -> Path:
    files = sh(["git", "ls-files", "-co", "--exclude-standard"], REPO).split()
    dest.mkdir(parents=True)
    for f in files:
        if (REPO / f).is_file():
            (dest / f).parent.mkdir(parents=True, exist_ok=True)
            (dest / f).write_bytes((REPO / f).read_bytes())
    sh(f"python - <<'EOF'\nfrom omegaconf import OmegaConf\nc = OmegaConf.load('params.yaml')\n"
       f"OmegaConf.update(c, 'data.max_train_samples', {samples})\nOmegaConf.update(c, 'num_epochs', {epochs})\n"
       "OmegaConf.update(c, 'train.progress_bar', False)\nOmegaConf.update(c, 'cluster.cpus_per_node', 1)\n"
       "OmegaConf.save(c, 'params.yaml')\nEOF", dest)
    for cmd in (["git", "init", "-q"], ["git", "add", "-A"], ["git", "commit", "-qm", "bench"], ["dvc", "repro"],
                ["git", "add", "-A"], ["git", "commit", "-qm", "reproduced"]):
        sh(cmd, dest)
    return dest


def queue(repo: Path, sweep: str) -> None:
    for sets in GRID:
        sh(["dvc", "exp", "run", "--queue", *(a for s in (*sets, f"mlflow.sweep={sweep}") for a in ("-S", s))], repo)


def exp_count(repo: Path) -> int:
    refs = sh(["git", "for-each-ref", "--format=%(refname)", "refs/exps"], repo).split()
    return sum(1 for r in refs if re.match(r"refs/exps/[0-9a-f]{2}/", r))


def local(repo: Path) -> float:
    queue(repo, "local")
    base = exp_count(repo)
    t0 = time.time()
    sh(["dvc", "queue", "start", "-j", "2"], repo)
    while exp_count(repo) < base + 4:
        time.sleep(0.5)
    wall = time.time() - t0
    sh(["dvc", "queue", "stop"], repo)  # its workers must not take the grid queued for SLURM next
    while "0 active, 0 idle" not in sh(["dvc", "queue", "status"], repo):
        time.sleep(1)
    return wall


def on_slurm(repo: Path, scratch: Path) -> tuple[float, list[float]]:
    queue(repo, "slurm")
    with SlurmCluster(scratch / "slurm", nodes=2) as cluster:
        env = {"SLURM_CONF": str(cluster.conf)}
        t0 = time.time()
        sh([sys.executable, "-m", "ddpipe", "cluster", "submit", "--max-running", "2"], repo, env)
        sh([sys.executable, "-m", "ddpipe", "cluster", "wait", "--poll", "1"], repo, env)
        wall = time.time() - t0
    overheads = []
    for rec in (repo / ".dvc" / "tmp" / "cluster" / "experiments").glob("*.json"):
        r = json.loads(rec.read_text())
        stamps = re.findall(r"ddpipe.launch.cluster \[(\d\d:\d\d:\d\d)\]: \$ dvc exp run", Path(r["log"]).read_text())
        day = datetime.fromtimestamp(r["submitted"])
        started = datetime.combine(day.date(), datetime.strptime(stamps[0], "%H:%M:%S").time())
        overheads.append(started.timestamp() - r["submitted"])
    return wall, sorted(overheads)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--epochs", type=int, default=1)
    args = parser.parse_args()
    if why := unavailable():
        raise SystemExit(f"no SLURM here: {why}")
    print_machine()
    with temp_dir("cluster-grid") as scratch:
        repo = clone(scratch / "repo", args.samples, args.epochs)
        local_s = local(repo)
        slurm_s, overheads = on_slurm(repo, scratch)
    rows = [["`dvc queue start -j 2`", f"{local_s:.1f}", "-"],
            ["`ddpipe cluster submit --max-running 2` + `wait` (SLURM, 2 nodes on this host)",
             f"{slurm_s:.1f}", ", ".join(f"{o:.0f}" for o in overheads)]]
    print(f"2 x 2 grid, {args.samples} training images, {args.epochs} epoch(s), two experiments at a time\n")
    print(markdown_table(["how", "wall s (4 experiments)", "submit -> `dvc exp run` starts, per job (s)"], rows))
    append_jsonl("cluster_grid", [{"samples": args.samples, "epochs": args.epochs, "dvc_queue_s": local_s,
                                   "slurm_s": slurm_s, "slurm_job_start_s": overheads}])


if __name__ == "__main__":
    main()
