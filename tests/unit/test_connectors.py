"""Connectors that need no Spark: Parquet paths and globs, and real Delta tables (delta-rs)."""

from __future__ import annotations

import datetime
import os
import pathlib
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from deltalake import DeltaTable, write_deltalake

from sparkdl import connectors
from sparkdl._driver.prepare_data import prepare_data, prepare_dataset
from sparkdl._driver.settings import DataSettings
from sparkdl.data.dataset import ParquetFiles, inspect_dataset
from sparkdl.data.readers import reader_from_name
from sparkdl.data.spec import DataSpec
from sparkdl.errors import ConfigError, DataError
from tests.models import pairs

REPO_ROOT = str(pathlib.Path(__file__).resolve().parents[2])


def ids_table(start, count):
    ids = np.arange(start, start + count)
    return pa.table(
        {
            "features": pa.array(list(np.stack([ids, -ids], 1).astype(np.float32)), type=pa.list_(pa.float32())),
            "label": ids % 2,
            "day": np.array(["mon", "tue"])[ids % 2],
        }
    )


def read_ids(info, reader_name="arrow", world_size=1, filters=None):
    ids = []
    for rank in range(world_size):
        spec = DataSpec(batch_size=8, shuffle=False, filters=filters)
        for features, _ in pairs(reader_from_name(reader_name).read_pass(info, spec, rank, world_size, 0)):
            ids += features[:, 0].astype(int).tolist()
    return sorted(ids)


# ---- Parquet -------------------------------------------------------------------------------


def test_parquet_source_directory_file_list_and_glob(tmp_path):
    for index, day in enumerate(["2024-01-01", "2024-01-02", "2024-02-01"]):
        os.makedirs(tmp_path / day)
        pq.write_table(ids_table(index * 10, 10), tmp_path / day / "part-0.parquet")
    pq.write_table(ids_table(100, 10), tmp_path / "2024-01-01" / "notes.parquet")

    whole = connectors.ParquetSource(str(tmp_path)).resolve()
    assert whole == ParquetFiles(url=f"file://{tmp_path}", description=f"Parquet at file://{tmp_path}")
    assert inspect_dataset(whole, ["features"], "label").num_rows == 40

    january = connectors.ParquetSource(f"{tmp_path}/2024-01-*/part-*.parquet").resolve()
    assert january.files == (
        f"file://{tmp_path}/2024-01-01/part-0.parquet",
        f"file://{tmp_path}/2024-01-02/part-0.parquet",
    )
    info = prepare_dataset(
        connectors.ParquetSource(f"{tmp_path}/2024-01-*/part-*.parquet"), ["features"], num_workers=2, label_col="label"
    )
    assert info.explicit_files and read_ids(info, world_size=2) == list(range(20))

    listed = connectors.ParquetSource([f"{tmp_path}/2024-02-01/part-0.parquet", f"{tmp_path}/2024-01-01/notes.parquet"])
    info = inspect_dataset(listed.resolve(), ["features"], "label")
    # An explicit list is read in its own order: that order decides the row groups' ranks.
    assert [f.url.rsplit("/", 2)[-2] for f in info.files] == ["2024-02-01", "2024-01-01"]
    assert read_ids(info) == list(range(20, 30)) + list(range(100, 110))

    with pytest.raises(DataError, match="no files match"):
        connectors.ParquetSource(f"{tmp_path}/2025-*/*.parquet").resolve()


# ---- Delta ---------------------------------------------------------------------------------


@pytest.fixture()
def delta_table(tmp_path):
    """A real Delta table with three versions: create (0-99), append (100-149), overwrite (500-519)."""
    path = str(tmp_path / "delta")
    write_deltalake(path, ids_table(0, 100))
    write_deltalake(path, ids_table(100, 50), mode="append")
    write_deltalake(path, ids_table(500, 20), mode="overwrite")
    # delta-rs dates versions by their log files' modification times: fix them to known instants.
    for version, day in enumerate([1, 2, 3]):
        stamp = datetime.datetime(2024, 5, day, 12, tzinfo=datetime.timezone.utc).timestamp()
        os.utime(os.path.join(path, "_delta_log", f"{version:020d}.json"), (stamp, stamp))
    return path


def test_delta_latest_version_and_time_travel_by_version(delta_table):
    assert DeltaTable(delta_table).version() == 2
    latest = connectors.DeltaSource(delta_table).resolve()
    assert latest.description == f"Delta table {delta_table} version 2"
    assert read_ids(inspect_dataset(latest, ["features"], "label")) == list(range(500, 520))

    first = prepare_dataset(
        connectors.DeltaSource(delta_table, version=0), ["features"], num_workers=2, label_col="label"
    )
    assert first.num_rows == 100 and read_ids(first, world_size=2) == list(range(100))
    second = inspect_dataset(connectors.DeltaSource(delta_table, version=1).resolve(), ["features"], "label")
    assert second.num_rows == 150 and read_ids(second) == list(range(150))
    # Only the version's files: the files of version 0 plus the appended one, none removed later.
    assert len(second.files) == 2 and all(f.url.startswith("file://") for f in second.files)


