"""JPEGs of the wanted size decode through libjpeg-turbo (simplejpeg) into the batch, to the same
bytes Pillow gives; everything else still goes through Pillow with its errors."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image as PILImage

from sparkdl.data import pixels


def _photo(size: int, seed: int) -> np.ndarray:
    """Smooth gradients and noise: what makes chroma subsampling and upsampling matter."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:size, 0:size] / size
    base = np.stack([xx * 200, yy * 180, (xx + yy) * 90], axis=2)
    return np.clip(base + rng.normal(0, 25, base.shape), 0, 255).astype(np.uint8)


def _jpeg(array: np.ndarray, **options: object) -> bytes:
    out = io.BytesIO()
    PILImage.fromarray(array).save(out, format="JPEG", **options)
    return out.getvalue()


def _pillow(item: bytes, size: int, channels: int) -> np.ndarray:
    """What Pillow alone decodes: the reference the fast path must equal byte for byte."""
    picture = PILImage.open(io.BytesIO(item))
    picture = picture.convert("L" if channels == 1 else "RGB")
    if picture.size != (size, size):
        picture = picture.resize((size, size), PILImage.BILINEAR)
    array = np.asarray(picture)
    return array[:, :, None] if array.ndim == 2 else array


COLOUR_VARIANTS = {
    "4:2:0 q90": {"quality": 90, "subsampling": 2},
    "4:2:2 q75": {"quality": 75, "subsampling": 1},
    "4:4:4 q95": {"quality": 95, "subsampling": 0},
    "progressive": {"quality": 85, "progressive": True},
    "optimized huffman": {"quality": 60, "optimize": True},
}


@pytest.mark.parametrize("variant", sorted(COLOUR_VARIANTS))
def test_a_colour_jpeg_of_the_wanted_size_takes_the_fast_path_and_matches_pillow(variant: str) -> None:
    items = [_jpeg(_photo(24, seed), **COLOUR_VARIANTS[variant]) for seed in range(6)]
    row = np.empty((24, 24, 3), dtype=np.uint8)
    assert pixels.decode_jpeg_into(items[0], row, 3)
    batch = pixels.decoded_pixels(items, (24, 24), 3)
    np.testing.assert_array_equal(batch, np.stack([_pillow(item, 24, 3) for item in items]))


def test_a_grayscale_jpeg_decodes_fast_to_one_channel_and_to_three() -> None:
    gray = [_jpeg(_photo(16, seed)[:, :, 0]) for seed in range(4)]
    for channels in (1, 3):
        row = np.empty((16, 16, channels), dtype=np.uint8)
        assert pixels.decode_jpeg_into(gray[0], row, channels)
        batch = pixels.decoded_pixels(gray, (16, 16), channels)
        np.testing.assert_array_equal(batch, np.stack([_pillow(item, 16, channels) for item in gray]))


def test_what_the_fast_path_declines_goes_to_pillow_with_the_same_result() -> None:
    colour = _jpeg(_photo(16, 1))
    png = io.BytesIO()
    PILImage.fromarray(_photo(16, 2)).save(png, format="PNG")
    declined = {
        # libjpeg's luma of a colour JPEG is not Pillow's convert("L") (ITU-R 601-2 on RGB).
        "colour JPEG to one channel": (colour, 1),
        "another size (resized)": (_jpeg(_photo(28, 3)), 3),
        "a PNG": (png.getvalue(), 3),
    }
    for name, (item, channels) in declined.items():
        row = np.zeros((16, 16, channels), dtype=np.uint8)
        assert not pixels.decode_jpeg_into(item, row, channels), name
        np.testing.assert_array_equal(
            pixels.decoded_pixels([item], (16, 16), channels)[0], _pillow(item, 16, channels), err_msg=name
        )


def test_a_damaged_jpeg_is_declined_and_pillow_names_the_row() -> None:
    good = _jpeg(_photo(16, 4))
    truncated = good[: len(good) // 3]
    assert not pixels.decode_jpeg_into(truncated, np.empty((16, 16, 3), dtype=np.uint8), 3)
    with pytest.raises(pixels.ImageDecodeError) as raised:
        pixels.decoded_pixels([good, good, truncated], (16, 16), 3)
    assert raised.value.row == 2
    assert "truncated" in raised.value.reason.lower() or "OSError" in raised.value.reason


def test_threads_give_the_same_batch_as_one_thread() -> None:
    items = [_jpeg(_photo(20, seed)) for seed in range(9)]
    np.testing.assert_array_equal(
        pixels.decoded_pixels(items, (20, 20), 3, threads=3), pixels.decoded_pixels(items, (20, 20), 3, threads=1)
    )
