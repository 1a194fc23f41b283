"""Dense arrays stored as float32 bytes (:mod:`sparkdl.data.tensor_bytes`): packing, the footer
mark, decoding, and the Arrow reader giving exactly the batches of the list layout — on real
Parquet files written with pyarrow (the Spark-written layout is checked in
``tests/integration/test_tensor_layout.py``)."""

from __future__ import annotations

import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from sparkdl.data.batching import batches
from sparkdl.data.dataset import inspect_dataset
from sparkdl.data.nonfinite import describe_non_finite
from sparkdl.data.readers import reader_from_name
from sparkdl.data.spec import DataSpec
from sparkdl.data.tensor_bytes import (
    pack_array,
    packed_columns,
    spark_footer_metadata,
    tensor_rows,
    tensor_rows_from_values,
)
from sparkdl.errors import DataError

WIDTH = 5


def _lists(rows: np.ndarray) -> pa.Array:
    return pa.array([list(map(float, row)) for row in rows], pa.list_(pa.float32()))


def _write(path: str, features: np.ndarray, layout: str, row_group: int = 16) -> str:
    os.makedirs(path, exist_ok=True)
    ids = np.arange(len(features), dtype=np.int64)
    column = _lists(features)
    table = pa.table({"features": column if layout == "list" else pack_array(column), "label": ids % 3, "id": ids})
    if layout == "packed":
        table = table.replace_schema_metadata(spark_footer_metadata(table.schema, ["features"]))
    half = len(features) // 2
    for index, part in enumerate((table.slice(0, half), table.slice(half))):
        pq.write_table(part, os.path.join(path, f"part-{index}.parquet"), row_group_size=row_group)
    return path


def test_pack_keeps_values_rows_and_nulls_of_a_sliced_array():
    array = pa.array([[1.0, 2.0], [3.0, None], None, [5.0, 6.0], [7.0, 8.0]], pa.list_(pa.float64()))
    packed = pack_array(array.slice(1, 3))
    assert packed.type == pa.binary() and len(packed) == 3 and packed.null_count == 1 and not packed[1].is_valid
    assert np.frombuffer(packed[0].as_py(), "<f4").tolist()[0] == 3.0 and np.isnan(
        np.frombuffer(packed[0].as_py(), "<f4")[1]
    )
    assert np.frombuffer(packed[2].as_py(), "<f4").tolist() == [5.0, 6.0]
    ints = pack_array(pa.array([[1, 2], [3, 4], [5, 6]], pa.list_(pa.int64())).slice(1))
    assert tensor_rows(ints, "f", "feature", "x").tolist() == [[3.0, 4.0], [5.0, 6.0]]


def test_decoding_is_a_view_of_the_bytes_and_checks_nulls_widths_and_empties():
    rows = np.arange(12, dtype=np.float32).reshape(4, 3)
    packed = pack_array(_lists(rows)).slice(1)
    decoded = tensor_rows(packed, "f", "feature", "the DataFrame")
    assert decoded.dtype == np.float32 and decoded.tolist() == rows[1:].tolist()
    assert not decoded.flags.owndata  # no copy
    with pytest.raises(DataError, match="feature column 'f' has 1 null values in the DataFrame"):
        tensor_rows(pack_array(pa.array([[1.0], None], pa.list_(pa.float32()))), "f", "feature", "the DataFrame")
    with pytest.raises(DataError, match=r"holds arrays of different lengths in the DataFrame \(from 1 to 2\)"):
        tensor_rows(pack_array(pa.array([[1.0], [1.0, 2.0]], pa.list_(pa.float32()))), "f", "feature", "the DataFrame")
    with pytest.raises(DataError, match="holds empty arrays"):
        tensor_rows(pack_array(pa.array([[], []], pa.list_(pa.float32()))), "f", "feature", "the DataFrame")


def test_the_footer_mark_is_read_from_the_spark_schema_only_for_binary_columns():
    schema = pa.schema([("features", pa.binary()), ("label", pa.int64())])
    marked = schema.with_metadata(spark_footer_metadata(schema, ["features", "label"]))
    assert packed_columns(marked) == {"features": "float32"}  # "label" is not bytes: not packed
    assert packed_columns(schema) == {}
    assert packed_columns(schema.with_metadata({b"org.apache.spark.sql.parquet.row.metadata": b"not json"})) == {}


