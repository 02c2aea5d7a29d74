"""One source image, as the prepare stage takes it: probed, decoded, oriented, converted, re-encoded.

PIL and numpy only (no torch): the prepare stage's worker processes import this module and nothing
heavier. Every function takes a path and returns plain values, so a worker holds one image at a time.

What a stored image is: 8-bit grey (``L``) when every image of the dataset is grey, else 8-bit RGB;
EXIF orientation applied; transparency composited on white; 16-bit images scaled to 8 bits; palette,
CMYK and other modes converted. A JPEG or PNG file that is already such an image, upright and no larger
than ``data.max_side``, is stored byte for byte; any other is re-encoded, as JPEG (``data.jpeg_quality``)
when it came as a JPEG and as PNG (lossless) otherwise, downscaled first when its longer side exceeds
``data.max_side`` (aspect ratio kept).
"""

from __future__ import annotations

import io
import re
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

IMAGE_SUFFIXES = frozenset({".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff"})
GREY_MODES = frozenset({"1", "L", "LA", "I", "I;16", "I;16B", "I;16L", "I;16N", "F"})
ORIENTATION = 0x0112  # the EXIF tag
# zlib level of re-encoded PNGs: on 100 generated 160-500 px photos-like images (AMD EPYC), level 3 took 12.4 ms
# for 165 KB, PIL's default 6 took 27.0 ms for 149 KB
PNG_LEVEL = 3


class BadImage(Exception):
    """A file with an image suffix that cannot be decoded: the message names it and says in words what is wrong
    (empty, not an image, truncated, damaged, too many pixels)."""


def is_image_name(name: str) -> bool:
    return Path(name).suffix.lower() in IMAGE_SUFFIXES


def _open(path: str | Path, data: bytes) -> Image.Image:
    try:
        return Image.open(io.BytesIO(data))
    except Exception as exc:  # UnidentifiedImageError, DecompressionBombError, struct errors...
        raise BadImage(f"{path}: cannot be decoded as an image: {_why(data, exc)}") from None


# The first bytes of the formats in IMAGE_SUFFIXES: a file that starts so is a damaged image, not another kind of file
SIGNATURES = {b"\x89PNG\r\n\x1a\n": "PNG", b"\xff\xd8\xff": "JPEG", b"GIF87a": "GIF", b"GIF89a": "GIF",
              b"BM": "BMP", b"II*\x00": "TIFF", b"MM\x00*": "TIFF"}


def _format(data: bytes) -> str | None:
    """The image format ``data`` starts as, by its signature; None for none."""
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WebP"
    return next((name for magic, name in SIGNATURES.items() if data.startswith(magic)), None)


def _why(data: bytes, exc: Exception) -> str:
    """What is wrong with a file that PIL could not open or decode, in words (PIL's own messages name a BytesIO)."""
    if not data:
        return "the file is empty (0 bytes)"
    if isinstance(exc, Image.DecompressionBombError):
        found = re.search(r"\((\d+) pixels\)", str(exc))
        pixels = f"{int(found.group(1)):,} pixels" if found else "its size"
        return (f"too many pixels ({pixels}; PIL decodes at most {2 * (Image.MAX_IMAGE_PIXELS or 0):,}, its guard "
                "against decompression bombs)")
    kind = _format(data)
    if "truncated" in str(exc).lower():
        return f"truncated: the {kind or 'image'} data ends before the image does ({len(data):,} bytes)"
    if kind is None:
        head = data[:512]
        if all(b >= 32 or b in b"\t\n\r\f" for b in head):  # no control bytes: text (any UTF-8 too)
            return f"not an image but text ({len(data):,} bytes, starting {head[:32].decode('utf-8', 'replace')!r})"
        return f"not an image: its first bytes match no image format ({len(data):,} bytes, starting {data[:8]!r})"
    if isinstance(exc, UnidentifiedImageError):
        return f"a damaged {kind} file: its header is cut short or corrupt ({len(data):,} bytes)"
    detail = re.sub(r"\s*<[^<>]* at 0x[0-9a-fA-F]+>", "", str(exc))  # never an object's repr
    return f"a damaged {kind} file: its image data cannot be decoded ({detail or type(exc).__name__})"


