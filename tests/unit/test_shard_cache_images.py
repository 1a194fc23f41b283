"""The shard cache with image inputs, without Spark: images are kept as their decoded, resized
pixels, decoded once in the whole run, while random crops and flips still apply per pass; the
batches are those of a streamed run; the estimate counts pixels, not encoded bytes."""

from __future__ import annotations

import dataclasses
import itertools
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import sparkdl
from sparkdl.data import pixels, shard_cache
from sparkdl.data.batching import batches
from sparkdl.data.dataset import inspect_dataset
from sparkdl.data.plan import InputPlan
from sparkdl.data.readers.arrow import ArrowReader
from sparkdl.data.spec import DataSpec
from sparkdl.errors import DataError
from tests.models import png_bytes

ROWS, GROUP = 64, 16
SIZE = (8, 8)
BIG = 1 << 40


def _write(path, images, row_group_size=GROUP):
    os.makedirs(path, exist_ok=True)
    table = pa.table({"image": pa.array(images, pa.binary()), "label": np.arange(len(images))})
    pq.write_table(table, os.path.join(path, "part-0.parquet"), row_group_size=row_group_size)
    return str(path)


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    """PNGs of 10 x 12 pixels (resized to 8 x 8 when decoded), RGB and grayscale mixed."""
    rng = np.random.default_rng(4)
    shapes = [(10, 12, 3), (10, 12)]
    pictures = [png_bytes(rng.integers(0, 256, shapes[i % 2], dtype=np.uint8)) for i in range(ROWS)]
    return _write(tmp_path_factory.mktemp("images"), pictures)


def _info(path, **image):
    return inspect_dataset(path, InputPlan.from_inputs({"image": sparkdl.Image("image", size=SIZE, **image)}, "label"))


def _cached(spec: DataSpec, budget: int = BIG) -> DataSpec:
    return dataclasses.replace(spec, shard_cache=shard_cache.Decision("memory", budget, 0, budget, "test"))


def _take(reader, info, spec, count, rank=0, world_size=1):
    stream = batches(reader, info, spec, rank, world_size)
    try:
        return list(itertools.islice(stream, count))
    finally:
        stream.close()


@pytest.fixture
def decodes(monkeypatch):
    """Counts the images decoded (a wrapper around the real decoder, which still runs)."""
    calls = []
    real = pixels.decode_image

    def counted(item, size, channels):
        calls.append(item)
        return real(item, size, channels)

    monkeypatch.setattr(pixels, "decode_image", counted)
    return calls


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("world_size", [1, 2])
def test_cached_pixels_give_the_streamed_batches_crops_and_flips_included(images, threads, world_size):
    info = _info(images, random_crop=2, random_flip=True, mean=0.5, std=0.25)
    spec = DataSpec(batch_size=8, seed=9, shuffle_buffer_batches=2, decode_threads=threads)
    count = 5 * ROWS // (8 * world_size)  # five passes
    rank = world_size - 1
    streamed = _take(ArrowReader(), info, spec, count, rank, world_size)
    reader = ArrowReader()
    cached = _take(reader, info, _cached(spec), count, rank, world_size)
    assert len(streamed) == len(cached) == count
    for (a, la), (b, lb) in zip(streamed, cached):
        np.testing.assert_array_equal(a["image"], b["image"])
        np.testing.assert_array_equal(la, lb)
    # The augmentation still differs per pass: a row's two appearances are not one image.
    first = {
        int(label): image for (batch, labels) in cached[: count // 5] for label, image in zip(labels, batch["image"])
    }
    later = {
        int(label): image for (batch, labels) in cached[count // 5 :] for label, image in zip(labels, batch["image"])
    }
    assert any(not np.array_equal(first[row], later[row]) for row in first)
    stats = reader.shard_cache.stats()
    assert stats["images_decoded"] and stats["served_row_groups"] > 0 and stats["streamed_row_groups"] == 0
    # uint8 pixels of every kept row, plus the labels and positions.
    assert stats["held_bytes"] >= stats["rows"] * SIZE[0] * SIZE[1] * 3


def test_every_image_is_decoded_once_in_a_cached_run_and_every_pass_when_streaming(images, decodes):
    info = _info(images, random_flip=True)
    spec = DataSpec(batch_size=8, seed=2)
    passes = 4
    _take(ArrowReader(), info, _cached(spec), passes * ROWS // 8)
    assert len(decodes) == ROWS and len(set(decodes)) == ROWS  # each image once
    decodes.clear()
    _take(ArrowReader(), info, spec, passes * ROWS // 8)
    assert len(decodes) >= (passes - 1) * ROWS


def test_a_cache_too_small_for_the_pixels_streams_the_rest_with_the_same_batches(images):
    info = _info(images, random_crop=1)
    spec = DataSpec(batch_size=8, seed=6)
    streamed = _take(ArrowReader(), info, spec, 24)
    reader = ArrowReader()
    budget = 2 * GROUP * SIZE[0] * SIZE[1] * 3  # about two row groups of pixels
    cached = _take(reader, info, _cached(spec, budget), 24)
    for (a, _), (b, _) in zip(streamed, cached):
        np.testing.assert_array_equal(a["image"], b["image"])
    stats = reader.shard_cache.stats()
    assert stats["full"] and 0 < stats["row_groups"] < ROWS // GROUP and stats["streamed_row_groups"] > 0


def test_the_estimate_counts_images_as_their_pixels(tmp_path):
    rng = np.random.default_rng(0)
    small = [png_bytes(rng.integers(0, 256, (4, 4, 3), dtype=np.uint8)) for _ in range(ROWS)]
    path = _write(tmp_path, small)
    large = (64, 64)  # 12 kB of pixels a row, from PNGs of about 100 bytes
    info = inspect_dataset(path, InputPlan.from_inputs({"image": sparkdl.Image("image", size=large)}, "label"))
    estimate = shard_cache.rank_bytes(info, 0, 1)
    pixels = ROWS * large[0] * large[1] * 3
    assert pixels <= estimate <= 1.3 * pixels
    reader = ArrowReader()
    _take(reader, info, _cached(DataSpec(batch_size=8, shuffle=False)), ROWS // 8 + 1)
    held = reader.shard_cache.stats()["held_bytes"]
    assert 0.8 * held <= estimate <= 1.3 * held, (held, estimate)


def test_an_undecodable_image_in_a_cached_run_names_the_column_and_the_row_group(tmp_path):
    rng = np.random.default_rng(1)
    pictures = [png_bytes(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)) for _ in range(ROWS)]
    pictures[37] = b"not an image"
    path = _write(tmp_path, pictures)
    info = _info(path)
    with pytest.raises(DataError, match=r"input 'image' column 'image': cannot decode an image.*row group 2"):
        _take(ArrowReader(), info, _cached(DataSpec(batch_size=8, shuffle=False)), ROWS // 8)


def test_kept_bytes_count_the_objects_of_object_columns():
    strings = np.array([b"x" * 1000, b"y" * 2000], dtype=object)
    assert shard_cache.chunk_bytes({"text": strings}) >= 3000 + strings.nbytes
