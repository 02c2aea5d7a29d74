"""One source image as the prepare stage stores it: orientation, modes, sizes, bytes kept or re-encoded."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from ddpipe.data import images
from ddpipe.data.images import BadImage


def _stored(path: Path, grey: bool = False, max_side: int = 512) -> tuple[bytes, np.ndarray]:
    blob, h, w = images.stored_bytes(path, grey, max_side, 90)
    pixels = np.asarray(Image.open(io.BytesIO(blob)))
    assert pixels.shape[:2] == (h, w)
    return blob, pixels


def _photo(w: int, h: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8))


def test_a_small_upright_jpeg_is_stored_byte_for_byte(tmp_path: Path) -> None:
    _photo(200, 120).save(tmp_path / "a.JPG", "JPEG", quality=90)
    blob, pixels = _stored(tmp_path / "a.JPG")
    assert blob == (tmp_path / "a.JPG").read_bytes() and pixels.shape == (120, 200, 3)
    assert images.probe(tmp_path / "a.JPG")[:3] == (200, 120, False)


def test_exif_orientation_is_applied(tmp_path: Path) -> None:
    x, y = np.meshgrid(np.linspace(0, 255, 200), np.linspace(0, 255, 100))
    im = Image.fromarray(np.stack([x, y, 255 - x], -1).astype(np.uint8))  # smooth: JPEG keeps it close
    exif = Image.Exif()
    exif[images.ORIENTATION] = 6  # rotate 90 degrees clockwise to display
    im.save(tmp_path / "turned.jpg", "JPEG", quality=95, exif=exif.tobytes())
    w, h, _, _ = images.probe(tmp_path / "turned.jpg")
    blob, pixels = _stored(tmp_path / "turned.jpg")
    assert (w, h) == (100, 200) and pixels.shape == (200, 100, 3)
    assert blob != (tmp_path / "turned.jpg").read_bytes()
    upright = np.asarray(im.transpose(Image.Transpose.ROTATE_270), dtype=np.float64)
    assert np.abs(pixels - upright).mean() < 3  # the same picture, turned (JPEG twice: not bit-equal)


def test_a_large_image_is_downscaled_with_its_aspect_ratio(tmp_path: Path) -> None:
    _photo(1000, 400).save(tmp_path / "wide.png")
    blob, pixels = _stored(tmp_path / "wide.png", max_side=500)
    assert pixels.shape == (200, 500, 3) and blob[:8] == b"\x89PNG\r\n\x1a\n"  # PNG stays lossless PNG
    _photo(1000, 400).save(tmp_path / "wide.jpg", quality=90)
    blob, pixels = _stored(tmp_path / "wide.jpg", max_side=500)
    assert pixels.shape == (200, 500, 3) and blob[:2] == b"\xff\xd8"  # a JPEG source stays JPEG


@pytest.mark.parametrize("mode, expect_grey", [("1", True), ("L", True), ("LA", True), ("I;16", True),
                                                ("P", False), ("RGBA", False), ("CMYK", False)])
def test_modes_become_8_bit_grey_or_rgb(tmp_path: Path, mode: str, expect_grey: bool) -> None:
    path = tmp_path / ("x.jpg" if mode == "CMYK" else "x.png")
    rgb = _photo(40, 30)
    if mode == "I;16":
        im = Image.fromarray(np.full((30, 40), 65535, dtype=np.uint16))
        assert im.mode.startswith("I;16")
    else:
        im = rgb.convert(mode)
    im.save(path)
    w, h, grey, sums = images.probe(path)
    assert (w, h, grey) == (40, 30, expect_grey)
    _, pixels = _stored(path, grey=grey)
    assert pixels.dtype == np.uint8 and pixels.shape == ((30, 40) if grey else (30, 40, 3))
    if mode == "I;16":
        assert pixels.min() == 255  # 16-bit white is 8-bit white, not clipped noise
    if mode != "CMYK":  # re-encoded lossless: the sums are the stored pixels' (a JPEG's are before encoding)
        assert sums[0].tolist() == (images.channel_sums(np.repeat(pixels[..., None], 3, -1)) if grey else
                                    images.channel_sums(pixels))[0].tolist()


def test_transparency_is_composited_on_white(tmp_path: Path) -> None:
    rgba = np.zeros((10, 10, 4), dtype=np.uint8)
    rgba[:5, :, :] = (255, 0, 0, 255)  # top half opaque red, bottom half transparent black
    Image.fromarray(rgba, "RGBA").save(tmp_path / "t.png")
    _, pixels = _stored(tmp_path / "t.png")
    assert pixels[0, 0].tolist() == [255, 0, 0] and pixels[9, 9].tolist() == [255, 255, 255]


def test_a_grey_image_in_a_colour_dataset_keeps_its_bytes(tmp_path: Path) -> None:
    _photo(50, 50).convert("L").save(tmp_path / "g.png")
    blob, _ = _stored(tmp_path / "g.png", grey=False)
    assert blob == (tmp_path / "g.png").read_bytes()  # decoders expand grey to RGB when reading


def test_undecodable_files_are_named(tmp_path: Path) -> None:
    _photo(300, 300).save(tmp_path / "whole.jpg", quality=90)
    data = (tmp_path / "whole.jpg").read_bytes()
    (tmp_path / "cut.jpg").write_bytes(data[: len(data) // 2])
    (tmp_path / "text.png").write_text("not an image")
    for name in ("cut.jpg", "text.png"):
        with pytest.raises(BadImage, match=f"{tmp_path / name}: cannot be decoded as an image"):
            images.probe(tmp_path / name)
    assert isinstance(images.probe_chunk([str(tmp_path / "cut.jpg")])[0], str)


def _png() -> bytes:
    out = io.BytesIO()
    _photo(300, 300).save(out, "PNG")
    return out.getvalue()


@pytest.mark.parametrize("name, content, words", [
    ("empty.jpg", b"", "the file is empty (0 bytes)"),
    ("notes.png", b"class list\ncat dog\n", "not an image but text (19 bytes, starting 'class list\\ncat dog\\n')"),
    ("page.jpg", b"<!DOCTYPE html><title>404</title>", "not an image but text"),
    ("noise.png", bytes(range(256)), "not an image: its first bytes match no image format"),
    ("cut.png", _png()[:50_000], "truncated: the PNG data ends before the image does (50,000 bytes)"),
    ("header.png", _png()[:8], "a damaged PNG file: its header is cut short or corrupt (8 bytes)"),
])
def test_an_undecodable_file_is_said_wrong_in_words(tmp_path: Path, name: str, content: bytes, words: str) -> None:
    """What is wrong with the file, in words, and never PIL's ``<_io.BytesIO object at 0x...>``."""
    (tmp_path / name).write_bytes(content)
    for read in (images.probe, lambda p: images.decode(p, grey=False)):
        with pytest.raises(BadImage) as bad:
            read(tmp_path / name)
        assert str(bad.value).startswith(f"{tmp_path / name}: cannot be decoded as an image: {words}")
        assert "BytesIO" not in str(bad.value) and " at 0x" not in str(bad.value)


