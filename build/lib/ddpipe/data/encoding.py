"""``data.encoding`` made concrete for the images the prepare stage found: raw pixels or encoded files."""

from __future__ import annotations

from ddpipe.config.schema import DataConfig

# Small images: at most this many px a side. data.encoding auto stores images of one such size as raw pixels (else
# encoded), and model.name auto gives inputs of at most this side ddpipe's small-image networks, whose stems keep
# full resolution (larger inputs get ImageNet's, whose stem shrinks an image 4x at once: ddpipe.engine.resolved).
SMALL_IMAGE_SIDE = 64


def data_encoding(cfg: DataConfig, one_size: bool, largest_side: int) -> tuple[str, bool]:
    """``data.encoding`` for images of one size or several (the largest side ``largest_side`` px): raw pixels for
    one size of at most :data:`SMALL_IMAGE_SIDE` px, else encoded; whether ``auto`` chose it."""
    if cfg.encoding != "auto":
        return cfg.encoding, False
    return ("raw" if one_size and largest_side <= SMALL_IMAGE_SIDE else "encoded"), True
