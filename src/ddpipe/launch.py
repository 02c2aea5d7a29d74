"""Build and run the torchrun command for this node from params.yaml: the multi-node entry point.

    python -m ddpipe.launch [key=value ...]            # run it
    python -m ddpipe.launch --print [key=value ...]    # show the command only

One node (``distributed.nnodes: 1``): ``torchrun --standalone`` (a free port, so parallel experiments
never collide), as dvc.yaml's train stage runs it. N nodes: every node runs this same command with
the same ``distributed.rdzv_endpoint`` (host:port on the first node) and ``distributed.rdzv_id``;
torchrun's c10d rendezvous assigns node ranks. deploy/ has SLURM and Kubernetes launchers using it.

Run it from the repository root (it reads ./params.yaml, and the workers run this checkout's
stages/train.py), with the same checkout and prepared data on every node.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from ddpipe.cli import load_or_exit
from ddpipe.config import Config

TRAIN_SCRIPT = Path(__file__).resolve().parents[2] / "stages" / "train.py"


def torchrun_command(cfg: Config, nproc: int, overrides: list[str]) -> list[str]:
    """The torchrun argv for this node (script overrides passed through to every worker)."""
    d = cfg.distributed
    # torchrun as a module of this interpreter: no PATH lookup, never another Python's torchrun
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           f"--max-restarts={d.max_restarts}"]
    if d.nnodes == "1":
        cmd.append("--standalone")
    else:
        cmd += [f"--nnodes={d.nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={d.rdzv_endpoint}",
                f"--rdzv-id={d.rdzv_id}"]
    return cmd + [str(TRAIN_SCRIPT), *overrides]


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    show_only = "--print" in argv
    overrides = [a for a in argv if a != "--print"]
    cfg = load_or_exit(overrides, "-m ddpipe.launch")
    from ddpipe.config import ConfigError
    from ddpipe.data import PreparedDataError
    from ddpipe.distributed import resolve_nproc
    from ddpipe.training import preflight

    try:
        preflight(cfg)  # fail here, before any worker starts on any node
    except (ConfigError, PreparedDataError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    cmd = torchrun_command(cfg, resolve_nproc(cfg.distributed), overrides)
    print(" ".join(cmd), flush=True)
    if not show_only:
        os.execv(cmd[0], cmd)


if __name__ == "__main__":
    main()
