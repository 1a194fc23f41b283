"""The layout sparkdl writes when it materializes a DataFrame, on a real cluster: dense array
columns as float32 bytes (marked in Spark's own footer schema), read by both readers from one
copy; the same rows either way, and bad rows reported in the user's terms."""

from __future__ import annotations

import os

import pyarrow.parquet as pq
import pytest
import torch

import sparkdl
from sparkdl.data import cache

pytestmark = pytest.mark.spark


def _rows_by_id(ctx):
    """Every row rank 0 sees in one epoch, as {id: features}."""
    seen = {}
    for features, _ in ctx.epoch_batches():
        for row in features.tolist():
            seen[int(row[-1])] = row[:-1]
    return seen


def _new_cache_files(before):
    added = [url for url in cache.cached_urls() if url not in before]
    assert len(added) == 1, added
    root = added[0][len("file://") :]
    return [os.path.join(root, name) for name in sorted(os.listdir(root)) if name.endswith(".parquet")]


def _frame(spark, rows):
    return spark.createDataFrame(rows, "vec array<double>, ints array<int>, id long, label long")


def test_a_dataframe_is_written_as_float32_bytes_for_the_arrow_reader_and_reads_back_exactly(spark):
    rows = [([i * 0.5, -i * 1.0, i * 0.25], [i, i + 1], i, i % 2) for i in range(96)]
    before = cache.cached_urls()
    seen = sparkdl.run(
        _rows_by_id,
        num_workers=2,
        data=_frame(spark, rows),
        feature_cols=["vec", "ints", "id"],
        label_col="label",
        batch_size=8,
        shuffle=False,
        spark=spark,
        progress=False,
    )
    files = _new_cache_files(before)
    schema = pq.read_schema(files[0])
    assert str(schema.field("vec").type) == "binary" and str(schema.field("ints").type) == "binary"
    assert str(schema.field("id").type) == "int64"  # scalars stay as they are
    assert seen and all(seen[i] == pytest.approx(list(rows[i][0]) + [float(v) for v in rows[i][1]]) for i in seen)


def test_a_null_element_and_ragged_arrays_are_named_as_in_the_dataframe(spark):
    with_null = [([1.0, None, 3.0] if i == 3 else [1.0, 2.0, 3.0], [1, 2], i, i % 2) for i in range(64)]
    with pytest.raises((sparkdl.DataError, sparkdl.TrainingError)) as info:
        sparkdl.TorchEstimator(
            model=lambda: torch.nn.Linear(5, 2),
            feature_cols=["vec", "ints"],
            num_workers=2,
            batch_size=32,
            epochs=1,
            progress=False,
        ).fit(_frame(spark, with_null))
    assert "feature column(s) vec contain NaN or null values in the DataFrame" in str(info.value)
    ragged = [([1.0, 2.0, 3.0][: 2 + i % 2], [1, 2], i, i % 2) for i in range(64)]
    with pytest.raises((sparkdl.DataError, sparkdl.TrainingError)) as info:
        sparkdl.TorchEstimator(
            model=lambda: torch.nn.Linear(5, 2),
            feature_cols=["vec", "ints"],
            num_workers=2,
            batch_size=32,
            epochs=1,
            progress=False,
        ).fit(_frame(spark, ragged))
    assert "feature column 'vec' holds arrays of different lengths in the DataFrame (from 2 to 3)" in str(info.value)
    assert "sparkdl-cache" not in str(info.value)


@pytest.mark.petastorm
def test_the_petastorm_reader_reads_the_same_float32_bytes_and_shares_the_arrow_readers_copy(spark):
    rows = [([i * 0.5, -i * 1.0, i * 0.25], [i, i + 1], i, i % 2) for i in range(96)]
    frame = _frame(spark, rows)
    before = cache.cached_urls()
    seen = {}
    for reader in ("petastorm", "arrow"):
        seen[reader] = sparkdl.run(
            _rows_by_id,
            num_workers=2,
            data=frame,
            feature_cols=["vec", "ints", "id"],
            label_col="label",
            batch_size=8,
            shuffle=False,
            spark=spark,
            progress=False,
            reader=reader,
        )
    files = _new_cache_files(before)  # one copy: the second fit found the first one's
    schema = pq.read_schema(files[0])
    assert str(schema.field("vec").type) == "binary" and str(schema.field("ints").type) == "binary"
    assert seen["petastorm"] == seen["arrow"]
    assert seen["petastorm"] and all(
        seen["petastorm"][i] == pytest.approx(list(rows[i][0]) + [float(v) for v in rows[i][1]])
        for i in seen["petastorm"]
    )
