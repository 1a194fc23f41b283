"""Images as pixels: encoded images (or image arrays) decoded and resized to uint8 ``HWC``
arrays, on several threads, and the random crops of NCHW batches.

A JPEG already of the wanted size (the common case: a dataset stored at its training size)
is decoded by libjpeg-turbo through ``simplejpeg`` straight into the batch, when that is
installed: 3.5x faster than Pillow's ``open``/``load``/``asarray`` on a 64x64 JPEG, whose
per-image costs are Python (marker parsing, the image object, two copies), not the decode.
Both drive libjpeg with the same settings (accurate DCT, fancy upsampling), so the pixels are
the same bytes; anything else goes through Pillow.

:class:`sparkdl.Image <sparkdl.data.inputs.Image>` decodes with these in each batch's finish, or
once per row group for the shard cache, which keeps the pixels
(:meth:`~sparkdl.data.inputs.InputSpec.keep`).
"""

from __future__ import annotations

import concurrent.futures
import io
import typing as t

import numpy as np

try:
    import simplejpeg as _simplejpeg
except ImportError:  # an optional speed-up; Pillow decodes everything without it
    _simplejpeg = None


class ImageDecodeError(Exception):
    """Row ``row`` of a batch could not be decoded; ``reason`` says why (the caller names the row)."""

    def __init__(self, row: int, reason: str) -> None:
        super().__init__(reason)
        self.row = row
        self.reason = reason


def is_pixels(items: t.Any, size: t.Tuple[int, int], channels: int) -> bool:
    """Whether ``items`` are decoded pixels already: uint8 ``[rows, height, width, channels]``."""
    return isinstance(items, np.ndarray) and items.dtype == np.uint8 and items.shape[1:] == (*size, channels)


def decoded_pixels(items: t.Any, size: t.Tuple[int, int], channels: int, threads: int = 1) -> np.ndarray:
    """The rows' images decoded and resized to uint8 ``[rows, height, width, channels]`` on up to
    ``threads`` threads (Pillow decodes and resizes without the GIL); ``items`` as they are when
    they are pixels already (:func:`is_pixels`).

    Raises:
        ImageDecodeError: a row is no image, naming the first such row.
    """
    if is_pixels(items, size, channels):
        return items
    out = np.empty((len(items), *size, channels), dtype=np.uint8)

    def decode(rows: range) -> None:
        for row in rows:
            try:
                if not decode_jpeg_into(items[row], out[row], channels):
                    out[row] = decode_image(items[row], size, channels)
            except Exception as exc:  # noqa: BLE001 - Pillow raises many types for bad images
                raise ImageDecodeError(row, f"{type(exc).__name__}: {exc}") from exc

    parts = [range(start, len(items), threads) for start in range(max(1, min(threads, len(items))))]
    if len(parts) == 1:
        decode(parts[0])
        return out
    with concurrent.futures.ThreadPoolExecutor(len(parts), thread_name_prefix="sparkdl-pixels") as pool:
        failures = [exc for done in [pool.submit(decode, part) for part in parts] if (exc := done.exception())]
    if failures:
        raise min(failures, key=lambda exc: exc.row)
    return out


def decode_jpeg_into(item: t.Any, out: np.ndarray, channels: int) -> bool:
    """Whether ``item`` was a JPEG of exactly ``out``'s ``height x width`` and is now decoded into
    ``out`` (uint8 ``H x W x channels``, C-contiguous) by libjpeg-turbo; False (``out`` is then
    the caller's to fill) for everything else (no ``simplejpeg``, another format or size, a colour space
    whose conversion would differ from Pillow's, a damaged file), which :func:`decode_image`
    decodes or names what is wrong with.
    """
    if _simplejpeg is None or not isinstance(item, (bytes, bytearray)) or not _simplejpeg.is_jpeg(item):
        return False
    try:
        height, width, colorspace, _ = _simplejpeg.decode_jpeg_header(item)
        if (height, width) != out.shape[:2]:
            return False
        if channels == 3 and colorspace in ("YCbCr", "RGB", "Gray"):
            target = "RGB"
        elif channels == 1 and colorspace == "Gray":
            target = "GRAY"  # a colour JPEG's luma is not Pillow's convert("L"): that one goes to Pillow
        else:
            return False  # CMYK/YCCK: Pillow converts those
        _simplejpeg.decode_jpeg(item, colorspace=target, buffer=out)
    except ValueError:
        return False
    return True


def decode_image(item: t.Any, size: t.Tuple[int, int], channels: int) -> np.ndarray:
    """One image (encoded bytes or an ``HW``/``HWC`` array) as uint8 ``height x width x channels``."""
    from PIL import Image as PILImage

    height, width = size
    if isinstance(item, np.ndarray):
        array = item if item.ndim == 3 else item[:, :, None]
        if array.shape[2] not in (1, 3, 4):
            raise ValueError(f"an image array of shape {item.shape} has {array.shape[2]} channels")
        if array.shape[:2] == (height, width) and array.dtype == np.uint8:
            return convert_channels(array, channels)
        picture = PILImage.fromarray(array[:, :, 0] if array.shape[2] == 1 else array)
    else:
        picture = PILImage.open(io.BytesIO(item))
        if picture.format == "JPEG" and (picture.width >= 2 * width and picture.height >= 2 * height):
            # libjpeg decodes straight to a power-of-two smaller size: far less work.
            picture.draft("L" if channels == 1 else "RGB", (width, height))
        picture.load()
    mode = "L" if channels == 1 else "RGB"
    if picture.mode != mode:  # convert copies even to the same mode: 7 % of a small JPEG's decode
        picture = picture.convert(mode)
    if picture.size != (width, height):
        picture = picture.resize((width, height), PILImage.BILINEAR)
    array = np.asarray(picture)
    return array[:, :, None] if array.ndim == 2 else array


def convert_channels(array: np.ndarray, channels: int) -> np.ndarray:
    """A uint8 ``H x W x (1, 3 or 4)`` image with ``channels`` (1 or 3) channels."""
    have = array.shape[2]
    if have == channels:
        return array
    if channels == 3:
        return np.repeat(array, 3, axis=2) if have == 1 else array[:, :, :3]
    rgb = array[:, :, :3].astype(np.float32)
    # ITU-R 601-2 luma, as Pillow's convert("L").
    gray = rgb[:, :, 0] * 0.299 + rgb[:, :, 1] * 0.587 + rgb[:, :, 2] * 0.114
    return np.clip(np.rint(gray), 0, 255).astype(np.uint8)[:, :, None]


def random_crops(images: np.ndarray, padding: int, rng: np.random.Generator) -> np.ndarray:
    """Each image of an NCHW batch padded by ``padding`` zeros a side, then cropped back to its
    size at a random offset."""
    batch, channels, height, width = images.shape
    padded = np.zeros((batch, channels, height + 2 * padding, width + 2 * padding), dtype=images.dtype)
    padded[:, :, padding : padding + height, padding : padding + width] = images
    tops = rng.integers(0, 2 * padding + 1, batch)
    lefts = rng.integers(0, 2 * padding + 1, batch)
    out = np.empty_like(images)
    for i in range(batch):
        out[i] = padded[i, :, tops[i] : tops[i] + height, lefts[i] : lefts[i] + width]
    return out
