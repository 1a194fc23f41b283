"""Bad data fails with the file or column named — on the driver, before launch, where the
footers can tell; otherwise when the reader meets it (both readers)."""

from __future__ import annotations

import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from sparkdl._driver.prepare_data import prepare_data
from sparkdl._driver.settings import DataSettings
from sparkdl.data.dataset import inspect_dataset
from sparkdl.data.readers import reader_from_name
from sparkdl.data.spec import DataSpec
from sparkdl.errors import ConfigError, DataError
from tests.models import pairs

READERS = [pytest.param("petastorm", marks=pytest.mark.petastorm), "arrow"]


def write(path, file_name, **columns):
    os.makedirs(path, exist_ok=True)
    pq.write_table(pa.table(columns), os.path.join(path, file_name), row_group_size=16)
    return str(path)


def vectors(rows, width=4, value=1.0):
    return pa.array(list(np.full((rows, width), value, dtype=np.float32)), type=pa.list_(pa.float32()))


def read_all(reader_name, path, features=("f",), label="label", filters=None):
    info = inspect_dataset(path, list(features), label, filters=filters)
    return pairs(reader_from_name(reader_name).read_pass(info, DataSpec(batch_size=8, filters=filters), 0, 1, 0))


def test_a_column_with_another_type_in_one_file_names_the_column_and_both_files(tmp_path):
    write(tmp_path, "part-0.parquet", f=vectors(32), label=np.zeros(32, dtype=np.int64))
    write(tmp_path, "part-1.parquet", f=vectors(32), label=np.array(["a"] * 32))
    with pytest.raises(DataError) as info:
        inspect_dataset(str(tmp_path), ["f"], "label")
    message = str(info.value)
    assert "schema mismatch" in message and "column 'label' is string in file" in message
    assert "part-1.parquet" in message and "but int64 in" in message and "part-0.parquet" in message


def test_a_column_missing_from_one_file_is_named(tmp_path):
    write(tmp_path, "part-0.parquet", f=vectors(32), label=np.zeros(32, dtype=np.int64))
    write(tmp_path, "part-1.parquet", g=vectors(32), label=np.zeros(32, dtype=np.int64))
    with pytest.raises(
        DataError, match="column 'f' is missing from file .*part-1.parquet.* but present in .*part-0.parquet"
    ):
        inspect_dataset(str(tmp_path), ["f"], "label")


def test_list_element_names_and_unused_columns_do_not_count_as_mismatches(tmp_path):
    spark_style = pa.list_(pa.field("element", pa.float32()))
    write(tmp_path, "part-0.parquet", f=vectors(32), label=np.zeros(32, dtype=np.int64), extra=np.zeros(32))
    write(
        tmp_path,
        "part-1.parquet",
        f=pa.array(list(np.ones((32, 4), dtype=np.float32)), type=spark_style),
        label=np.zeros(32, dtype=np.int64),
        extra=np.array(["x"] * 32),
    )
    assert inspect_dataset(str(tmp_path), ["f"], "label").num_rows == 64


def test_null_features_are_found_in_the_footers_before_training(tmp_path):
    values = np.arange(32, dtype=np.float64)
    write(tmp_path, "part-0.parquet", x=pa.array(values, mask=values == 5), label=np.zeros(32, dtype=np.int64))
    with pytest.raises(
        DataError, match="feature column 'x' has 1 null values in file .*part-0.parquet.* \\(row group 0\\)"
    ):
        inspect_dataset(str(tmp_path), ["x"], "label")


def test_null_or_empty_arrays_are_found_in_the_footers(tmp_path):
    f = pa.array([[1.0, 2.0]] * 20 + [[]] + [[1.0, 2.0]] * 11, type=pa.list_(pa.float32()))
    write(tmp_path, "part-0.parquet", f=f, label=np.zeros(32, dtype=np.int64))
    with pytest.raises(
        DataError, match="feature column 'f' has 1 null values, null arrays or empty arrays in file .*row group 1"
    ):
        inspect_dataset(str(tmp_path), ["f"], "label")


@pytest.mark.parametrize("reader_name", READERS)
def test_nulls_in_rows_the_filter_keeps_fail_when_read(tmp_path, reader_name):
    """With a filter the footer check is skipped (the nulls may be filtered out); the reader
    still refuses nulls that pass it."""
    values = np.arange(32, dtype=np.float64)
    write(tmp_path, "part-0.parquet", x=pa.array(values, mask=values == 5), label=np.zeros(32, dtype=np.int64))
    assert sum(len(f) for f, _ in read_all(reader_name, str(tmp_path), ["x"], filters=[("x", ">", 10)])) == 21
    with pytest.raises(DataError, match="column.*x.* (null|NaN)"):
        read_all(reader_name, str(tmp_path), ["x"], filters=[("label", "==", 0)])


