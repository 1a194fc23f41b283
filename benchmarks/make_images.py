"""Synthetic JPEG images for the image-pipeline benchmark, as Parquet and as an ImageFolder tree.

``count`` RGB images of ``size`` x ``size`` pixels in 10 classes, each class a shape (disc,
square, triangle, stripes, ring) in a warm or cool colour, drawn at a random place and scale
over a random two-colour gradient with mild pixel noise, then JPEG-encoded by Pillow
(quality 90, a few KB at 64x64: about what a real photo thumbnail weighs). Image ``i`` depends
only on ``(seed, i)``, so the same arguments always give the same bytes. Labels are balanced
(``label = i % 10``).

The same JPEG bytes are written twice::

    <out>/parquet/part-00000.parquet ...    columns image (binary, the JPEG) and label (int64),
                                            ``--rows-per-file`` rows a file, row groups of
                                            ``--row-group-rows`` rows, snappy
    <out>/folder/<label>/<i>.jpg            torchvision.datasets.ImageFolder layout
    <out>/manifest.json                     the parameters, written last

A second call with the same parameters finds ``manifest.json`` and does nothing; other
parameters (or a half-written tree without the manifest) regenerate everything::

    .venv/bin/python benchmarks/make_images.py [--count 20000] [--size 64] [--out DIR]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import tempfile
from typing import Any, Dict, Iterator, Tuple

import numpy as np

CLASSES = 10
SHAPES = ("disc", "square", "triangle", "stripes", "ring")
#: Foreground hues per class family: classes 0-4 warm, 5-9 cool (jittered per image).
PALETTES = (np.array([220.0, 90.0, 40.0]), np.array([40.0, 120.0, 220.0]))
FORMAT_VERSION = 1


def default_out(count: int = 20_000, size: int = 64) -> str:
    """Where the benchmark looks for the images unless told otherwise (outside the checkout)."""
    return os.path.join(tempfile.gettempdir(), "sparkdl-bench", f"images-{count}-{size}px")


def draw(index: int, size: int = 64, seed: int = 0) -> Tuple[np.ndarray, int]:
    """Image ``index`` as ``uint8 [size, size, 3]`` and its label; deterministic in (seed, index)."""
    rng = np.random.default_rng([seed, index])
    label = index % CLASSES
    shape, palette = SHAPES[label % len(SHAPES)], PALETTES[label // len(SHAPES)]
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32) / (size - 1)
    # Background: a gradient between two random muted colours in a random direction.
    angle = rng.uniform(0, 2 * np.pi)
    ramp = np.clip(0.5 + (xx - 0.5) * np.cos(angle) + (yy - 0.5) * np.sin(angle), 0, 1)[..., None]
    low, high = rng.uniform(30, 200, 3), rng.uniform(30, 200, 3)
    image = low + (high - low) * ramp
    # Foreground: the class's shape in the class's colour, jittered in place, scale and hue.
    cx, cy = rng.uniform(0.3, 0.7, 2)
    radius = rng.uniform(0.15, 0.3)
    dx, dy = xx - cx, yy - cy
    if shape == "disc":
        mask = dx**2 + dy**2 <= radius**2
    elif shape == "square":
        mask = (np.abs(dx) <= radius) & (np.abs(dy) <= radius)
    elif shape == "triangle":
        mask = (dy <= radius) & (dy >= -radius + 2 * np.abs(dx))
    elif shape == "stripes":
        period = rng.uniform(0.12, 0.22)
        mask = (np.abs(dx) <= 1.5 * radius) & (np.abs(dy) <= 1.5 * radius) & ((xx / period) % 1.0 < 0.5)
    else:  # ring
        distance = np.sqrt(dx**2 + dy**2)
        mask = (distance <= radius) & (distance >= 0.55 * radius)
    colour = np.clip(palette + rng.normal(0, 25, 3), 0, 255)
    shade = 0.75 + 0.25 * (1 - ramp)  # a little lighting so the shape is not flat
    image = np.where(mask[..., None], colour * shade, image)
    image += rng.normal(0, 9, image.shape)  # sensor-like noise: realistic JPEG sizes
    return np.clip(image, 0, 255).astype(np.uint8), label


def encode(pixels: np.ndarray, quality: int = 90) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buffer, format="JPEG", quality=quality)
    return buffer.getvalue()


def images(count: int, size: int = 64, seed: int = 0, quality: int = 90) -> Iterator[Tuple[int, bytes, int]]:
    """``(index, jpeg_bytes, label)`` for images 0..count-1."""
    for index in range(count):
        pixels, label = draw(index, size, seed)
        yield index, encode(pixels, quality), label


def generate(
    out: str,
    count: int = 20_000,
    size: int = 64,
    seed: int = 0,
    quality: int = 90,
    rows_per_file: int = 5_000,
    row_group_rows: int = 1_000,
    verbose: bool = True,
) -> Dict[str, Any]:
    """Writes ``out/parquet``, ``out/folder`` and ``out/manifest.json``; returns the manifest.

    Does nothing (and returns the stored manifest) when ``out/manifest.json`` already records
    the same parameters."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    params = {
        "format": FORMAT_VERSION,
        "count": count,
        "size": size,
        "seed": seed,
        "quality": quality,
        "rows_per_file": rows_per_file,
        "row_group_rows": row_group_rows,
        "classes": CLASSES,
    }
    marker = os.path.join(out, "manifest.json")
    parquet_dir, folder_dir = os.path.join(out, "parquet"), os.path.join(out, "folder")
    if os.path.exists(marker):
        with open(marker) as f:
            stored = json.load(f)
        if stored.get("params") == params:
            if verbose:
                print(f"images already in {out} ({count:,} x {size}x{size}); nothing to do")
            return {**stored, "parquet": parquet_dir, "folder": folder_dir}  # the folder may have moved
    for path in (marker, parquet_dir, folder_dir):
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.exists(path):
            os.remove(path)
    os.makedirs(parquet_dir)
    for label in range(CLASSES):
        os.makedirs(os.path.join(folder_dir, str(label)))

    total_bytes, files = 0, 0
    rows: list = []

    def flush() -> None:
        nonlocal files
        table = pa.table(
            {
                "image": pa.array([r[1] for r in rows], type=pa.binary()),
                "label": pa.array([r[2] for r in rows], type=pa.int64()),
            }
        )
        pq.write_table(
            table,
            os.path.join(parquet_dir, f"part-{files:05d}.parquet"),
            row_group_size=row_group_rows,
            compression="snappy",
        )
        files += 1
        rows.clear()

    for index, jpeg, label in images(count, size, seed, quality):
        with open(os.path.join(folder_dir, str(label), f"{index:06d}.jpg"), "wb") as f:
            f.write(jpeg)
        total_bytes += len(jpeg)
        rows.append((index, jpeg, label))
        if len(rows) == rows_per_file:
            flush()
        if verbose and (index + 1) % 5_000 == 0:
            print(f"  {index + 1:,} / {count:,} images")
    if rows:
        flush()
    manifest = {
        "params": params,
        "parquet": parquet_dir,
        "folder": folder_dir,
        "files": files,
        "mean_jpeg_bytes": total_bytes / max(count, 1),
    }
    with open(marker + ".tmp", "w") as f:
        json.dump(manifest, f, indent=2)
    os.replace(marker + ".tmp", marker)
    if verbose:
        print(
            f"wrote {count:,} JPEGs of {size}x{size} (mean {manifest['mean_jpeg_bytes'] / 1024:.1f} KiB) to {out}: "
            f"{files} Parquet files, row groups of {row_group_rows:,}, and an ImageFolder tree"
        )
    return manifest


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=20_000)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--out", default=None, help="default: <tmp>/sparkdl-bench/images-<count>-<size>px")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quality", type=int, default=90)
    parser.add_argument("--rows-per-file", type=int, default=5_000)
    parser.add_argument("--row-group-rows", type=int, default=1_000)
    args = parser.parse_args(argv)
    generate(
        args.out or default_out(args.count, args.size),
        args.count,
        args.size,
        args.seed,
        args.quality,
        args.rows_per_file,
        args.row_group_rows,
    )


if __name__ == "__main__":
    main()
