"""DVC stage `fetch`: put the dataset's verified files in ``paths.raw``.

    python stages/fetch.py [key=value ...]

Official datasets, the first source that holds them: data.source_dir, Debian's dataset package
directory, torchvision's download (copied into paths.raw). A folder of one's own (imagefolder) is only
checked: the prepare stage reads it where it lies.
"""

import logging
from pathlib import Path

from ddpipe.config.command import execute_stage
from ddpipe.config.schema import Config
from ddpipe.data.fetching import fetch
from ddpipe.data.verify import DataSourceError

logger = logging.getLogger("ddpipe.stages.fetch")  # under ddpipe's logger, which execute_stage shows


def main(cfg: Config) -> None:
    origin = fetch(cfg.data, Path(cfg.paths.raw))
    logger.info(f"fetched {cfg.data.dataset} from {origin} into {cfg.paths.raw}")


if __name__ == "__main__":
    execute_stage(main, "stages/fetch.py", (DataSourceError,))