def _orientation(im: Image.Image) -> int:
    try:
        return int(im.getexif().get(ORIENTATION, 1))
    except Exception:  # a corrupt EXIF block: treat as upright, as most viewers do
        return 1


def _load(path: str | Path, data: bytes, im: Image.Image) -> None:
    try:
        im.load()
    except Exception as exc:  # truncated data, bad CRC, unsupported compression
        raise BadImage(f"{path}: cannot be decoded as an image: {_why(data, exc)}") from None


def probe(path: str | Path) -> tuple[int, int, bool, np.ndarray]:
    """(width, height, grey, channel sums) of an image file as it will be stored (EXIF orientation
    applied), after decoding it whole, so that a truncated or corrupt file is found here. The sums
    (:func:`channel_sums`, int64 ``[2, 3]``) are of its pixels as stored, before any downscaling; a grey
    image's sums fill all three columns (its RGB form repeats it). BadImage if it cannot be decoded."""
    data = Path(path).read_bytes()
    im = _open(path, data)
    w, h = im.size
    grey = im.mode in GREY_MODES
    turned = _orientation(im) in (5, 6, 7, 8)
    _load(path, data, im)
    sums = image_sums(_as_stored_mode(im, grey))
    return (h, w, grey, np.repeat(sums, 3, axis=1) if grey else sums) if turned else \
        (w, h, grey, np.repeat(sums, 3, axis=1) if grey else sums)


def _sixteen_bit(im: Image.Image) -> bool:
    """A 16-bit-per-channel file that PIL opens as 8-bit RGB (its decoder's raw mode says so)."""
    return any("16" in str(tile[3]) for tile in im.tile or [])


def _as_stored_mode(im: Image.Image, grey: bool) -> Image.Image:
    """``im`` (loaded, upright) as 8-bit L (``grey``) or RGB."""
    if im.mode in ("I", "I;16", "I;16B", "I;16L", "I;16N", "F"):
        wide = np.asarray(im, dtype=np.float64)
        peak = 255.0 if im.mode == "F" or wide.max(initial=0) <= 255 else 65535.0
        im = Image.fromarray(np.clip(np.rint(wide * (255.0 / peak)), 0, 255).astype(np.uint8), mode="L")
    if im.mode in ("RGBA", "LA", "PA") or (im.mode == "P" and "transparency" in im.info):
        rgba = im.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        im = Image.alpha_composite(white, rgba)
    target = "L" if grey else "RGB"
    return im if im.mode == target else im.convert(target)


def _fit(size: tuple[int, int], max_side: int) -> tuple[int, int]:
    w, h = size
    scale = max_side / max(w, h)
    return max(1, round(w * scale)), max(1, round(h * scale))


def _as_is(im: Image.Image, grey: bool, max_side: int | None) -> bool:
    """Whether a file's bytes already are the stored image: a JPEG/PNG, upright, 8-bit L or RGB (L too for a
    colour dataset: the decoders expand it), no larger than ``max_side``. Reads the header only."""
    modes = ("L",) if grey else ("L", "RGB")
    return (im.format in ("JPEG", "PNG") and _orientation(im) == 1 and im.mode in modes
            and not _sixteen_bit(im) and (max_side is None or max(im.size) <= max_side))


def decode(path: str | Path, grey: bool, max_side: int | None = None) -> Image.Image:
    """The file decoded as it will be stored: upright, 8-bit L or RGB, its longer side at most ``max_side``."""
    data = Path(path).read_bytes()
    im = _open(path, data)
    if im.format == "JPEG" and max_side is not None and max(im.size) > max_side:
        im.draft(im.mode, _fit(im.size, max_side))  # decode at the smallest 1/2^k scale still >= the target
    _load(path, data, im)
    im = _as_stored_mode(ImageOps.exif_transpose(im), grey)
    if max_side is not None and max(im.size) > max_side:
        im = im.resize(_fit(im.size, max_side), Image.Resampling.LANCZOS, reducing_gap=3.0)
    return im


