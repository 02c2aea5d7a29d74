"""DVC stage `train`: DistributedDataParallel training, one process per rank.

    torchrun --standalone --nproc-per-node=2 stages/train.py [key=value ...]   # one node, N processes
    python stages/train.py [key=value ...]                                     # one plain process
    python stages/train.py --check [key=value ...]     # check params, print processes per node, exit

dvc.yaml runs ``--check`` first, so that a bad parameter fails before torchrun starts any worker, and
passes the number it prints (``distributed.nproc_per_node`` resolved) to torchrun.
"""

import sys

from torch.distributed.elastic.multiprocessing.errors import record

from ddpipe.cli import load_or_exit
from ddpipe.config import ConfigError
from ddpipe.data import PreparedDataError


@record  # under torchrun, the failing rank's traceback reaches the launcher's summary
def main() -> None:
    args = sys.argv[1:]
    cfg = load_or_exit([a for a in args if a != "--check"], "stages/train.py")
    from ddpipe.training import preflight, train

    try:
        preflight(cfg)
    except (ConfigError, PreparedDataError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    if "--check" in args:
        from ddpipe.distributed import resolve_nproc

        print(resolve_nproc(cfg.distributed))
        return
    from ddpipe.preemption import EXIT_PREEMPTED, Preempted

    try:
        train(cfg)
    except Preempted as exc:  # the run is KILLED in MLflow; the same command resumes it
        print(f"training {exc}; run the same command to resume from the newest checkpoint "
              f"(exit code {EXIT_PREEMPTED})", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_PREEMPTED) from None


if __name__ == "__main__":
    main()
