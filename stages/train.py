"""DVC stage `train`: DistributedDataParallel training, one process per rank.

    python -m ddpipe.launch [key=value ...]            # what dvc.yaml runs: checks, then torchrun this script
    python -m ddpipe.launch --print [key=value ...]    # the checks and the command only
    python stages/train.py [key=value ...]             # one plain process

Workers that ddpipe.launch started skip its checks, and check only what it could not see: the world size
the job formed (an elastic MIN:MAX job's) against the global batch. A worker started otherwise (a torchrun
or python command by hand) runs every check first (ddpipe.launch.worker_config).
"""

import os
import sys

from torch.distributed.elastic.multiprocessing.errors import record

from ddpipe.cli import load_or_exit
from ddpipe.config.loading import user_errors
from ddpipe.data.store import PreparedDataError
from ddpipe.launch import worker_config


@record  # under torchrun, the failing rank's traceback reaches the launcher's summary
def main() -> None:
    cfg = load_or_exit(sys.argv[1:], "stages/train.py")
    with user_errors(PreparedDataError):
        run = worker_config(cfg, int(os.environ.get("WORLD_SIZE", "1")))
    from ddpipe.exits import EXIT_PREEMPTED, Preempted
    from ddpipe.training import train

    try:
        train(run)
    except Preempted as exc:  # the run is KILLED in MLflow; the same command resumes it
        print(f"training {exc}; run the same command to resume from the newest checkpoint "
              f"(exit code {EXIT_PREEMPTED})", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_PREEMPTED) from None


if __name__ == "__main__":
    main()