def stored_bytes(path: str | Path, grey: bool, max_side: int, quality: int) -> tuple[bytes, int, int]:
    """(the bytes to store, stored height, stored width) for one file: its own bytes when they already are
    the stored image (read, not decoded: :func:`probe` decoded it), else re-encoded, as JPEG (``quality``)
    when it came as a JPEG and as PNG otherwise."""
    data = Path(path).read_bytes()
    im = _open(path, data)
    if _as_is(im, grey, max_side):
        return data, im.size[1], im.size[0]
    source_format = im.format
    im = decode(path, grey, max_side)
    out = io.BytesIO()
    if source_format == "JPEG":
        im.save(out, "JPEG", quality=quality)
    else:
        im.save(out, "PNG", compress_level=PNG_LEVEL)
    return out.getvalue(), im.size[1], im.size[0]


def encode_array(pixels: np.ndarray) -> bytes:
    """A ``C x H x W`` uint8 array (an array dataset stored encoded) as PNG bytes."""
    im = Image.fromarray(pixels[0] if pixels.shape[0] == 1 else pixels.transpose(1, 2, 0))
    out = io.BytesIO()
    im.save(out, "PNG", compress_level=PNG_LEVEL)
    return out.getvalue()


def _hwc(im: Image.Image) -> np.ndarray:
    a = np.asarray(im, dtype=np.uint8)
    return a[:, :, None] if a.ndim == 2 else a


LEVELS = np.arange(256, dtype=np.int64)


def _from_histograms(hist: np.ndarray) -> np.ndarray:
    return np.stack([hist @ LEVELS, hist @ (LEVELS * LEVELS)])


def channel_sums(hwc: np.ndarray) -> np.ndarray:
    """int64 ``[2, C]``: per-channel sums of pixel values and of their squares, from a uint8 ``H x W x C``
    (or ``N x H x W x C``) array (exact integers, so the mean and std do not depend on how work was divided)."""
    flat = hwc.reshape(-1, hwc.shape[-1])
    return _from_histograms(np.stack([np.bincount(flat[:, c], minlength=256) for c in range(flat.shape[1])]))


def image_sums(im: Image.Image) -> np.ndarray:
    """:func:`channel_sums` of an 8-bit L or RGB PIL image, from PIL's histogram (a tenth of a millisecond)."""
    return _from_histograms(np.asarray(im.histogram(), dtype=np.int64).reshape(-1, 256))


def mean_std(sums: np.ndarray, pixels_per_channel: int) -> tuple[list[float], list[float]]:
    """Per-channel mean and std on the 0-1 scale from :func:`channel_sums` totals."""
    n = max(1, pixels_per_channel)
    mean = sums[0] / (255.0 * n)
    var = np.maximum(sums[1] / (255.0 ** 2 * n) - mean ** 2, 0.0)
    return mean.tolist(), np.maximum(np.sqrt(var), 1e-3).tolist()


# ---------------------------------------------------------------------------------------------
# Work for one chunk of files, in a prepare worker process


def probe_chunk(paths: list[str]) -> list[tuple[int, int, bool, np.ndarray] | str]:
    """:func:`probe` of each path; a BadImage's message in place of an undecodable file."""
    out: list[tuple[int, int, bool, np.ndarray] | str] = []
    for p in paths:
        try:
            out.append(probe(p))
        except BadImage as exc:
            out.append(str(exc))
    return out


def encode_chunk(paths: list[str], grey: bool, max_side: int, quality: int) -> tuple[list[bytes], np.ndarray]:
    """Each file's bytes to store (:func:`stored_bytes`) and their ``[n, 2]`` stored (height, width)."""
    blobs, sizes = [], np.zeros((len(paths), 2), dtype=np.int64)
    for i, p in enumerate(paths):
        blob, sizes[i, 0], sizes[i, 1] = stored_bytes(p, grey, max_side, quality)
        blobs.append(blob)
    return blobs, sizes


def pixels_chunk(paths: list[str], grey: bool) -> np.ndarray:
    """The files' pixels as ``[n, C, H, W]`` (one size for all: the raw encoding)."""
    return np.ascontiguousarray(np.stack([_hwc(decode(p, grey)) for p in paths]).transpose(0, 3, 1, 2))
