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
import logging
import os
import sys
from typing import NoReturn

from torch.distributed.elastic.multiprocessing.errors import ErrorHandler, record

from ddpipe.config.command import load_or_exit
from ddpipe.config.load import user_errors
from ddpipe.core.environment import PAUSE_NOTE_ENV
from ddpipe.core.exits import EXIT_PREEMPTED
from ddpipe.core.files import atomic_write_text
from ddpipe.core.logs import configure
from ddpipe.data.store import PreparedDataError
from ddpipe.launch.torchrun import worker_config

logger = logging.getLogger(__spec__.name)  # its dotted name under `python -m` too (there __name__ is "__main__")

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


def paused(why: str) -> NoReturn:
    """End this worker with EXIT_PREEMPTED for ``why`` (its checkpoints' store away too long), said here and left in
    the launcher's note (:data:`PAUSE_NOTE_ENV`): torchrun exits 1 whatever its workers' codes, the launcher 75."""
    logger.warning(f"training stopped: {why}")
    if note := os.environ.get(PAUSE_NOTE_ENV):
        atomic_write_text(note, why)
    sys.exit(EXIT_PREEMPTED)


# under torchrun, the failing rank's traceback reaches the launcher's summary
@functools.partial(record, error_handler=WholeErrorFile())
def main() -> None:
    configure()  # DDPIPE_LOG_LEVEL, as the launcher's -q or -v left it; off global rank 0, warnings and errors only
    cfg = load_or_exit(sys.argv[1:], "stages/train.py")
    with user_errors(PreparedDataError):
        run = worker_config(cfg, int(os.environ.get("WORLD_SIZE", "1")))
    from ddpipe.core.claims import InUse
    from ddpipe.core.exits import Preempted, StoreAway
    from ddpipe.core.objectstore import StoreError
    from ddpipe.core.store_lease import LeaseLost
    from ddpipe.engine.loop import train
    from ddpipe.engine.optimizer import Diverged

    try:
        with user_errors(InUse):  # another training writes the same directories: refused before writing
            train(run)
    except Diverged:  # every rank stopped at that step, rank 0 said so in one line, the run is FAILED saying so
        sys.exit(1)   # no traceback: the line is the whole story
    except StoreAway as exc:  # paths.checkpoints' store away too long, what it holds whole: a pause, not an end
        paused(f"{exc}; run the same command once the store answers, and it resumes from that checkpoint (exit code "
               f"{EXIT_PREEMPTED})")
    except StoreError as exc:  # paths.checkpoints' store failed past its retries outside a checkpoint's write (a read)
        logger.error(f"error: {exc}; the training stopped, its newest whole checkpoint kept there: run the same "
                     "command once the store answers, and it resumes from that one")
        sys.exit(1)
    except LeaseLost as exc:  # another training took paths.checkpoints' lease over: nothing more was written there
        logger.error(f"error: {exc}")
        sys.exit(1)
    except Preempted as exc:  # the run is KILLED in MLflow; the same command resumes it
        logger.warning(f"training {exc}; run the same command to resume from the newest checkpoint "
                       f"(exit code {EXIT_PREEMPTED})")
        # all is saved and closed: leave now, without the seconds the C++ teardown of a process group takes when
        # its store went with a killed torchrun agent (a scheduler's grace period, or a kill's, is short)
        sys.stdout.flush()
        os._exit(EXIT_PREEMPTED)


if __name__ == "__main__":
    main()
