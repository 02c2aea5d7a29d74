"""A generated class-per-folder image set of real-world shape, for the data benchmarks.

    python bench/imageset.py OUT --images 10000 [--classes 10] [--seed 0]

JPEG (4 of 5, quality 85-95) and PNG files of 160-500 px a side (independent width and height), some with
upper-case suffixes, a few files that are not images. Each class is a shape (disc, square, triangle, ring,
cross, bars of three directions, checkers, dots) of random colour, size and place on a textured
background, so a network learns the classes and JPEG sizes are those of photographs (about 20-60 KB).
Deterministic per (seed, image number), written by every core.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

SHAPES = ("disc", "square", "triangle", "ring", "cross", "hbars", "vbars", "dbars", "checkers", "dots")


def _draw(rng: np.random.Generator, shape: str) -> Image.Image:
    w, h = (int(v) for v in rng.integers(160, 501, size=2))
    base = rng.integers(0, 256, size=(max(2, h // 40), max(2, w // 40), 3), dtype=np.uint8)
    im = Image.fromarray(base).resize((w, h), Image.Resampling.BICUBIC)
    grain = rng.normal(0, 12, size=(h, w, 3))
    im = Image.fromarray(np.clip(np.asarray(im, dtype=np.float64) + grain, 0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(im)
    side = int(min(w, h) * rng.uniform(0.35, 0.7))
    x0, y0 = int(rng.integers(0, w - side + 1)), int(rng.integers(0, h - side + 1))
    box, colour = (x0, y0, x0 + side, y0 + side), tuple(int(c) for c in rng.integers(0, 256, size=3))
    step = max(6, side // 6)
    if shape == "disc":
        draw.ellipse(box, fill=colour)
    elif shape == "square":
        draw.rectangle(box, fill=colour)
    elif shape == "triangle":
        draw.polygon([(x0, y0 + side), (x0 + side, y0 + side), (x0 + side // 2, y0)], fill=colour)
    elif shape == "ring":
        draw.ellipse(box, outline=colour, width=max(4, side // 8))
    elif shape == "cross":
        t = max(4, side // 6)
        draw.rectangle((x0 + side // 2 - t, y0, x0 + side // 2 + t, y0 + side), fill=colour)
        draw.rectangle((x0, y0 + side // 2 - t, x0 + side, y0 + side // 2 + t), fill=colour)
    elif shape in ("hbars", "vbars"):
        for k in range(0, side, 2 * step):
            draw.rectangle((x0, y0 + k, x0 + side, y0 + k + step) if shape == "hbars" else
                           (x0 + k, y0, x0 + k + step, y0 + side), fill=colour)
    elif shape == "dbars":
        for k in range(-side, side, 2 * step):
            draw.line((x0 + k, y0, x0 + k + side, y0 + side), fill=colour, width=step)
    elif shape == "checkers":
        for i in range(0, side, step):
            for j in range((i // step) % 2 * step, side, 2 * step):
                draw.rectangle((x0 + j, y0 + i, x0 + j + step, y0 + i + step), fill=colour)
    else:
        for _ in range(12):
            cx, cy = int(rng.integers(x0, x0 + side)), int(rng.integers(y0, y0 + side))
            draw.ellipse((cx - step // 2, cy - step // 2, cx + step // 2, cy + step // 2), fill=colour)
    return im.filter(ImageFilter.GaussianBlur(0.6))


def write_image(root: Path, number: int, classes: int, seed: int) -> None:
    """Image ``number`` of the set: its class is ``number % classes``."""
    rng = np.random.default_rng([seed, number])
    label = number % classes
    im = _draw(rng, SHAPES[label % len(SHAPES)])
    folder = root / f"class_{label:02d}"
    if rng.random() < 0.8:
        suffix = ".JPG" if number % 17 == 0 else ".jpg"
        im.save(folder / f"img_{number:07d}{suffix}", "JPEG", quality=int(rng.integers(85, 96)))
    else:
        im.save(folder / f"img_{number:07d}{'.PNG' if number % 13 == 0 else '.png'}", "PNG")


def _work(args: tuple[str, int, int, int, int]) -> None:
    root, start, stop, classes, seed = args
    for number in range(start, stop):
        write_image(Path(root), number, classes, seed)


def generate(root: Path, images: int, classes: int = 10, seed: int = 0) -> Path:
    """Write the set into ``root`` (class folders ``class_00`` ...), plus two files that are not images."""
    root = Path(root)
    for label in range(classes):
        (root / f"class_{label:02d}").mkdir(parents=True, exist_ok=True)
    (root / "class_00" / "notes.txt").write_text("not an image\n")
    (root / "class_01" / ".DS_Store").write_bytes(b"\0\0\0\1Bud1")
    chunks = [(str(root), a, min(a + 200, images), classes, seed) for a in range(0, images, 200)]
    if len(chunks) == 1:  # a small set (the tests'): no processes to start
        _work(chunks[0])
        return root
    with multiprocessing.get_context("spawn").Pool(len(os.sched_getaffinity(0))) as pool:
        pool.map(_work, chunks)
    return root


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--images", type=int, default=10000)
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    generate(a.out, a.images, a.classes, a.seed)
    print(f"{a.images} images in {a.classes} classes under {a.out}")


if __name__ == "__main__":
    main()
