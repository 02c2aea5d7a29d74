"""DVC stage `fetch`: put the dataset's verified files in ``paths.raw``.

    python stages/fetch.py [key=value ...]

Sources, in order: data.source_dir, Debian's dataset package directory, torchvision's download.
"""

from pathlib import Path

from ddpipe.cli import run_stage
from ddpipe.config import Config
from ddpipe.sources import DataSourceError, fetch


def main(cfg: Config) -> None:
    origin = fetch(cfg.data, Path(cfg.paths.raw))
    print(f"fetched {cfg.data.dataset} from {origin} into {cfg.paths.raw}")


if __name__ == "__main__":
    run_stage(main, "stages/fetch.py", (DataSourceError,))