def test_an_image_of_too_many_pixels_is_said_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """PIL refuses an image of more than twice MAX_IMAGE_PIXELS (a decompression bomb): said with both figures."""
    (tmp_path / "huge.png").write_bytes(_png())
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 20_000)
    with pytest.raises(BadImage, match=r"huge.png: cannot be decoded as an image: too many pixels \(90,000 pixels; "
                                       r"PIL decodes at most 40,000"):
        images.probe(tmp_path / "huge.png")


def test_sums_from_histograms_equal_sums_from_pixels() -> None:
    pixels = np.random.default_rng(0).integers(0, 256, size=(17, 23, 3), dtype=np.uint8)
    expected = pixels.reshape(-1, 3).astype(np.int64)
    assert images.channel_sums(pixels).tolist() == [expected.sum(0).tolist(), (expected ** 2).sum(0).tolist()]
    assert images.image_sums(Image.fromarray(pixels)).tolist() == images.channel_sums(pixels).tolist()
    mean, std = images.mean_std(images.channel_sums(pixels), 17 * 23)
    np.testing.assert_allclose(mean, (pixels / 255).reshape(-1, 3).mean(0), rtol=1e-12)
    np.testing.assert_allclose(std, (pixels / 255).reshape(-1, 3).std(0), rtol=1e-9)
