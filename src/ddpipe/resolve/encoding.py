"""``data.encoding`` made concrete for the images the prepare stage found: raw pixels or encoded files."""

from __future__ import annotations

from ddpipe.config.schema import DataConfig

# data.encoding auto: raw pixels for one size of at most this many px a side, else encoded
RAW_MAX_SIDE = 64


def data_encoding(cfg: DataConfig, one_size: bool, largest_side: int) -> tuple[str, bool]:
    """``data.encoding`` for images of one size or several (the largest side ``largest_side`` px): raw pixels for
    one size of at most :data:`RAW_MAX_SIDE` px, else encoded; whether ``auto`` chose it."""
    if cfg.encoding != "auto":
        return cfg.encoding, False
    return ("raw" if one_size and largest_side <= RAW_MAX_SIDE else "encoded"), True
