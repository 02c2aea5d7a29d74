"""Build and run the torchrun command for this node from params.yaml: the multi-node entry point.

    python -m ddpipe.launch [key=value ...]            # run it
    python -m ddpipe.launch --print [key=value ...]    # show the command only

One node (``distributed.nnodes: 1``): ``torchrun --standalone`` (a free port, so parallel experiments
never collide), as dvc.yaml's train stage runs it. N nodes: every node runs this same command with
the same ``distributed.rdzv_endpoint`` (host:port on the first node) and ``distributed.rdzv_id``;
torchrun's c10d rendezvous assigns node ranks. deploy/ has SLURM and Kubernetes launchers using it.

Run it from the repository root (it reads ./params.yaml, and the workers run this checkout's
stages/train.py), with the same checkout and prepared data on every node.

A scheduler's stop (SIGTERM, or SIGUSR1 ahead of a time limit) is passed on to torchrun, which passes
it to the workers: they stop at a step, rank 0 checkpoints it, and this command exits with 75
(``ddpipe.preemption.EXIT_PREEMPTED``): run it again to resume. Under Kubernetes this process is the
container's PID 1, the only one the kubelet signals.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

from ddpipe.cli import load_or_exit
from ddpipe.config import Config

TRAIN_SCRIPT = Path(__file__).resolve().parents[2] / "stages" / "train.py"
# What torchrun passes on to its workers (its default, plus SLURM's warning signal)
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1)


def torchrun_command(cfg: Config, nproc: int, overrides: list[str]) -> list[str]:
    """The torchrun argv for this node (script overrides passed through to every worker)."""
    d = cfg.distributed
    # torchrun as a module of this interpreter: no PATH lookup, never another Python's torchrun
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           f"--max-restarts={d.max_restarts}", f"--signals-to-handle={','.join(s.name for s in FORWARDED)}",
           f"--shutdown-timeout={d.shutdown_timeout_s}"]
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
        raise SystemExit(run_forwarding_stops(cmd))


def run_forwarding_stops(cmd: list[str]) -> int:
    """Run torchrun, passing on the signals a scheduler stops jobs with; its exit code, or
    EXIT_PREEMPTED if a stop (SIGTERM, SIGUSR1) ended it: the workers checkpointed their step.

    SIGINT is not passed on: Ctrl-C reaches torchrun from the terminal itself, in the same process group.
    """
    from ddpipe.preemption import EXIT_PREEMPTED, STOP_SIGNALS

    stopped: list[int] = []
    child: subprocess.Popen | None = None

    def forward(signum: int, frame: object) -> None:
        stopped.append(signum)
        if child is not None:
            child.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in FORWARDED if sig != signal.SIGINT}
    previous[signal.SIGINT] = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        child = subprocess.Popen(cmd)
        for signum in stopped:  # arrived while it was starting
            child.send_signal(signum)
        code = child.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if code != 0 and any(sig in STOP_SIGNALS for sig in stopped):
        print(f"ddpipe.launch: stopped by {signal.Signals(stopped[0]).name}; the workers checkpointed their "
              f"step: run the same command to resume (exit code {EXIT_PREEMPTED})", file=sys.stderr, flush=True)
        return EXIT_PREEMPTED
    return code

if __name__ == "__main__":
    main()