def test_delta_time_travel_by_timestamp(delta_table):
    def rows_at(timestamp):
        return inspect_dataset(
            connectors.DeltaSource(delta_table, timestamp=timestamp).resolve(), ["features"], "label"
        ).num_rows

    assert rows_at("2024-05-01T18:00:00Z") == 100
    assert rows_at(datetime.datetime(2024, 5, 2, 13, tzinfo=datetime.timezone.utc)) == 150
    assert rows_at("2024-06-01T00:00:00Z") == 20


def test_delta_source_through_prepare_data_splits_training_and_validation_rows(delta_table):
    """What fit and run do with a Delta source before launch (prepare_data; training on it is
    tests/integration/test_connectors.py), read here as each task would: the ranks' batches of an
    epoch and the validation pass split the version's 150 rows, none in both."""
    from sparkdl._runtime.validation import validation_source
    from sparkdl.data.batching import batches, validation_batches
    from sparkdl.data.selection import shard_rows

    dataset, spec, reader, steps = prepare_data(
        connectors.DeltaSource(delta_table, version=1),
        DataSettings(feature_cols=["features"], label_col="label", batch_size=10, validation=0.2, reader="arrow"),
        num_workers=2,
    )
    assert dataset.num_rows == 150 and spec.holdout == 0.2
    training_rows = shard_rows(dataset, 2, 0.2, "train")
    assert steps == sum(training_rows) // 20 and 100 < sum(training_rows) < 140  # about 80% of 150

    trained, validated = set(), []
    for rank in range(2):
        stream = batches(reader, dataset, spec, rank, 2)
        for _ in range(steps):
            features, labels = next(stream)
            assert features.shape == (10, 2) and np.array_equal(labels, features[:, 0].astype(int) % 2)
            trained |= set(features[:, 0].astype(int).tolist())
        stream.close()
        for features, _ in validation_batches(reader, *validation_source(dataset, spec), rank, 2):
            validated += features[:, 0].astype(int).tolist()
    assert len(validated) == len(set(validated)) == 150 - sum(training_rows)
    assert not trained & set(validated), "a held-out row was trained on"
    assert trained | set(validated) <= set(range(150)) and len(trained) >= steps * 10


def test_delta_errors_are_named(tmp_path, delta_table):
    with pytest.raises(DataError, match="no Delta table at"):
        connectors.DeltaSource(str(tmp_path / "missing")).resolve()
    with pytest.raises(DataError, match="cannot load Delta table .*version 7"):
        connectors.DeltaSource(delta_table, version=7).resolve()
    with pytest.raises(ConfigError, match="pass version= or timestamp=, not both"):
        connectors.DeltaSource(delta_table, version=0, timestamp="2024-05-01T00:00:00Z")

    partitioned = str(tmp_path / "partitioned")
    write_deltalake(partitioned, ids_table(0, 40), partition_by=["day"])
    # A partition column's values come from the log (tests/unit/test_delta_tables.py has the rest).
    info = inspect_dataset(
        connectors.DeltaSource(partitioned).resolve(None, ["features", "day"]),
        ["features"],
        "label",
        filters=[("day", "=", "tue")],
    )
    assert info.num_rows == 40 and len(info.files) == 2
    assert read_ids(info, filters=[("day", "=", "tue")]) == list(range(1, 40, 2))


@pytest.mark.petastorm
def test_petastorm_reads_a_connectors_explicit_file_list_in_its_order(tmp_path):
    for day in ("2024-01-01", "2024-01-02"):
        os.makedirs(tmp_path / day)
        start = 0 if day.endswith("01") else 10
        pq.write_table(
            pa.table(
                {
                    "features": pa.array([[float(i)] for i in range(start, start + 10)], pa.list_(pa.float32())),
                    "label": list(range(10)),
                }
            ),
            tmp_path / day / "part-0.parquet",
        )
    info = prepare_dataset(
        connectors.ParquetSource(f"{tmp_path}/2024-01-*/part-*.parquet"), ["features"], num_workers=2, label_col="label"
    )
    assert info.explicit_files and read_ids(info, "petastorm", world_size=2) == read_ids(
        info, "arrow", world_size=2
    ) == list(range(20))


def test_the_old_top_level_import_path_still_works_and_says_where_connectors_went():
    """`import connectors` (and its submodules) of earlier releases: the same classes, with a
    DeprecationWarning naming the new path. In a fresh interpreter: the warning is issued once."""
    code = (
        "import warnings\n"
        "warnings.simplefilter('always')\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    import connectors, connectors.delta\n"
        "    from connectors.parquet import ParquetSource\n"
        "import sparkdl.connectors as new\n"
        "assert connectors.ParquetSource is new.ParquetSource is ParquetSource\n"
        "assert connectors.delta is new.delta and connectors.Source is new.Source\n"
        "messages = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]\n"
        "assert any('sparkdl.connectors' in m for m in messages), messages\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr
