"""DVC stage `train`: DistributedDataParallel training, one process per rank.

    python -m ddpipe.launch [key=value ...]            # what dvc.yaml runs: checks, then torchrun this script
    python -m ddpipe.launch --print [key=value ...]    # the checks and the command only
    python stages/train.py [key=value ...]             # one plain process

Under torchrun each worker checks again (for a torchrun started by hand) and trains its rank.
"""

import os
import sys

from torch.distributed.elastic.multiprocessing.errors import record

from ddpipe.cli import load_or_exit
from ddpipe.config import ConfigError
from ddpipe.data.store import PreparedDataError
from ddpipe.launch import preflight


@record  # under torchrun, the failing rank's traceback reaches the launcher's summary
def main() -> None:
    args = sys.argv[1:]
    cfg = load_or_exit(args, "stages/train.py")
    try:
        preflight(cfg, int(os.environ.get("WORLD_SIZE", "1")))
    except (ConfigError, PreparedDataError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    from ddpipe.preemption import EXIT_PREEMPTED, Preempted
    from ddpipe.training import train

    try:
        train(cfg)
    except Preempted as exc:  # the run is KILLED in MLflow; the same command resumes it
        print(f"training {exc}; run the same command to resume from the newest checkpoint "
              f"(exit code {EXIT_PREEMPTED})", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_PREEMPTED) from None


if __name__ == "__main__":
    main()