@pytest.mark.parametrize("shuffle", [False, True])
def test_the_arrow_reader_gives_the_packed_layout_exactly_the_batches_of_the_list_layout(tmp_path, shuffle):
    features = np.random.default_rng(0).standard_normal((100, WIDTH)).astype(np.float32)
    as_lists = inspect_dataset(_write(str(tmp_path / "list"), features, "list"), ["features", "id"], "label")
    as_bytes = inspect_dataset(_write(str(tmp_path / "packed"), features, "packed"), ["features", "id"], "label")
    assert [i.packed for i in as_bytes.column_info] == [True, False, False]
    assert not any(i.packed for i in as_lists.column_info)
    spec = DataSpec(batch_size=8, shuffle=shuffle, seed=3, shuffle_buffer_batches=2)
    for rank in (0, 1):
        expected = batches(reader_from_name("arrow"), as_lists, spec, rank, 2)
        actual = batches(reader_from_name("arrow"), as_bytes, spec, rank, 2)
        for _ in range(20):  # more than a pass: the stream wraps around
            (x_list, y_list), (x_bytes, y_bytes) = next(expected), next(actual)
            assert np.array_equal(x_list, x_bytes) and np.array_equal(y_list, y_bytes)
            ids = x_bytes[:, WIDTH].astype(np.int64)
            assert np.array_equal(x_bytes[:, :WIDTH], features[ids])  # features and ids stay together
        expected.close()
        actual.close()


def test_a_nan_in_packed_data_is_found_by_column_row_group_and_row(tmp_path):
    features = np.ones((40, WIDTH), dtype=np.float32)
    features[21, 3] = np.nan  # file part-1 (rows 20..39), row group 0, row 1
    dataset = inspect_dataset(_write(str(tmp_path / "nan"), features, "packed", row_group=10), ["features"], "label")
    message = describe_non_finite(dataset)
    assert (
        message.startswith("column 'features' holds NaN at row 1 of row group 0 of file")
        and "part-1.parquet" in message
    )


def test_rows_handed_out_as_python_bytes_decode_like_the_arrow_column_and_are_checked_alike():
    rows = np.arange(12, dtype=np.float32).reshape(4, 3)
    as_objects = np.array([row.tobytes() for row in rows] + [None], dtype=object)
    assert tensor_rows_from_values(as_objects[:4], "f", "feature", "x").tolist() == rows.tolist()
    with pytest.raises(DataError, match="feature column 'f' has 1 null values in the DataFrame"):
        tensor_rows_from_values(as_objects, "f", "feature", "the DataFrame")
    ragged = np.array([rows[0].tobytes(), rows[1, :2].tobytes()], dtype=object)
    with pytest.raises(DataError, match=r"holds arrays of different lengths in the DataFrame \(from 2 to 3\)"):
        tensor_rows_from_values(ragged, "f", "feature", "the DataFrame")
    assert tensor_rows_from_values(np.array([], dtype=object), "f", "feature", "x").shape[0] == 0


@pytest.mark.petastorm
@pytest.mark.parametrize("shuffle", [False, True])
def test_the_petastorm_reader_gives_the_packed_layout_exactly_the_batches_of_the_list_layout(tmp_path, shuffle):
    features = np.random.default_rng(1).standard_normal((100, WIDTH)).astype(np.float32)
    as_lists = inspect_dataset(_write(str(tmp_path / "list"), features, "list"), ["features", "id"], "label")
    as_bytes = inspect_dataset(_write(str(tmp_path / "packed"), features, "packed"), ["features", "id"], "label")
    reader = reader_from_name("petastorm")
    reader.check(as_bytes)
    spec = DataSpec(batch_size=8, shuffle=shuffle, seed=3, shuffle_buffer_batches=2)
    for rank in (0, 1):
        expected = batches(reader_from_name("arrow"), as_lists, spec, rank, 2)
        actual = batches(reader, as_bytes, spec, rank, 2)
        for _ in range(20):  # more than a pass: the stream wraps around
            (x_list, y_list), (x_bytes, y_bytes) = next(expected), next(actual)
            assert np.array_equal(x_list, x_bytes) and np.array_equal(y_list, y_bytes)
            assert np.array_equal(x_bytes[:, :WIDTH], features[x_bytes[:, WIDTH].astype(np.int64)])
        expected.close()
        actual.close()