@pytest.mark.parametrize("reader_name", READERS)
def test_nan_features_name_the_column(tmp_path, reader_name):
    x = np.ones((32, 4), dtype=np.float32)
    x[20, 1] = np.nan
    write(
        tmp_path, "part-0.parquet", f=pa.array(list(x), type=pa.list_(pa.float32())), label=np.zeros(32, dtype=np.int64)
    )
    expected = "row group 1 of file .*part-0.parquet"  # both readers know where each row came from
    with pytest.raises(DataError, match=f"feature column\\(s\\) f contain NaN or null values in {expected}"):
        read_all(reader_name, str(tmp_path))


@pytest.mark.parametrize("reader_name", READERS)
def test_nan_labels_name_the_column(tmp_path, reader_name):
    labels = np.zeros(32)
    labels[3] = np.nan
    write(tmp_path, "part-0.parquet", f=vectors(32), label=labels)
    with pytest.raises(DataError, match="label column label contains NaN or null values"):
        read_all(reader_name, str(tmp_path))


@pytest.mark.parametrize("reader_name", READERS)
def test_arrays_of_different_lengths_name_the_column(tmp_path, reader_name):
    f = pa.array([[1.0, 2.0]] * 30 + [[1.0, 2.0, 3.0]] * 2, type=pa.list_(pa.float32()))
    write(tmp_path, "part-0.parquet", f=f, label=np.zeros(32, dtype=np.int64))
    pattern = (
        "column 'f' holds arrays of different lengths"
        if reader_name == "arrow"
        else "Length of all values in column 'f'"
    )
    with pytest.raises((DataError, RuntimeError), match=pattern):
        read_all(reader_name, str(tmp_path))


def test_non_numeric_feature_and_wrong_label_type_are_named(tmp_path):
    write(
        tmp_path,
        "part-0.parquet",
        f=vectors(32),
        name=np.array(["a"] * 32),
        label=np.array(["cat"] * 32),
        nested=pa.array([[[1.0]]] * 32, type=pa.list_(pa.list_(pa.float64()))),
    )
    with pytest.raises(DataError, match="feature column 'name' has type string, which is not numeric"):
        inspect_dataset(str(tmp_path), ["name"], None)
    with pytest.raises(
        DataError, match="label column 'label' has type string, which is not numeric; labels must be numbers"
    ):
        inspect_dataset(str(tmp_path), ["f"], "label")
    with pytest.raises(
        DataError, match="feature column 'nested' has type list<.*list<.*double>>, which is not numeric"
    ):
        inspect_dataset(str(tmp_path), ["nested"], None)


def test_a_corrupt_footer_is_named_on_the_driver(tmp_path):
    write(tmp_path, "part-0.parquet", f=vectors(32), label=np.zeros(32, dtype=np.int64))
    with open(tmp_path / "part-1.parquet", "wb") as handle:
        handle.write(b"PAR1 not really parquet")
    with pytest.raises(DataError, match="part-1.parquet"):
        inspect_dataset(str(tmp_path), ["f"], "label")


def test_corrupt_data_pages_name_the_file_and_row_group_when_read(tmp_path):
    """A valid footer over damaged pages passes the driver's checks; the Arrow reader names the
    file and row group it could not decode."""
    rng = np.random.default_rng(0)
    path = write(tmp_path, "part-0.parquet", x=rng.standard_normal(64), label=np.zeros(64, dtype=np.int64))
    file = os.path.join(path, "part-0.parquet")
    metadata = pq.ParquetFile(file).metadata
    column = metadata.row_group(2).column(0)
    with open(file, "r+b") as handle:  # overwrite the page data of row group 2's first column
        handle.seek(column.data_page_offset)
        handle.write(b"\xff" * column.total_compressed_size)
    info = inspect_dataset(path, ["x"], "label")
    with pytest.raises(DataError, match="cannot read row group 2 of Parquet file .*part-0.parquet"):
        list(reader_from_name("arrow").read_pass(info, DataSpec(batch_size=8, shuffle=False), 0, 1, 0))


def test_an_empty_shard_fails_before_launch_naming_the_rank(tmp_path):
    # Two row groups; the filter leaves rows only in row group 0, so rank 1 would read nothing.
    write(tmp_path, "part-0.parquet", x=np.arange(32, dtype=np.float64), label=np.zeros(32, dtype=np.int64))
    with pytest.raises(
        DataError,
        match="the shard of rank\\(s\\) 1 in dataset .* holds no rows that pass the filters \\(rows per rank: \\[10, 0\\]\\)",
    ):
        prepare_data(
            str(tmp_path),
            DataSettings(feature_cols=["x"], label_col="label", batch_size=2, filters=[("x", "<", 10)]),
            num_workers=2,
        )


def test_filters_or_validation_that_select_nothing_fail_before_launch(tmp_path):
    write(tmp_path, "part-0.parquet", x=np.arange(32, dtype=np.float64), label=np.zeros(32, dtype=np.int64))
    with pytest.raises(DataError, match="holds no rows that pass the filters"):
        prepare_data(
            str(tmp_path),
            DataSettings(feature_cols=["x"], label_col="label", batch_size=2, filters=[("x", ">", 99)]),
            num_workers=1,
        )
    with pytest.raises(DataError, match="the validation data .* holds no rows"):
        prepare_data(
            str(tmp_path),
            DataSettings(feature_cols=["x"], label_col="label", batch_size=2, validation=0.001),
            num_workers=1,
        )


