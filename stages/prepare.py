"""DVC stage `prepare`: split the dataset and write each split into the memory-mapped store.

    python stages/prepare.py [key=value ...]     e.g. data.val_fraction=0.2
"""

import logging
import time
from pathlib import Path

from ddpipe.config.command import execute_stage
from ddpipe.config.schema import Config
from ddpipe.data.prepare import prepare
from ddpipe.data.store import PreparedDataError
from ddpipe.data.verify import DataSourceError

logger = logging.getLogger("ddpipe.stages.prepare")  # under ddpipe's logger, which execute_stage shows


def main(cfg: Config) -> None:
    started = time.perf_counter()
    result = prepare(cfg.data, cfg.seed, Path(cfg.paths.raw), Path(cfg.paths.prepared))
    seconds = time.perf_counter() - started
    sizes = ", ".join(f"{k} {v}" for k, v in result.sizes.items())
    stored = f"raw {result.image_size[0]}x{result.image_size[1]}" if result.image_size else \
        f"encoded, longer side at most {result.max_side} px"
    logger.info(f"prepared {cfg.data.dataset} into {cfg.paths.prepared} ({stored}): {sizes}; {len(result.classes)} "
                f"classes; mean {[round(m, 4) for m in result.mean]}, std {[round(s, 4) for s in result.std]}; "
                f"{seconds:.1f} s")


if __name__ == "__main__":
    execute_stage(main, "stages/prepare.py", (DataSourceError, PreparedDataError))
