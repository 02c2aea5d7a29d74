"""One training process: a rank of DistributedDataParallel under torchrun, or one plain process.

    torchrun ... -m ddpipe.launch.worker [key=value ...]   # what ddpipe.launch starts on every rank
    python -m ddpipe.launch.worker [key=value ...]         # one plain process, no process group
    python stages/train_worker.py [key=value ...]          # the same, from a checkout

torchrun starts this module, not a file of the checkout: a wheel installed anywhere trains the same. Workers that
ddpipe.launch started skip its checks, and check only what it could not see: the world size the job formed (an
elastic MIN:MAX job's) against the global batch. A worker started otherwise (a torchrun or python command by hand)
runs every check first (ddpipe.launch.torchrun.worker_config).
"""

import functools
import os
import sys

from torch.distributed.elastic.multiprocessing.errors import ErrorHandler, record

from ddpipe.config.command import load_or_exit
from ddpipe.config.load import user_errors
from ddpipe.data.store import PreparedDataError
from ddpipe.launch.torchrun import worker_config

ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"  # where torchrun's agent reads a failed rank's error (torch's own name)


class WholeErrorFile(ErrorHandler):
    """torch's error file of a failed rank, written whole or not at all: into a file beside it, then renamed. Written
    in place, a SIGTERM that torchrun's agent sends the other ranks once one failed can land between the truncating
    open and the write (the training's own handler is gone by then), and the agent then dies on the empty file
    (JSONDecodeError in ProcessFailure) instead of restarting the group: seen once in CI, SIGKILLing one of 2 ranks."""

    def record_exception(self, e: BaseException) -> None:
        target = os.environ.get(ERROR_FILE_ENV)
        if not target:
            return super().record_exception(e)
        partial = f"{target}.{os.getpid()}.partial"
        os.environ[ERROR_FILE_ENV] = partial
        try:
            super().record_exception(e)
        finally:
            os.environ[ERROR_FILE_ENV] = target
        if os.path.isfile(partial):
            os.replace(partial, target)


# under torchrun, the failing rank's traceback reaches the launcher's summary
@functools.partial(record, error_handler=WholeErrorFile())
def main() -> None:
    cfg = load_or_exit(sys.argv[1:], "stages/train.py")
    with user_errors(PreparedDataError):
        run = worker_config(cfg, int(os.environ.get("WORLD_SIZE", "1")))
    from ddpipe.core.claims import InUse
    from ddpipe.core.exits import EXIT_PREEMPTED, Preempted
    from ddpipe.core.objectstore import StoreError
    from ddpipe.engine.loop import train
    from ddpipe.engine.optimizer import Diverged

    try:
        with user_errors(InUse):  # another training writes the same directories: refused before writing
            train(run)
    except Diverged:  # every rank stopped at that step, rank 0 said so in one line, the run is FAILED saying so
        sys.exit(1)   # no traceback: the line is the whole story
    except StoreError as exc:  # paths.checkpoints' store failed past its retries: what it holds is whole
        print(f"error: {exc}; the training stopped, its newest whole checkpoint kept there: run the same command once "
              "the store answers, and it resumes from that one", file=sys.stderr, flush=True)
        sys.exit(1)
    except Preempted as exc:  # the run is KILLED in MLflow; the same command resumes it
        print(f"training {exc}; run the same command to resume from the newest checkpoint "
              f"(exit code {EXIT_PREEMPTED})", file=sys.stderr, flush=True)
        # all is saved and closed: leave now, without the seconds the C++ teardown of a process group takes when
        # its store went with a killed torchrun agent (a scheduler's grace period, or a kill's, is short)
        sys.stdout.flush()
        os._exit(EXIT_PREEMPTED)


if __name__ == "__main__":
    main()