def test_validation_and_metrics_arguments_are_checked(tmp_path):
    path = write(tmp_path, "part-0.parquet", x=np.arange(64, dtype=np.float64), label=np.zeros(64, dtype=np.int64))
    common = dict(feature_cols=["x"], label_col="label", batch_size=4)
    with pytest.raises(ConfigError, match="metrics= are computed on validation data: pass validation= as well"):
        DataSettings(metrics={"acc": lambda output, label: 1.0}, **common)
    with pytest.raises(ConfigError, match="validation=1.5: a fraction of the rows must be in \\(0, 1\\)"):
        DataSettings(validation=1.5, **common)
    with pytest.raises(ConfigError, match="metrics=.* must map names to functions"):
        DataSettings(validation=0.2, metrics={"acc": 3}, **common)
    dataset, spec, reader, steps = prepare_data(
        path,
        DataSettings(validation=0.25, metrics={"acc": lambda output, label: 1.0}, reader="arrow", **common),
        num_workers=1,
    )
    assert spec.holdout == 0.25 and [name for name, _ in spec.validation.metrics] == ["acc"]
    assert (
        steps
        == (64 - sum(__import__("sparkdl.data.selection", fromlist=["x"]).shard_rows(dataset, 1, 0.25, "holdout"))) // 4
    )


def test_a_nan_in_the_data_is_found_and_named_by_column_row_group_and_row(tmp_path):
    import dataclasses

    from sparkdl.data.nonfinite import describe_non_finite

    features = np.arange(48, dtype=np.float32).reshape(24, 2)
    features[19, 1] = np.nan
    table = pa.table(
        {
            "v": pa.array(list(features), type=pa.list_(pa.float32())),
            "w": np.ones(24),
            "label": np.zeros(24, dtype=np.int64),
        }
    )
    pq.write_table(table, tmp_path / "part-0.parquet", row_group_size=8)
    info = inspect_dataset(str(tmp_path), ["v", "w"], "label")
    message = describe_non_finite(info)
    assert message.startswith("column 'v' holds NaN at row 3 of row group 2 of file ") and "part-0.parquet" in message
    # A DataFrame's copy is named as the DataFrame: its internal path never appears.
    as_dataframe = describe_non_finite(dataclasses.replace(info, origin="the DataFrame"))
    assert as_dataframe.startswith("column 'v' of the DataFrame holds NaN values") and "parquet" not in as_dataframe

    table = table.set_column(0, "v", pa.array(list(np.ones((24, 2), dtype=np.float32)), type=pa.list_(pa.float32())))
    table = table.set_column(1, "w", pa.array(np.where(np.arange(24) == 5, np.inf, 1.0)))
    pq.write_table(table, tmp_path / "part-0.parquet", row_group_size=8)
    assert describe_non_finite(inspect_dataset(str(tmp_path), ["v", "w"], "label")).startswith(
        "column 'w' holds infinite at row 5 of row group 0"
    )
    pq.write_table(table.set_column(1, "w", pa.array(np.ones(24))), tmp_path / "part-0.parquet", row_group_size=8)
    assert "hold no NaN or infinity: the model or the optimizer diverged" in describe_non_finite(
        inspect_dataset(str(tmp_path), ["v", "w"], "label")
    )


def test_uneven_shards_are_warned_of_naming_the_rows_per_rank_and_the_remedy(tmp_path, caplog):
    """Row groups of 16 and 2 rows on two ranks: rank 1's 2 rows are trained on 8x as often as
    rank 0's 16 (the same steps per epoch on every rank). A warning, not an error; even shards
    get none."""
    uneven = write(
        tmp_path / "uneven", "part-0.parquet", x=np.arange(18, dtype=np.float64), label=np.zeros(18, dtype=np.int64)
    )
    settings = DataSettings(feature_cols=["x"], label_col="label", batch_size=2)
    with caplog.at_level("WARNING", logger="sparkdl.data"):
        prepare_data(uneven, settings, num_workers=2)
    [record] = [r for r in caplog.records if "uneven" in r.getMessage()]
    message = record.getMessage()
    assert "rows per rank: [16, 2]" in message and "rank 1's rows are trained on 8.0x as often as rank 0's" in message
    assert "uneven" in message and "more row groups of even size" in message and "as a DataFrame" in message
    caplog.clear()
    even = write(
        tmp_path / "even", "part-0.parquet", x=np.arange(32, dtype=np.float64), label=np.zeros(32, dtype=np.int64)
    )
    with caplog.at_level("WARNING", logger="sparkdl.data"):
        prepare_data(even, settings, num_workers=2)
    assert not [r for r in caplog.records if "uneven" in r.getMessage()]
