"""DVC stage `prepare`: split the fetched dataset and write uint8 tensors per split.

    python stages/prepare.py [key=value ...]     e.g. data.val_fraction=0.2
"""

from pathlib import Path

from ddpipe.cli import run_stage
from ddpipe.config import Config
from ddpipe.data import PreparedDataError, prepare
from ddpipe.sources import DataSourceError


def main(cfg: Config) -> None:
    result = prepare(cfg.data, cfg.seed, Path(cfg.paths.raw), Path(cfg.paths.prepared))
    sizes = ", ".join(f"{k} {v}" for k, v in result.sizes.items())
    print(f"prepared {cfg.data.dataset} into {cfg.paths.prepared}: {sizes}; {len(result.classes)} classes; "
          f"mean {[round(m, 4) for m in result.mean]}, std {[round(s, 4) for s in result.std]}")


if __name__ == "__main__":
    run_stage(main, "stages/prepare.py", (DataSourceError, PreparedDataError))
